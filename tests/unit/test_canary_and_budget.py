"""The canary's verdict on its rows, the row keys that keep its rows from being answered twice, the budgets
that stop a run, and how the spec and the operators take these settings."""

from __future__ import annotations

import json

import pytest

from airflow_provider_rayllm.contract.spec import QualityGate, SpecError, parse_spec
from airflow_provider_rayllm.job import canary
from airflow_provider_rayllm.job.budget import Budget, BudgetExceeded, Prices
from airflow_provider_rayllm.job.errors import JobRefused
from tests.unit.test_spec import body

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


def http_spec(**limits):
    spec = body(limits=limits)
    del spec["processor"]
    spec["kind"] = "http"
    spec["http"] = {"base_url": "http://127.0.0.1:9/v1", "model": "m"}
    spec["prompt"]["sampling_params"] = {"structured_outputs": {"json": json.dumps(SCHEMA)}}
    return parse_spec(spec)


def rows(*answers):
    return [{"id": i, "response": a} for i, a in enumerate(answers)]


def test_answers_that_break_the_schema_fail_the_canary_with_examples():
    gate = QualityGate(min_json_schema_pass_rate=0.75)
    spec = http_spec(canary_rows=4, quality_gate=gate.model_dump())
    good, bad = '{"answer": 4}', ["echo: 2 + 2", '{"answer": "four"}']
    verdict = canary.judge(gate, spec, rows(good, good, *bad), [], "/nowhere")
    assert not verdict.passed
    assert verdict.figures["json_schema_pass_rate"] == 2 / 4
    (reason,) = verdict.reasons
    assert "2 of 4 answers" in reason and "min_json_schema_pass_rate=0.75" in reason
    assert [e["row"] for e in verdict.examples] == [json.dumps(r) for r in rows(good, good, *bad)[2:]]
    assert verdict.examples[0]["why"].startswith("not JSON") and verdict.examples[1]["why"].startswith("schema:")
    assert canary.judge(gate, spec, rows(good, good, good, *bad[:1]), [], "/nowhere").passed


def test_the_error_rate_and_the_mean_length_each_judge_with_their_figure():
    gate = QualityGate(max_error_rate=0.25, min_mean_output_chars=6)
    spec = http_spec(canary_rows=4, quality_gate=gate.model_dump())
    errors = [{"id": 9, "error": "HTTP 500: down"}] * 2
    verdict = canary.judge(gate, spec, rows("abcd", "abcdefgh"), errors, "/nowhere")
    assert verdict.figures["error_rate"] == len(errors) / (len(errors) + 2)
    assert verdict.figures["mean_output_chars"] == (4 + 8) / 2
    assert len(verdict.reasons) == 1 and "above max_error_rate=0.25" in verdict.reasons[0]
    longer = canary.judge(gate, spec, rows("abcdef", "abcdefgh"), [], "/nowhere")
    assert longer.passed
    short = canary.judge(gate, spec, rows("ab", "abc"), [], "/nowhere")
    assert not short.passed and "below min_mean_output_chars=6" in short.reasons[0]


def no_echoes(outputs):
    echoed = [r["id"] for r in outputs if str(r["response"]).startswith("echo:")]
    return (not echoed, f"rows {echoed} echo the prompt")


def test_the_users_check_runs_on_the_canary_rows_and_its_reason_is_the_verdict():
    gate = QualityGate(check=f"{__name__}:no_echoes")
    spec = http_spec(canary_rows=2, quality_gate=gate.model_dump())
    verdict = canary.judge(gate, spec, rows("4", "echo: 2 + 2"), [], "/nowhere")
    assert not verdict.passed and "rows [1] echo the prompt" in verdict.reasons[0]
    assert canary.judge(gate, spec, rows("4", "5"), [], "/nowhere").passed


def test_a_check_returning_something_else_is_refused_naming_it():
    gate = QualityGate(check="json:dumps")
    spec = http_spec(canary_rows=2, quality_gate=gate.model_dump())
    with pytest.raises(JobRefused, match=r"check 'json:dumps' must return \(passed: bool, reason: str\)"):
        canary.judge(gate, spec, rows("4"), [], "/nowhere")


def test_the_canarys_rows_are_dropped_once_each_even_when_rows_repeat():
    keys = canary.CanaryKeys()
    first, second = canary.row_key({"q": "a"}), canary.row_key({"q": "b"})
    keys.note("t1:1", [first, first])
    keys.note("t1:1", [first, first])  # a retried batch replaces its first try's keys
    assert keys.noted_rows() == 2
    # The full stream meets "a" three times: two were the canary's, the third is a row of its own.
    assert keys.drop("t2:1", [first, second, first]) == [True, False, True]
    assert keys.drop("t3:1", [first]) == [False]
    assert keys.drop("t2:1", [first, second, first]) == [True, False, True]  # a retried batch: the same answer
    assert keys.dropped() == 2


