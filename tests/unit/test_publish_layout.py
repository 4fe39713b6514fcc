"""The published prefix on a local folder: whatever ran into it before, a plain folder reader reads exactly
the last publish's rows; the manifest names exactly the visible files; live writers of other task
instances keep their folders, dead ones do not."""

from __future__ import annotations

import json
import os
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_rayllm.contract.names import ERRORS_DIR, MANIFEST_NAME, REQUEST_KEY_COLUMN, SUCCESS_MARKER
from airflow_provider_rayllm.contract.spec import FileSource, parse_spec
from airflow_provider_rayllm.contract.storage import read_manifest
from airflow_provider_rayllm.job.publish import generations, resume
from airflow_provider_rayllm.job.publish.lease import Lease
from airflow_provider_rayllm.job.publish.publisher import Publisher
from airflow_provider_rayllm.job.sinks.files import ERRORS, OUTPUTS
from airflow_provider_rayllm.job.sources import files as source_files


def _spec(prefix: str, run_id: str, id_column: str | None = None, table: dict | None = None):
    prompt = {"prompt_column": "q", **({"id_column": id_column} if id_column else {})}
    return parse_spec(
        {
            "source": {"uris": ["/in.jsonl"]},
            "prompt": prompt,
            "processor": {"model_source": "/m"},
            "sink": {"uri": prefix, **({"table": table} if table else {})},
            "run": {"dag_id": "reviews", "run_id": run_id, "task_id": "answer"},
        }
    )


def _write(folder, name: str, rows: list[dict]) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    pq.write_table(pa.table({k: [r[k] for r in rows] for k in rows[0]}), path)
    return {"uri": str(path), "rows": len(rows), "bytes": path.stat().st_size}


