"""The run report: a page made from a manifest's body alone, that shows the run's figures, fetches nothing and
cannot be made to run a script by what users or their data put into the manifest."""

from __future__ import annotations

import os
from html.parser import HTMLParser
from urllib.parse import unquote, urlparse

from airflow_provider_rayllm.contract import report
from airflow_provider_rayllm.job.progress import StreamCounts, rows_over_time
from airflow_provider_rayllm.links import report_browser_url

HOSTILE = '<script>alert("x")</script><img src=x onerror=alert(1)>'


class Page(HTMLParser):
    """The page's elements (tag, attributes) and the text of each element that has an id."""

    def __init__(self, text: str):
        super().__init__()
        self.elements: list[tuple[str, dict[str, str | None]]] = []
        self.text_by_id: dict[str, str] = {}
        self.text: list[str] = []
        self._open: list[str | None] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        self.elements.append((tag, attributes))
        if tag not in ("meta", "line", "circle", "rect", "polyline", "br"):
            self._open.append(attributes.get("id"))

    def handle_endtag(self, tag):
        if tag not in ("meta", "line", "circle", "rect", "polyline", "br") and self._open:
            self._open.pop()

    def handle_data(self, data):
        self.text.append(data)
        for element_id in self._open:
            if element_id:
                self.text_by_id[element_id] = self.text_by_id.get(element_id, "") + data

    def tags(self, name: str) -> list[dict[str, str | None]]:
        return [a for t, a in self.elements if t == name]


def manifest(**changes) -> dict:
    series = [{"t_s": 10.0 + i, "rows": 8 * (i + 1), "tokens_out": 80 * (i + 1)} for i in range(6)]
    body = {
        "status": "SUCCEEDED",
        "submission_id": "rayllm-reviews-answer-0123456789-g0",
        "generation": "ti0.s1.20261204T000000-abc",
        "output_uri": "/data/out",
        "outputs_folder": "/data/out",
        "errors_folder": "/data/out/_errors",
        "format": "parquet",
        "output_files": [{"uri": "/data/out/part-a-00000.parquet", "rows": 45, "bytes": 9000}],
        "error_files": [{"uri": "/data/out/_errors/part-a-00000.parquet", "rows": 3, "bytes": 900}],
        "rows_in": 48,
        "rows_out": 45,
        "rows_errored": 3,
        "rows_resumed": 0,
        "errors_by_reason": {"prompt": 2, "HTTP 429": 1},
        "input_tokens": 1234,
        "output_tokens": 480,
        "wall_time_s": 30.0,
        "timeline": {
            "plan_started_s": 2.0,
            "engine_ready_s": 9.0,
            "first_answer_s": 10.0,
            "first_output_file_s": 12.0,
            "last_answer_s": 15.0,
            "stream_done_s": 24.0,
        },
        "rows_over_time": series,
        "started_at": "2026-12-04T00:00:00+00:00",
        "finished_at": "2026-12-04T00:00:30+00:00",
        "kind": "vllm",
        "model": "SmolLM2-135M-Instruct",
        "task_type": "generate",
        "versions": {"ray": "2.60.0"},
        "run": {"dag_id": "reviews", "run_id": "manual__1", "task_id": "answer"},
    }
    return {**body, **changes}


def test_the_page_shows_the_runs_rows_its_chart_and_its_seconds():
    body = manifest()
    page = Page(report.render(body))
    assert page.text_by_id["rows-out"] == f"{body['rows_out']:,}"
    charts = {svg.get("id") for svg in page.tags("svg") if svg.get("class") == "chart"}
    assert charts == {"rows-over-time", "seconds"}
    # The line starts at the plan's start with no rows and steps up to each sample, one dot per sample.
    points = page.tags("polyline")[0]["points"].split()
    assert len(points) == 2 * len(body["rows_over_time"]) + 1
    dots = [c for c in page.tags("circle")]
    assert len(dots) == len(body["rows_over_time"])
    assert len({d["cy"] for d in dots}) == len(dots), "each sample at its own height (rows rise)"
    # Seconds: the four phases cover the wall time, each shown.
    spans = report.phases(body)
    assert [name for name, _ in spans][0] == "start-up and checks"
    assert abs(sum(s for _, s in spans) - body["wall_time_s"]) < 1e-9
    text = "".join(page.text)
    for name, seconds in spans:
        assert name in text and f"{seconds:.1f} s" in text
    # tokens/s over the seconds the engine answered (ready to the stream's end), not the wall time.
    timeline = body["timeline"]
    rate = body["output_tokens"] / (timeline["stream_done_s"] - timeline["engine_ready_s"])
    assert f"{rate:,.1f}" in text
    for reason, count in body["errors_by_reason"].items():
        assert reason in page.text_by_id["errors"] and str(count) in page.text_by_id["errors"]


