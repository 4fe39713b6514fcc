"""A daily DAG for the backfill test: each logical date answers its own day's rows.

Run by a real Airflow (`airflow standalone`: scheduler, DAG processor, triggerer, API server) and
`airflow backfill create`; the endpoint is the tests' echo server (connection `llm_echo`), so a job costs
seconds, not an engine start. Inputs are ``$RAYLLM_BACKFILL_INPUTS/<ds>.jsonl``.
"""

from __future__ import annotations

import os
from datetime import datetime

from airflow.sdk import DAG

from airflow_provider_rayllm.operators.http_batch import HttpLLMBatchOperator

INPUTS = os.environ.get("RAYLLM_BACKFILL_INPUTS", "/tmp/rayllm-backfill-inputs")

with DAG(
    dag_id="rayllm_backfill",
    start_date=datetime(2026, 7, 1),
    end_date=datetime(2026, 7, 31),  # no scheduled run of today beside the backfills
    schedule="@daily",
    catchup=False,
    max_active_runs=2,
    tags=["rayllm", "test"],
) as dag:
    HttpLLMBatchOperator(
        task_id="answer",
        http_conn_id="llm_echo",
        model="echo",
        input_uri=INPUTS + "/{{ ds }}.jsonl",
        prompt_column="prompt",
        id_column="id",
        sampling_params={"max_tokens": 8},
        batch_size=4,
        max_in_flight=4,
        poll_interval=1.0,
    )