def test_a_token_budget_stops_once_passed_and_not_before():
    budget = Budget(max_tokens=100, max_cost=None, prices=Prices())
    budget.check(60, 40, now=0.0)
    with pytest.raises(BudgetExceeded, match=r"101 tokens \(60 in, 41 out\) passed max_tokens_budget=100"):
        budget.check(60, 41, now=0.0)


def test_the_cost_budget_counts_tokens_and_engine_time():
    per_token = Budget(None, 1.0, Prices(per_1k_input=0.5, per_1k_output=1.5))
    per_token.check(1000, 333, now=0.0)  # 0.5 + 0.4995
    with pytest.raises(BudgetExceeded, match="passed max_cost=1.0"):
        per_token.check(1000, 334, now=0.0)
    hourly = Prices(per_second=2.0 / 3600, since=1000.0)  # 2 per hour
    assert hourly.cost(10**6, 10**6, now=1000.0 + 900) == pytest.approx(0.5)
    timed = Budget(None, 0.5, hourly)
    timed.check(0, 0, now=1000.0 + 899)
    with pytest.raises(BudgetExceeded):
        timed.check(0, 0, now=1000.0 + 901)


@pytest.mark.parametrize(
    "limits, words",
    [
        ({"quality_gate": {"max_error_rate": 0.1}}, "limits.quality_gate needs limits.canary_rows"),
        ({"canary_rows": 4, "quality_gate": {}}, "quality_gate sets no test"),
        ({"max_cost": 2.0}, "limits.max_cost=2.0 needs a price"),
        ({"canary_rows": 0}, "limits.canary_rows"),
        ({"canary_rows": 4, "quality_gate": {"max_error_rate": 0.1, "maximum": 1}}, "maximum: unknown setting"),
    ],
)
def test_limits_that_cannot_work_are_refused_naming_them(limits, words):
    with pytest.raises(SpecError) as refused:
        parse_spec(body(limits=limits))
    assert words in str(refused.value), str(refused.value)


def test_a_schema_rate_needs_a_schema_to_judge_by():
    gate = {"min_json_schema_pass_rate": 0.9}
    with pytest.raises(SpecError, match="min_json_schema_pass_rate needs a JSON schema"):
        parse_spec(body(limits={"canary_rows": 4, "quality_gate": gate}))
    guided = body(limits={"canary_rows": 4, "quality_gate": gate})
    guided["prompt"]["sampling_params"] = {"guided_json": SCHEMA}
    assert parse_spec(guided).json_schema() == SCHEMA
    assert parse_spec(body(limits={"max_cost": 2.0}, processor__price_per_hour=1.0)).limits.max_cost == 2.0


def test_the_operators_take_the_gate_as_a_model_or_a_dict_and_pickle_a_callable_check(tmp_path):
    from airflow_provider_rayllm.operators.http_batch import HttpLLMBatchOperator
    from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

    common = dict(input_uri="/in.jsonl", prompt_column="q", canary_rows=8, max_tokens_budget=5000, max_cost=3.0)
    as_model = VLLMBatchOperator(
        task_id="a", model_source="/m", quality_gate=QualityGate(max_error_rate=0.2, check="pkg.mod:fn"), **common
    )
    limits = as_model.limits_body(tmp_path)
    assert limits["quality_gate"] == {"max_error_rate": 0.2, "check": {"import_path": "pkg.mod:fn"}}
    assert (limits["canary_rows"], limits["max_tokens_budget"], limits["max_cost"]) == (8, 5000, 3.0)
    as_dict = HttpLLMBatchOperator(task_id="b", model="m", quality_gate={"check": no_echoes}, **common)
    check = as_dict.limits_body(tmp_path)["quality_gate"]["check"]
    assert (tmp_path / check["pickled"]).exists() and check["digest"]


def test_prices_come_from_the_connections_extra_when_not_given(monkeypatch):
    from airflow_provider_rayllm.operators.batch import connection_price

    monkeypatch.setenv("AIRFLOW_CONN_PRICED", json.dumps({"conn_type": "ray", "extra": {"price_per_hour": "2.5"}}))
    assert connection_price("priced", "price_per_hour") == 2.5
    assert connection_price("priced", "price_per_1k_input_tokens") is None
    monkeypatch.setenv("AIRFLOW_CONN_BADPRICE", json.dumps({"conn_type": "ray", "extra": {"price_per_hour": "cheap"}}))
    with pytest.raises(SpecError, match=r"connection 'badprice': extra price_per_hour='cheap' is not a number"):
        connection_price("badprice", "price_per_hour")
