"""Incremental runs on the local stack: a daily task over a table that changed by a few rows sends only those
rows to the endpoint (counted at the endpoint), reuses the rest from its previous run (found through Airflow's
XCom of that run), and a changed prompt computes every row again. Three Ray jobs against the echo endpoint."""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.integration.helpers import assert_succeeded, echo_connection, load_dag, read_rows, utc, write_jsonl, xcom

pytestmark = pytest.mark.integration

N = 20


def _requests(url: str) -> int:
    with urllib.request.urlopen(f"{url}/stats") as resp:
        return int(json.loads(resp.read())["total"])


def _run(test_home, day: int, rows: list[dict], template: str = "Review: {text}") -> dict:
    """One daily run of the DAG (its own logical date, input and output prefix); its manifest."""
    input_uri = write_jsonl(test_home / "inputs" / "incremental" / f"day{day}.jsonl", rows)
    conf = {
        "input_uri": input_uri,
        "output_uri": str(test_home / "out" / "incremental" / f"day{day}"),
        "template": template,
    }
    dag = load_dag("tests/dags", "rayllm_it", "rayllm_it_incremental")
    dag_run = dag.test(logical_date=utc(2026, 10, day), run_after=utc(2026, 10, day), run_conf=conf)
    assert_succeeded(dag_run, "label", context=f"day {day}:")
    return xcom(dag.dag_id, dag_run.run_id, "label", "return_value")


def _answers(manifest: dict) -> dict:
    out = read_rows(manifest["output_files"])
    ids = [r["id"] for r in out]
    assert len(ids) == len(set(ids)), "every id once"
    return {r["id"]: r["response"] for r in out}


def test_only_new_and_changed_rows_reach_the_endpoint(ray_conn, airflow_db, test_home, service_logs):
    day1 = [{"id": i, "text": f"review number {i}"} for i in range(N)]
    # Day 2: two reviews edited, one deleted, one added.
    day2 = [dict(r) for r in day1 if r["id"] != 7]
    day2[3]["text"] = "review number 3, edited"
    day2[11]["text"] = "review number 12, edited"
    day2.append({"id": 100, "text": "a new review"})
    with echo_connection("llm_incr", 0.01, service_logs) as url:
        first = _run(test_home, 1, day1)
        sent_first = _requests(url)
        second = _run(test_home, 2, day2)
        sent_second = _requests(url) - sent_first
        reworded = _run(test_home, 3, day2, template="Label this review: {text}")
        sent_third = _requests(url) - sent_first - sent_second

    assert sent_first == N
    assert first["incremental"] == {
        "base": None,
        "key": "id",
        "rows_reused": 0,
        "rows_computed": N,
        "rows_dropped": 0,
    }

    assert sent_second == 3, "only the two edited reviews and the new one are asked"
    inc = second["incremental"]
    assert inc["base"] == str(test_home / "out" / "incremental" / "day1" / "_manifest.json"), inc
    assert (inc["rows_reused"], inc["rows_computed"], inc["rows_dropped"]) == (N - 3, 3, 1)
    assert second["rows_in"] == second["rows_out"] == len(day2) and second["rows_resumed"] == N - 3
    assert _answers(second) == {r["id"]: f"echo: Review: {r['text']}" for r in day2}
    # The reused rows' token counts come with them: the tokens spent were the three rows'.
    assert second["output_tokens"] == 3 * 3

    assert sent_third == len(day2), "a changed prompt asks every row again"
    inc = reworded["incremental"]
    assert (inc["rows_reused"], inc["rows_computed"], inc["rows_dropped"]) == (0, len(day2), 0)
    assert _answers(reworded) == {r["id"]: f"echo: Label this review: {r['text']}" for r in day2}
