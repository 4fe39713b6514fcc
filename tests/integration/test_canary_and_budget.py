"""The canary and the budgets on the local cluster, against the echo endpoint (no engine starts): a failing
canary or a passed budget stops the job early, fails the task without a retry and leaves the earlier
publish as it was; a passing canary's rows are part of the output, every row answered once.

The endpoint's own request counts (GET /stats) say how many rows were sent."""

from __future__ import annotations

import glob
import json
import os
import time
import urllib.request

import pytest
from airflow.sdk.exceptions import AirflowFailException

from tests.integration.helpers import (
    StandInTI,
    echo_connection,
    echo_operator,
    read_rows,
    record_figure,
    write_jsonl,
)
from tests.integration.test_bad_input_jobs import _publish_good_output, _still_published

pytestmark = pytest.mark.integration

CONN = "llm_bad"  # the connection _publish_good_output's runs use
CANARY = 5
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


@pytest.fixture(scope="module")
def echo(service_logs):
    with echo_connection(CONN, 0.01, service_logs) as url:
        yield url


def sent(url: str, name: str) -> dict[str, int]:
    """Requests the endpoint got for each of this test's prompts (they all begin with its name)."""
    with urllib.request.urlopen(f"{url}/stats") as resp:
        counts = json.loads(resp.read())["requests"]
    return {prompt: n for prompt, n in counts.items() if prompt.startswith(f"{name} ")}


def _input(test_home, name: str, n: int) -> tuple[str, list[dict]]:
    rows = [{"id": i, "prompt": f"{name} {i}"} for i in range(n)]
    return write_jsonl(test_home / "inputs" / f"{name}.jsonl", rows), rows


def _run(name: str, input_uri: str, out: str, max_in_flight: int = 4, **kw):
    op = echo_operator(CONN, name, input_uri, out, max_in_flight=max_in_flight, batch_size=8, **kw)
    return op.execute({"ti": StandInTI("canary", f"manual__{name}", name)})


def test_a_canary_whose_answers_break_the_schema_stops_the_job_before_the_rest(ray_conn, echo, test_home):
    name = "canary_schema"
    out, before = _publish_good_output(test_home)
    input_uri, rows = _input(test_home, name, 200)
    started = time.monotonic()
    with pytest.raises(AirflowFailException) as failed:
        _run(
            name,
            input_uri,
            out,
            canary_rows=CANARY,
            quality_gate={"min_json_schema_pass_rate": 0.9},
            sampling_params={"structured_outputs": {"json": SCHEMA}},
        )
    seconds = time.monotonic() - started
    message = str(failed.value)
    assert "canary:" in message and "below min_json_schema_pass_rate=0.9" in message, message
    assert "\n" not in message, "the cause is one line"
    requests = sent(echo, name)
    assert 0 < sum(requests.values()) <= CANARY < len(rows), requests
    _still_published(out, before)
    (report_path,) = glob.glob(os.path.join(out, "_generations", "*", "_canary.json"))
    assert report_path in message
    report = json.loads(open(report_path).read())
    assert report["passed"] is False and report["figures"]["rows"] == CANARY
    assert report["figures"]["json_schema_pass_rate"] == 0
    assert report["examples"] and all(e["why"].startswith("not JSON") for e in report["examples"])
    assert report["input_tokens"] > 0 and report["output_tokens"] > 0
    record_figure(
        "canary_fails", rows=len(rows), canary_rows=CANARY, sent=sum(requests.values()), seconds=round(seconds, 1)
    )


def test_a_passing_canarys_rows_are_answered_once_and_published_with_the_rest(ray_conn, echo, test_home):
    name = "canary_pass"
    out = str(test_home / "out" / "canary" / name)
    input_uri, rows = _input(test_home, name, 40)
    manifest = _run(
        name, input_uri, out, canary_rows=CANARY, quality_gate={"max_error_rate": 0.0, "min_mean_output_chars": 5}
    )
    assert manifest["rows_in"] == manifest["rows_out"] == len(rows) and manifest["rows_errored"] == 0
    published = read_rows(manifest["output_files"])
    assert sorted(r["id"] for r in published) == [r["id"] for r in rows]
    assert all(r["response"] == f"echo: {r['prompt']}" for r in published)
    assert sent(echo, name) == {r["prompt"]: 1 for r in rows}, "each row is sent once, the canary's too"
    gate = manifest["canary"]
    assert gate["passed"] and gate["canary_rows"] == gate["figures"]["rows"] == CANARY
    assert manifest["input_tokens"] == sum(r["num_input_tokens"] for r in published)
    assert "estimated_cost" in manifest


@pytest.mark.parametrize(
    "name, budget, words",
    [
        ("budget_tokens", {"max_tokens_budget": 80}, "passed max_tokens_budget=80"),
        (
            "budget_cost",
            {"max_cost": 0.05, "price_per_1k_input_tokens": 1.0, "price_per_1k_output_tokens": 2.0},
            "passed max_cost=0.05",
        ),
    ],
)
def test_a_run_that_passes_its_budget_stops_and_publishes_nothing(name, budget, words, ray_conn, echo, test_home):
    out, before = _publish_good_output(test_home)
    # Enough rows that sending them all takes seconds (2 in flight, 10 ms each): the budget's check runs on
    # answers downstream of the caller, on a busy 2-CPU machine up to a few seconds behind it.
    input_uri, rows = _input(test_home, name, 1000)
    with pytest.raises(AirflowFailException) as failed:
        _run(name, input_uri, out, max_in_flight=2, **budget)
    message = str(failed.value)
    assert "budget:" in message and words in message, message
    requests = sum(sent(echo, name).values())
    assert 0 < requests < len(rows)
    _still_published(out, before)
    record_figure(name, rows=len(rows), sent=requests, **budget)
