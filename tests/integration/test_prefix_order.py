"""Prefix grouping on the local stack: requests that share a document reach the endpoint together, in the order
they arrive there (an echo endpoint that records it), while the input has the documents interleaved."""

from __future__ import annotations

import json
import urllib.request

import pytest

from airflow_provider_rayllm.hooks.ray_job import RayJobHook
from tests.integration.helpers import StandInTI, echo_connection, echo_operator, read_rows, record_figure, write_jsonl

pytestmark = pytest.mark.integration

DOCS, QUESTIONS = 4, 8


def _arrival_spans(test_home, service_logs, name: str, **settings) -> tuple[list[int], str]:
    """Each document's span in the endpoint's arrival order (last position - first + 1) for one job over the
    question-major input (document 0, 1, 2, 3, 0, 1, ...), and the job's submission id."""
    rows = [
        {"id": q * DOCS + d, "doc": d, "prompt": f"Document {d}: a long shared text.\n\nQuestion {q} about it?"}
        for q in range(QUESTIONS)
        for d in range(DOCS)
    ]
    input_uri = write_jsonl(test_home / "inputs" / f"{name}.jsonl", rows)
    with echo_connection(f"llm_{name}", 0.01, service_logs) as url:
        op = echo_operator(
            f"llm_{name}", name, input_uri, str(test_home / "out" / name), batch_size=4, max_in_flight=1, **settings
        )
        manifest = op.execute({"ti": StandInTI("prefix_order", f"manual__{name}", name)})
        with urllib.request.urlopen(f"{url}/stats") as resp:
            order = json.loads(resp.read())["order"]
    assert manifest["rows_out"] == len(rows) and manifest["rows_errored"] == 0
    out = read_rows(manifest["output_files"])
    assert sorted(r["id"] for r in out) == list(range(len(rows)))
    assert all(r["response"] == f"echo: {rows[r['id']]['prompt']}" for r in out), "a row lost its own answer"
    assert sorted(order) == sorted(r["prompt"] for r in rows)
    docs = [int(text.split(":", 1)[0].removeprefix("Document ")) for text in order]
    spans = [max(i for i, d in enumerate(docs) if d == doc) - docs.index(doc) + 1 for doc in range(DOCS)]
    return spans, manifest["submission_id"]


def test_requests_sharing_a_prefix_arrive_together_and_interleaved_when_off(ray_conn, test_home, service_logs):
    grouped, grouped_job = _arrival_spans(test_home, service_logs, "prefix_on")  # the default window
    interleaved, _ = _arrival_spans(test_home, service_logs, "prefix_off", prefix_window_rows=0)
    record_figure("prefix_order", docs=DOCS, questions=QUESTIONS, spans_on=grouped, spans_off=interleaved)
    # Together: a document's 8 requests within 16 arrivals (two batches are in flight at once, so the two
    # documents at a group boundary may alternate). Off: the input's interleaving, each spread over ~29.
    assert max(grouped) <= 2 * QUESTIONS, f"same-prefix requests scattered with grouping on: spans {grouped}"
    assert min(interleaved) > 3 * QUESTIONS, f"requests arrived grouped with grouping off: spans {interleaved}"
    # The grouping is an operator of its own in Ray Data's plan, not fused into the read: fused, the read ran
    # on past Ray Data's memory budget, holding the whole input's requests (docs/PERFORMANCE.md, Scale).
    log = RayJobHook().get_job_logs(grouped_job)
    plan = next(line for line in log.splitlines() if "Execution plan of Dataset" in line)
    assert "TaskPoolMapOperator[MapBatches(PrefixGrouping)]" in plan, f"prefix grouping fused with another step: {plan}"
