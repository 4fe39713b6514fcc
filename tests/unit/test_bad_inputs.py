"""The catalogue of bad settings the operators refuse on the Airflow worker, before anything reaches Ray.

Each case is one kind of mistake; the error must name the setting and the value that was given. The
checks that need the data or the cluster (missing columns, unreadable files, unknown engine arguments,
GPUs the cluster lacks, a failing query) run in the job before any engine starts; their tests are in
tests/integration (test_vllm_batch, test_warehouse, test_buckets, test_model_upload).
"""

from __future__ import annotations

import json

import pytest
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_rayllm.exceptions import InvalidSpec

BASE = dict(task_id="answer", input_uri="/in.jsonl", model_source="/models/m", prompt_column="q", output_uri="/out")

# (kind of mistake, operator arguments, what the error must say)
VLLM_CASES = [
    ("batch size zero", {"batch_size": 0}, ["batch_size", "0"]),
    ("batch size not a number", {"batch_size": "many"}, ["batch_size", "'many'"]),
    ("concurrency zero", {"concurrency": 0}, ["concurrency", "0"]),
    ("concurrency range reversed", {"concurrency": (3, 1)}, ["concurrency", "(3, 1)"]),
    ("input on an unsupported scheme", {"input_uri": "ftp://x/y.jsonl"}, ["input_uri", "ftp://x/y.jsonl", "ftp"]),
    ("empty input location", {"input_uri": ""}, ["input_uri", "''"]),
    ("bucket URI without a bucket", {"input_uri": "s3://"}, ["input_uri", "'s3://'", "no bucket"]),
    (
        "a Hugging Face model repo as the input",
        {"input_uri": "hf://lmms-lab/LMMs-Eval-Lite/coco2017_cap_val/"},
        ["input_uri", "'hf://lmms-lab/LMMs-Eval-Lite/coco2017_cap_val/'", "a model repo", "hf://datasets/"],
    ),
    (
        "a Hugging Face Space as the input",
        {"input_uri": "hf://spaces/org/app/data.csv"},
        ["input_uri", "'hf://spaces/org/app/data.csv'", "a Space"],
    ),
    ("a Hugging Face URI with no dataset", {"input_uri": "hf://datasets/lmms-lab"}, ["input_uri", "names no dataset"]),
    (
        "output to the Hugging Face Hub",
        {"output_uri": "hf://datasets/org/out"},
        ["output_uri", "'hf://datasets/org/out'", "read only"],
    ),
    ("unknown input format", {"input_format": "xml"}, ["input_format", "'xml'"]),
    ("output format we cannot write", {"output_format": "csv"}, ["output_format", "'csv'"]),
    ("output on an unsupported scheme", {"output_uri": "ftp://out"}, ["output_uri", "ftp://out"]),
    ("error fraction above one", {"max_error_fraction": 1.5}, ["max_error_fraction", "1.5"]),
    ("negative error fraction", {"max_error_fraction": -0.1}, ["max_error_fraction", "-0.1"]),
    ("row limit zero", {"max_rows": 0}, ["max_rows", "0"]),
    ("no way to build prompts", {"prompt_column": None}, ["prompt_column", "got none"]),
    ("two ways to build prompts", {"prompt_template": "Q: {q}"}, ["prompt_column", "template"]),
    (
        "a template with literal JSON braces",
        {"prompt_column": None, "prompt_template": 'Answer as {"answer": "..."} about {q}'},
        ["prompt_template", "is not a column name", "doubled"],
    ),
    ("system prompt not text", {"system_prompt": 3}, ["system_prompt", "3"]),
    ("empty model source", {"model_source": ""}, ["model_source", "''"]),
    ("unknown resource profile", {"resource_profile": "tpu"}, ["resource_profile", "'tpu'"]),
    ("tensor parallel size zero", {"engine_kwargs": {"tensor_parallel_size": 0}}, ["tensor_parallel_size", "0"]),
    (
        "pipeline parallel size not a number",
        {"engine_kwargs": {"pipeline_parallel_size": "two"}},
        ["pipeline_parallel_size", "'two'"],
    ),
    (
        "bundles that do not match tp x pp",
        {"engine_kwargs": {"tensor_parallel_size": 2}, "placement_group_config": {"bundles": [{"CPU": 1}]}},
        ["bundles", "1 bundle", "2 x 1"],
    ),
    (
        "unknown placement strategy",
        {"placement_group_config": {"bundles": [{"CPU": 1}], "strategy": "EVERYWHERE"}},
        ["strategy", "'EVERYWHERE'"],
    ),
    (
        "unknown placement key",
        {"placement_group_config": {"bundle": [{"CPU": 1}]}},
        ["placement_group_config", "'bundle'"],
    ),
    ("LoRA routing without LoRA", {"lora_column": "adapter"}, ["lora_column", "enable_lora"]),
    (
        "guide and new stage names together",
        {"apply_chat_template": False, "chat_template_stage": True},
        ["apply_chat_template", "chat_template_stage"],
    ),
    ("query without a connection", {"sql": "select 1", "input_uri": None}, ["sql", "sql_conn_id"]),
    (
        "query on a connection that is no database",
        {"sql": "select 1", "sql_conn_id": "ftp_box", "input_uri": None},
        ["ftp_box", "'ftp'"],
    ),
    ("neither files nor a query", {"input_uri": None}, ["input_uri", "sql"]),
    ("output table without a connection", {"output_table": "answers"}, ["output_table", "output_table_conn_id"]),
    (
        "output table name that is not a plain name",
        {"output_table": "answers; drop table x", "output_table_conn_id": "pg_out"},
        ["answers; drop table x"],
    ),
    ("unknown task type", {"task_type": "summarize"}, ["task_type", "'summarize'"]),
    ("guide flag that is not True or False", {"tokenize": "yes"}, ["tokenize", "'yes'"]),
]


