"""One job per shard with dynamic task mapping: the input files a glob finds at run time, each answered by
its own HttpLLMBatchOperator map index (its own Ray job and its own output prefix, retried alone).

The endpoint is the Airflow connection `llm_endpoint_default` (see example_http_batch).
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Param, task

from airflow_provider_rayllm.local.defaults import DEMO_INPUT
from airflow_provider_rayllm.operators.http_batch import HttpLLMBatchOperator

with DAG(
    dag_id="example_sharded_http",
    start_date=datetime(2026, 1, 1),
    schedule=None,
    catchup=False,
    tags=["rayllm", "example", "http", "mapping"],
    params={
        "input_glob": Param(str(DEMO_INPUT), type="string", description="Files to answer, one job per file"),
        "model": Param("gpt-4o-mini", type="string", description="Model name the endpoint serves"),
    },
) as dag:

    @task
    def shards(params=None) -> list[str]:
        import glob

        found = sorted(glob.glob(params["input_glob"]))
        if not found:
            raise ValueError(f"input_glob {params['input_glob']!r} matches no file")
        return found

    HttpLLMBatchOperator.partial(
        task_id="answer_shard",
        http_conn_id="llm_endpoint_default",
        model="{{ params.model }}",
        prompt_column="prompt",
        sampling_params={"temperature": 0.0, "max_tokens": 32},
        max_in_flight=8,
    ).expand(input_uri=shards())