def test_an_incremental_run_shows_its_rows_reused_and_computed():
    inc = {
        "base": "/data/day1/_manifest.json",
        "key": "id",
        "rows_reused": 98000,
        "rows_computed": 2000,
        "rows_dropped": 7,
    }
    page = Page(report.render(manifest(incremental=inc)))
    assert (page.text_by_id["rows-reused"], page.text_by_id["rows-computed"]) == ("98,000", "2,000")
    assert inc["base"] in "".join(page.text)
    assert "rows-reused" not in report.render(manifest()), "a run without incremental has no such section"


def test_cost_is_shown_when_priced_and_said_not_priced_otherwise():
    priced = Page(report.render(manifest(estimated_cost=0.123456, cost_per_million_output_tokens=257.2)))
    assert "0.1235" in "".join(priced.text) and "not priced" not in "".join(priced.text)
    unpriced = "".join(Page(report.render(manifest())).text)
    assert "not priced" in unpriced


def test_user_strings_are_text_never_markup():
    body = manifest(
        model=HOSTILE,
        run={"dag_id": HOSTILE, "run_id": '"><script>alert(2)</script>', "task_id": "answer"},
        errors_by_reason={HOSTILE: 2},
        output_files=[{"uri": f"/data/{HOSTILE}.parquet", "rows": 1, "bytes": 1}],
    )
    page = Page(report.render(body))
    assert page.tags("script") == [] and page.tags("img") == []
    assert not any(k.startswith("on") for _, attrs in page.elements for k in attrs)
    assert HOSTILE in "".join(page.text), "shown as the text it is"


def test_the_page_fetches_nothing():
    page = Page(report.render(manifest()))
    assert page.tags("link") == [] and page.tags("script") == [] and page.tags("img") == []
    csp = [m for m in page.tags("meta") if m.get("http-equiv") == "Content-Security-Policy"]
    assert csp and "default-src 'none'" in (csp[0]["content"] or "")
    assert not [v for _, attrs in page.elements for v in attrs.values() if v and "://" in v and "w3.org" not in v]


def test_an_old_manifest_without_series_or_stream_end_still_renders():
    timeline = {"plan_started_s": 2.0, "engine_ready_s": None, "last_answer_s": 20.0}
    page = Page(report.render(manifest(rows_over_time=[], timeline=timeline, estimated_cost=None)))
    assert page.text_by_id["rows-out"] == "45"
    assert [n for n, _ in report.phases(manifest(timeline=timeline))] == [
        "start-up and checks",
        "streaming: answering and writing",
        "checks and publish",
    ]


def test_rows_over_time_is_bounded_summed_and_counts_a_retried_batch_once():
    counts = StreamCounts()
    for i in range(1000):
        counts.answered(f"t:{i}", 4, 0, 10, at=1000.0 + i / 10)
    counts.answered("t:999", 4, 0, 10, at=1100.0)  # the same batch of a retried task
    series = rows_over_time(counts.answered_series(), origin=990.0, points=60)
    assert len(series) <= 60
    assert series[-1]["rows"] == 4 * 1000 and series[-1]["tokens_out"] == 10 * 1000
    assert series[-1]["t_s"] == 1100.0 - 990.0
    assert all(a["rows"] < b["rows"] and a["t_s"] < b["t_s"] for a, b in zip(series, series[1:]))
    assert rows_over_time([], 0.0) == []
    one = rows_over_time([(5.0, 16, 100)], origin=2.0)
    assert one == [{"t_s": 3.0, "rows": 16, "tokens_out": 100}]


def test_the_reports_address_is_one_a_browser_opens(tmp_path):
    path = tmp_path / "run 1" / "_report.html"
    url = report_browser_url(str(path))
    assert url.startswith("file://") and unquote(urlparse(url).path) == str(path)
    assert report_browser_url("file://" + str(path)) == url
    assert report_browser_url("s3://b/a b/_report.html", s3_endpoint="http://127.0.0.1:9000/") == (
        "http://127.0.0.1:9000/b/a%20b/_report.html"
    )
    assert report_browser_url("s3://b/p/_report.html") == (
        "https://s3.console.aws.amazon.com/s3/object/b?prefix=p%2F_report.html"
    )
    assert report_browser_url("gs://b/p/_report.html") == "https://storage.cloud.google.com/b/p/_report.html"
    assert report_browser_url("gs://b/p/_report.html", gcs_endpoint="127.0.0.1:4443") == (
        "http://127.0.0.1:4443/storage/v1/b/b/o/p%2F_report.html?alt=media"
    )
    assert os.path.isabs(unquote(urlparse(report_browser_url("rel/_report.html")).path))