def _attempt(
    prefix, run_id: str, word: str, n: int = 10, errors: int = 1, table: dict | None = None
) -> tuple[Publisher, dict]:
    """A generation of the task instance ``run_id`` as the stream leaves it: its lease and its files (the
    answers in two files, ``errors`` error rows in one)."""
    spec = _spec(str(prefix), run_id, table=table)
    publisher = Publisher(spec, generations.start(spec))
    generations.write_lease(str(prefix), publisher.generation.name, f"sub-{word}")
    outputs, errs = prefix / "_generations" / publisher.generation.name / OUTPUTS, None
    rows = [{"id": i, "response": f"{word} {i}"} for i in range(n)]
    files = [
        _write(outputs, "part-000000.parquet", rows[: n // 2]),
        _write(outputs, "part-000001.parquet", rows[n // 2 :]),
    ]
    error_files = []
    if errors:
        errs = prefix / "_generations" / publisher.generation.name / ERRORS
        error_files = [_write(errs, "part-000002.parquet", [{"id": 100 + i, "error": "boom"} for i in range(errors)])]
    written = {
        "output_files": files,
        "error_files": error_files,
        "rows_out": n,
        "rows_errored": errors,
        "errors_by_reason": {"boom": errors} if errors else {},
        "input_tokens": 0,
        "output_tokens": 0,
    }
    return publisher, written


def _build(publisher: Publisher, rows_in: int):
    def build(written: dict) -> dict:
        return publisher.build_manifest(
            submission_id=f"sub-{publisher.generation.name}",
            written=written,
            rows_in=rows_in,
            started_at="2026-12-04T00:00:00+00:00",
            wall_time_s=1.0,
            timeline={},
            details={},
            versions={},
        )

    return build


def _publish(prefix, run_id: str, word: str, n: int = 10) -> dict:
    publisher, written = _attempt(prefix, run_id, word, n)
    body = publisher.publish(written, _build(publisher, n + 1))
    publisher.remove_older()
    return body


def _visible(prefix) -> set[str]:
    return {p.name for p in prefix.iterdir() if not p.name.startswith(("_", "."))}


def _generation_with_start(prefix, run_id: str, seconds_ago: float) -> generations.Generation:
    """A generation of another task instance that started ``seconds_ago``, with one output file."""
    from datetime import datetime, timezone

    start = datetime.fromtimestamp(time.time() - seconds_ago, timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    g = generations.Generation(generations.task_instance_key(_spec(str(prefix), run_id).run), "0" * 12, start, "abc123")
    _write(prefix / "_generations" / g.name / OUTPUTS, "part-000000.parquet", [{"id": 0, "response": "in flight"}])
    return g


def test_three_task_instances_into_one_prefix_read_as_the_last_publish(tmp_path):
    prefix = tmp_path / "reviews" / "2026-12-01"
    _publish(prefix, "manual__1", "first")
    _publish(prefix, "manual__2", "second")
    # Writers of other task instances while the third publishes: one alive, one whose lease expired, one
    # with no lease that started long ago (a writer from before leases, or one that died at once).
    ttl = generations.LEASE_TTL_S
    alive = _generation_with_start(prefix, "scheduled__4", 5)
    generations.write_lease(str(prefix), alive.name, "sub-alive")
    dead = _generation_with_start(prefix, "scheduled__5", ttl + 120)
    generations.write_lease(str(prefix), dead.name, "sub-dead", now=time.time() - ttl - 60)
    silent = _generation_with_start(prefix, "scheduled__6", ttl + 60)
    body = _publish(prefix, "manual__3", "third")

    table = pq.read_table(str(prefix))
    assert table.num_rows == 10, "the prefix reads as the last publish's rows, nothing else"
    assert sorted(table.column("response").to_pylist()) == sorted(f"third {i}" for i in range(10))
    assert (prefix / SUCCESS_MARKER).exists() and (prefix / SUCCESS_MARKER).read_bytes() == b""
    manifest = read_manifest(str(prefix))
    assert manifest == body and (prefix / MANIFEST_NAME).exists() and not (prefix / "manifest.json").exists()
    assert {f["uri"] for f in manifest["output_files"]} == {str(prefix / n) for n in _visible(prefix)}
    assert {f["uri"] for f in manifest["error_files"]} == {str(p) for p in (prefix / ERRORS_DIR).iterdir()}
    assert manifest["outputs_folder"] == str(prefix) and manifest["errors_folder"] == str(prefix / ERRORS_DIR)
    assert manifest["rows_out"] == 10 and sum(f["rows"] for f in manifest["output_files"]) == 10
    assert pq.read_table(str(prefix / ERRORS_DIR)).num_rows == 1
    left = {p.name for p in (prefix / "_generations").iterdir()}
    assert left == {alive.name}, "a live writer's folder stays; dead ones and every published one go"
    assert dead.name not in left and silent.name not in left
    # A later task reading the prefix as its input reads the published rows only.
    assert source_files.expand(FileSource(uris=[str(prefix)])) == sorted(f["uri"] for f in manifest["output_files"])


def test_a_crash_before_the_manifest_leaves_the_old_publish_whole_and_the_next_one_cleans_up(tmp_path):
    prefix = tmp_path / "out"
    first = _publish(prefix, "manual__1", "first")
    crashed, written = _attempt(prefix, "manual__2", "second")
    crashed.check_names_free(written)
    crashed.clear_success()
    crashed.move_into_place(written)  # the driver dies here: files moved, no manifest
    assert read_manifest(str(prefix)) == first and not (prefix / SUCCESS_MARKER).exists()
    assert all((prefix / f["uri"].rsplit("/", 1)[1]).exists() for f in first["output_files"])
    # Its lease is no longer renewed: past the grace, its moved files are leftovers.
    silent_since = time.time() - generations.PUBLISH_GRACE_S - 10
    generations.write_lease(str(prefix), crashed.generation.name, "sub-second", now=silent_since, publishing=True)
    third = _publish(prefix, "manual__3", "third")
    assert pq.read_table(str(prefix)).num_rows == 10 and (prefix / SUCCESS_MARKER).exists()
    assert {f["uri"] for f in third["output_files"]} == {str(prefix / n) for n in _visible(prefix)}


def test_a_retry_right_after_a_crash_in_the_publish_removes_its_own_leftovers(tmp_path):
    prefix = tmp_path / "out"
    crashed, written = _attempt(prefix, "manual__1", "first")
    crashed.clear_success()
    crashed.move_into_place(written)  # dies here; its lease is fresh, but the retry is the same task instance
    retry = _publish(prefix, "manual__1", "retry")
    assert sorted(pq.read_table(str(prefix)).column("response").to_pylist()) == sorted(f"retry {i}" for i in range(10))
    assert {f["uri"] for f in retry["output_files"]} == {str(prefix / n) for n in _visible(prefix)}
    assert not (prefix / "_generations").exists() or not list((prefix / "_generations").iterdir())


def test_a_publish_at_the_same_moment_keeps_the_others_moved_files(tmp_path):
    """B has moved its files and not yet written its manifest when A's step (4) runs: B's files stay, so
    the manifest B then writes names files that exist; B's own step (4) removes A's (A's publish is over)."""
    prefix = tmp_path / "out"
    a, a_written = _attempt(prefix, "manual__a", "a")
    b, b_written = _attempt(prefix, "manual__b", "b")
    b.clear_success()
    b.move_into_place(b_written)
    a.publish(a_written, _build(a, 11))
    a.remove_older()
    assert all(os.path.exists(f["uri"]) for f in b_written["output_files"]), "B's moved files stay"
    body = _build(b, 11)(b_written)
    b.write_manifest(body)
    b.remove_unlisted(body)
    b.mark_success()
    assert all(os.path.exists(f["uri"]) for f in body["output_files"])
    assert sorted(pq.read_table(str(prefix)).column("response").to_pylist()) == sorted(f"b {i}" for i in range(10))


def test_the_old_layouts_manifest_goes_and_a_foreign_file_stays(tmp_path):
    prefix = tmp_path / "out"
    prefix.mkdir()
    (prefix / "manifest.json").write_text("{}")
    (prefix / "notes.txt").write_text("mine")
    _publish(prefix, "manual__1", "first")
    assert not (prefix / "manifest.json").exists() and (prefix / "notes.txt").exists()


def test_a_resumed_attempt_publishes_the_saved_rows_moved_with_its_own(tmp_path):
    prefix = tmp_path / "out"
    spec = _spec(str(prefix), "manual__1", id_column="id")
    stopped = generations.start(spec)
    saved = _write(
        prefix / "_generations" / stopped.name / OUTPUTS,
        "part-000000.parquet",
        [
            {"id": 0, "response": "a", REQUEST_KEY_COLUMN: "k0"},
            {"id": 2, "response": "stale", REQUEST_KEY_COLUMN: "k2"},
        ],
    )
    publisher = Publisher(spec, generations.start(spec))
    assert publisher.find_saved() == [saved["uri"]]
    publisher.adopt_saved({(0, "k0")})  # id 2's request changed since: the stream asked it again
    written = {
        "output_files": [
            _write(
                prefix / "_generations" / publisher.generation.name / OUTPUTS,
                "part-000000.parquet",
                [{"id": 1, "response": "b"}],
            )
        ],
        "error_files": [],
        "rows_out": 1,
        "rows_errored": 0,
        "errors_by_reason": {},
        "input_tokens": 0,
        "output_tokens": 0,
    }
    publisher.check({"rows_read": 2, "rows_skipped": 1, "rows_saved": 2}, written)
    body = publisher.publish(written, _build(publisher, 2))
    assert publisher.remove_older() == [stopped.name]
    assert sorted(pq.read_table(str(prefix)).column("id").to_pylist()) == [0, 1]
    assert body["rows_resumed"] == 1 and body["rows_resume_stale"] == 1 and len(body["output_files"]) == 2
    assert not (prefix / "_generations").exists() or not list((prefix / "_generations").iterdir())
    assert resume.saved_files(str(prefix), generations.start(spec), body["generation"]) == []


def test_the_lease_is_written_at_once_and_renewed_until_stopped(tmp_path):
    prefix = str(tmp_path / "out")
    g = generations.start(_spec(prefix, "manual__1"))
    lease = Lease(prefix, g.name, "sub-1", renew_s=0.05).start()
    first = json.loads(open(generations.lease_uri(prefix, g.name)).read())
    assert first["submission_id"] == "sub-1"
    time.sleep(0.3)
    lease.stop()
    renewed = json.loads(open(generations.lease_uri(prefix, g.name)).read())["renewed_at"]
    assert renewed > first["renewed_at"]
    time.sleep(0.15)
    assert json.loads(open(generations.lease_uri(prefix, g.name)).read())["renewed_at"] == renewed
    assert not generations.expired(prefix, g)
    assert generations.expired(prefix, g, now=renewed + generations.LEASE_TTL_S + 1)


@pytest.mark.parametrize("seconds_ago, gone", [(60, False), (generations.LEASE_TTL_S + 60, True)])
def test_without_a_lease_the_start_in_the_name_decides(tmp_path, seconds_ago, gone):
    prefix = tmp_path / "out"
    g = _generation_with_start(prefix, "manual__9", seconds_ago)
    mine = generations.start(_spec(str(prefix), "manual__1"))
    assert (g.name in generations.remove_older(str(prefix), mine)) is gone


def test_the_report_is_written_beside_the_manifest_which_names_it_and_readers_skip_it(tmp_path):
    from airflow_provider_rayllm.contract import report
    from airflow_provider_rayllm.contract.names import REPORT_NAME

    prefix = tmp_path / "reviews" / "2026-12-01"
    body = _publish(prefix, "manual__1", "first")
    page = prefix / REPORT_NAME
    assert body["report_uri"] == str(page) and read_manifest(str(prefix))["report_uri"] == str(page)
    # Made from the manifest alone: the published manifest makes the same page again.
    assert page.read_text() == report.render(read_manifest(str(prefix)))
    assert f'<b id="rows-out">{body["rows_out"]}</b>' in page.read_text()
    assert pq.read_table(str(prefix)).num_rows == body["rows_out"], "folder readers skip the page"
    # A second publish replaces the page with its own figures.
    body = _publish(prefix, "manual__2", "second", n=7)
    assert f'<b id="rows-out">{body["rows_out"]}</b>' in page.read_text()


def test_the_table_and_the_manifest_name_one_generation_across_a_crash_on_either_side_of_the_manifest(
    tmp_path, monkeypatch
):
    """With an output table (SQLite): a crash after the rows are staged leaves the table and the manifest on
    the first publish; a crash after the manifest is written, before the table's switch commits, is
    completed by the next attempt's repair before it stages its own rows; that attempt leaves both on its
    generation."""
    import sqlite3

    from airflow_provider_rayllm.contract.names import SINK_SQL_URI_ENV

    db = tmp_path / "w.sqlite"
    sqlite3.connect(db).close()
    monkeypatch.setenv(SINK_SQL_URI_ENV, f"sqlite:{db}")
    prefix = tmp_path / "out"
    table = {"table": "answers", "dialect": "sqlite", "run_key": "reviews/manual__1/answer/-1"}

    def attempt(word: str) -> tuple[Publisher, dict, list[str]]:
        publisher, written = _attempt(prefix, "manual__1", word, table=table)
        publisher.find_saved()
        repaired = publisher.repair_table()
        publisher.stage_table(written)
        return publisher, written, repaired

    def answers() -> tuple[set[str], str]:
        """(the generations a reader of the table sees, the generation a reader of the manifest sees)"""
        with sqlite3.connect(db) as conn:
            in_table = {g for (g,) in conn.execute("SELECT rayllm_generation FROM answers")}
        return in_table, read_manifest(str(prefix))["generation"]

    first, written, _ = attempt("first")
    first.publish(written, _build(first, 11))
    assert answers() == ({first.generation.name}, first.generation.name)

    staged, _, _ = attempt("staged-then-crashed")  # the driver died before the manifest
    assert answers() == ({first.generation.name}, first.generation.name), "both still the first publish"

    crashed, written, repaired = attempt("manifest-then-crashed")
    assert repaired == [f"dropped staged generation {staged.generation.name} (no manifest names it)"]

    def write_then_die(body: dict) -> None:
        Publisher.write_manifest(crashed, body)
        raise SystemExit("the driver died after the manifest")  # its open switch goes with its connection

    monkeypatch.setattr(crashed, "write_manifest", write_then_die)
    with pytest.raises(SystemExit):
        crashed.publish(written, _build(crashed, 11))
    assert answers() == ({first.generation.name}, crashed.generation.name), "the window: the switch rolled back"

    last, written, repaired = attempt("last")
    assert repaired == [
        f"switched in generation {crashed.generation.name} (the manifest names it; a crash cut its switch short)"
    ]
    last.publish(written, _build(last, 11))
    assert answers() == ({last.generation.name}, last.generation.name)
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT COUNT(*) FROM answers").fetchone()[0] == 10, "one row per answer, none twice"
        ledger = conn.execute("SELECT generation, state FROM rayllm_table_generations").fetchall()
        staging = conn.execute("SELECT name FROM sqlite_master WHERE name LIKE 'rayllm_staged_%'").fetchall()
    assert ledger == [(last.generation.name, "published")] and staging == []
