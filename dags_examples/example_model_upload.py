"""The guide's "cache model weights in remote object storage": upload once, then infer from the bucket.

`upload` copies the model to S3 (verified file by file; skipped when the same content is already
there); `answer` loads the model from the bucket URI the upload pushed to XCom. Settings match
example_vllm_batch, so with the same engine_kwargs the answers are those of the local folder at
temperature 0 (on a CPU, with the reproducible settings its engine_kwargs Param describes).
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Param

from airflow_provider_rayllm.local.defaults import DEMO_INPUT, DEMO_MODEL
from airflow_provider_rayllm.operators.model_upload import ModelUploadOperator
from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

with DAG(
    dag_id="example_model_upload",
    start_date=datetime(2026, 1, 1),
    schedule=None,
    catchup=False,
    tags=["rayllm", "example", "models"],
    params={
        "model_source": Param(str(DEMO_MODEL), type="string", description="HF id or a folder on the cluster"),
        "bucket_uri": Param("s3://models/SmolLM2-135M-Instruct", type="string", description="s3:// or gs:// prefix"),
        "input_uri": Param(str(DEMO_INPUT), type="string", description="Rows with a 'prompt' column"),
        "max_tokens": Param(24, type="integer", minimum=1, maximum=4096),
        "engine_kwargs": Param(
            {"max_model_len": 1024},
            type="object",
            description="vLLM engine arguments. On a CPU, {'max_num_seqs': 1, 'enable_prefix_caching': false} "
            "makes greedy answers reproducible run to run (the CPU kernels are not batch-invariant).",
        ),
    },
    render_template_as_native_obj=True,
) as dag:
    upload = ModelUploadOperator(
        task_id="upload",
        model_source="{{ params.model_source }}",
        bucket_uri="{{ params.bucket_uri }}",
        aws_conn_id="aws_default",
    )
    answer = VLLMBatchOperator(
        task_id="answer",
        model_source="{{ ti.xcom_pull(task_ids='upload', key='model_uri') }}",
        input_uri="{{ params.input_uri }}",
        prompt_column="prompt",
        system_prompt="You are a helpful assistant. Answer in one or two sentences.",
        sampling_params={"temperature": 0.0, "max_tokens": "{{ params.max_tokens }}"},
        engine_kwargs="{{ params.engine_kwargs }}",
        batch_size=16,
        aws_conn_id="aws_default",
    )
    upload >> answer
