"""DAGs the integration tests run with dag.test(); every setting comes from the run's conf."""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Asset, Param

from airflow_provider_rayllm.operators.http_batch import HttpLLMBatchOperator
from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

PARAMS = {
    "model_source": Param("", type="string"),
    "input_uri": Param("", type="string"),
    "output_uri": Param("", type="string"),
    "prompt_column": Param("prompt", type="string"),
    "engine_kwargs": Param({}, type="object"),
    "sql": Param("", type="string"),
    "job_runtime_env": Param({}, type="object"),
}


def _operator(**overrides) -> VLLMBatchOperator:
    settings = dict(
        task_id="generate",
        model_source="{{ params.model_source }}",
        input_uri="{{ params.input_uri }}",
        output_uri="{{ params.output_uri or None }}",
        prompt_column="{{ params.prompt_column }}",
        system_prompt="Answer briefly.",
        sampling_params={"temperature": 0, "max_tokens": 16},
        engine_kwargs="{{ params.engine_kwargs }}",
        max_error_fraction=0.25,
        batch_size=8,
        poll_interval=1.0,
    )
    settings.update(overrides)
    return VLLMBatchOperator(**settings)


_VARIANTS = {
    "rayllm_it_deferred": {
        "deferrable": True,
        "outlets": [Asset("rayllm://tests/deferred-answers")],
        "price_per_hour": 0.25,
    },
    "rayllm_it_sync": {"deferrable": False},
    # Input from a SQL query on the `sql_test` connection.
    "rayllm_it_sql": {"deferrable": False, "input_uri": None, "sql": "{{ params.sql }}", "sql_conn_id": "sql_test"},
    # A model by Hugging Face id, its token from the `hf_test` connection, the Hub's address in the job's env.
    "rayllm_it_hub": {"deferrable": False, "hf_conn_id": "hf_test", "job_runtime_env": "{{ params.job_runtime_env }}"},
}

for _dag_id, _kwargs in _VARIANTS.items():
    with DAG(
        dag_id=_dag_id,
        start_date=datetime(2026, 1, 1),
        schedule=None,
        params=PARAMS,
        render_template_as_native_obj=True,
    ) as _dag:
        _operator(**_kwargs)
    globals()[_dag_id] = _dag


# The HTTP operator against whatever the `llm_test` connection points at.
with DAG(
    dag_id="rayllm_it_http",
    start_date=datetime(2026, 1, 1),
    schedule=None,
    params={
        **PARAMS,
        "model": Param("smollm2", type="string"),
        "qps": Param(None, type=["null", "number"]),
        "max_in_flight": Param(16, type="integer"),
        "concurrency": Param(1, type="integer"),
    },
    render_template_as_native_obj=True,
) as rayllm_it_http:
    HttpLLMBatchOperator(
        task_id="call",
        http_conn_id="llm_test",
        model="{{ params.model }}",
        input_uri="{{ params.input_uri }}",
        output_uri="{{ params.output_uri or None }}",
        prompt_column="prompt",
        sampling_params={"temperature": 0, "max_tokens": 16},
        max_in_flight="{{ params.max_in_flight }}",
        qps="{{ params.qps }}",
        concurrency=2,
        batch_size=32,
        max_retries=30,
        max_total_wait_s=120,
        price_per_1k_input_tokens=0.5,
        price_per_1k_output_tokens=1.5,
        max_error_fraction=0.1,
        poll_interval=1.0,
    )


# Deferred, reaching the Ray cluster through the `ray_proxy` connection (a relay the test can cut).
with DAG(
    dag_id="rayllm_it_http_proxy",
    start_date=datetime(2026, 1, 1),
    schedule=None,
    params=PARAMS,
    render_template_as_native_obj=True,
) as rayllm_it_http_proxy:
    HttpLLMBatchOperator(
        task_id="call",
        ray_conn_id="ray_proxy",
        http_conn_id="llm_rel",
        model="echo",
        input_uri="{{ params.input_uri }}",
        output_uri="{{ params.output_uri or None }}",
        prompt_column="prompt",
        sampling_params={"max_tokens": 8},
        batch_size=8,
        max_in_flight=2,
        deferrable=True,
        poll_interval=1.0,
        unreachable_timeout=120,
    )


# A daily job over a table that changes a little: only new and changed rows reach the `llm_incr` endpoint; the
# base is the output this task pushed in its latest earlier successful run.
with DAG(
    dag_id="rayllm_it_incremental",
    start_date=datetime(2026, 1, 1),
    schedule=None,
    params={**PARAMS, "template": Param("Review: {text}", type="string")},
    render_template_as_native_obj=True,
) as rayllm_it_incremental:
    HttpLLMBatchOperator(
        task_id="label",
        http_conn_id="llm_incr",
        model="echo",
        input_uri="{{ params.input_uri }}",
        output_uri="{{ params.output_uri }}",
        prompt_template="{{ params.template }}",
        id_column="id",
        incremental=True,
        sampling_params={"max_tokens": 8},
        batch_size=8,
        max_in_flight=8,
        deferrable=False,
        poll_interval=0.5,
    )