@pytest.fixture(autouse=True)
def connections(monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_FTP_BOX", json.dumps({"conn_type": "ftp", "host": "files.example"}))
    monkeypatch.setenv(
        "AIRFLOW_CONN_PG_OUT", json.dumps({"conn_type": "postgres", "host": "127.0.0.1", "schema": "db"})
    )


class Ti:
    dag_id, run_id, task_id, map_index, try_number = "dag", "manual__1", "answer", -1, 1

    def xcom_push(self, key, value):
        raise AssertionError("a refused configuration must not push anything")


def _refusal(build) -> str:
    """The refusal's message; an InvalidSpec, so it came before any submission (the operator has no hook:
    reaching for the Jobs API would raise something else), and an AirflowFailException, so Airflow spends no
    retry on it."""
    with pytest.raises(InvalidSpec) as exc:
        build()
    assert isinstance(exc.value, AirflowFailException)
    return str(exc.value)


@pytest.mark.parametrize("kind, overrides, expected", VLLM_CASES, ids=[c[0] for c in VLLM_CASES])
def test_vllm_operator_refuses(kind, overrides, expected, tmp_path):
    from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

    def build():
        op = VLLMBatchOperator(**{**BASE, **overrides})
        op.__dict__["hook"] = None  # any use of the Jobs API would fail loudly: nothing may reach Ray
        op.build_spec({"ti": Ti()}, tmp_path)

    message = _refusal(build)
    for part in expected:
        assert part in message, f"{kind}: {part!r} missing from {message!r}"


HTTP_CASES = [
    ("endpoint we do not call", {"endpoint": "images"}, ["endpoint", "'images'"]),
    ("negative rate cap", {"qps": -1}, ["qps", "-1"]),
    ("zero requests in flight", {"max_in_flight": 0}, ["max_in_flight", "0"]),
    ("negative retries", {"max_retries": -2}, ["max_retries", "-2"]),
    ("connection without a URL", {"http_conn_id": "no_host"}, ["no_host"]),
]


@pytest.mark.parametrize("kind, overrides, expected", HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
def test_http_operator_refuses(kind, overrides, expected, tmp_path, monkeypatch):
    from airflow_provider_rayllm.operators.http_batch import HttpLLMBatchOperator

    monkeypatch.setenv("AIRFLOW_CONN_LLM_OK", json.dumps({"conn_type": "http", "host": "http://127.0.0.1:9/v1"}))
    monkeypatch.setenv("AIRFLOW_CONN_NO_HOST", json.dumps({"conn_type": "http"}))
    args = {k: v for k, v in BASE.items() if k != "model_source"}

    def build():
        op = HttpLLMBatchOperator(**{**args, "model": "m", "http_conn_id": "llm_ok", **overrides})
        op.__dict__["hook"] = None
        op.build_spec({"ti": Ti()}, tmp_path)

    message = _refusal(build)
    for part in expected:
        assert part in message, f"{kind}: {part!r} missing from {message!r}"


def test_the_catalogue_is_long_enough():
    from tests.integration.helpers import record_figure

    kinds = len(VLLM_CASES) + len(HTTP_CASES)
    record_figure("bad_configuration_on_the_worker", kinds_refused=kinds)
    assert kinds >= 25
