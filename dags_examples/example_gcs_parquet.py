"""Bucket data: Parquet read from GCS, answers written to S3, credentials from Airflow connections.

`gcp_conn_id` and `aws_conn_id` name ordinary Airflow connections (google_cloud_platform, aws);
their secrets reach the Ray job's processes without appearing in the Jobs API record or the logs.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Param

from airflow_provider_rayllm.local.defaults import DEMO_MODEL
from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

with DAG(
    dag_id="example_gcs_parquet",
    start_date=datetime(2026, 1, 1),
    schedule="@daily",
    catchup=False,
    tags=["rayllm", "example", "buckets"],
    params={
        "model_source": Param(str(DEMO_MODEL), type="string", description="HF id, cluster path or bucket URI"),
        "input_uri": Param("gs://questions/batch/", type="string", description="Parquet files with a 'prompt' column"),
        "output_prefix": Param("s3://answers/daily", type="string", description="Where each day's answers go"),
    },
    render_template_as_native_obj=True,
) as dag:
    VLLMBatchOperator(
        task_id="generate",
        model_source="{{ params.model_source }}",
        input_uri="{{ params.input_uri }}",
        input_format="parquet",
        output_uri="{{ params.output_prefix }}/{{ ds }}",
        prompt_column="prompt",
        system_prompt="Answer briefly.",
        sampling_params={"temperature": 0, "max_tokens": 16},
        engine_kwargs={"max_model_len": 512},
        gcp_conn_id="gcs_default",
        aws_conn_id="aws_default",
    )
