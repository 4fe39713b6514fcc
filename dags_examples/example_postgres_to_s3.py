"""Warehouse in, bucket out: the Ray job runs the query itself and writes answers to S3.

Rows never pass through the Airflow worker: the operator sends the query and the connection's
credentials (as job secrets) to the Ray job, which reads with Ray Data's SQL reader.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Param

from airflow_provider_rayllm.local.defaults import DEMO_MODEL
from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

with DAG(
    dag_id="example_postgres_to_s3",
    start_date=datetime(2026, 1, 1),
    schedule="@daily",
    catchup=False,
    tags=["rayllm", "example", "warehouse"],
    params={
        "model_source": Param(str(DEMO_MODEL), type="string", description="HF id, cluster path or bucket URI"),
        "table": Param(
            "support_tickets",
            type="string",
            pattern=r"^[A-Za-z_][A-Za-z0-9_.]*$",
            description="Table with id, body and created_on columns (a plain identifier)",
        ),
        "output_prefix": Param("s3://llm-outputs/tickets", type="string", description="Bucket prefix for answers"),
        "max_tokens": Param(48, type="integer", minimum=1, maximum=1024, description="Tokens per summary"),
    },
    render_template_as_native_obj=True,
) as dag:
    VLLMBatchOperator(
        task_id="summarize_tickets",
        sql="SELECT id, body FROM {{ params.table }} WHERE created_on = '{{ ds }}'",
        sql_conn_id="postgres_default",
        model_source="{{ params.model_source }}",
        prompt_template="Summarize this support ticket in one sentence:\n{body}",
        sampling_params={"temperature": 0, "max_tokens": "{{ params.max_tokens }}"},
        engine_kwargs={"max_model_len": 1024},
        # One prefix per logical date: backfills never collide and a rerun replaces its own output.
        output_uri="{{ params.output_prefix }}/{{ ds }}",
        aws_conn_id="aws_default",
    )
