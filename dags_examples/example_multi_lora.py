"""The guide's multi-LoRA section: one engine, a LoRA adapter chosen per row.

Rows whose `adapter` column is empty use the base model; others name a subfolder of
`dynamic_lora_loading_path` (a local folder on the cluster, or an s3:// / gs:// prefix). Names are
checked against `lora_adapters` before any engine starts.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Param

from airflow_provider_rayllm.local.defaults import DEMO_INPUT, DEMO_LORA_ADAPTER, DEMO_LORA_DIR, DEMO_MODEL
from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

with DAG(
    dag_id="example_multi_lora",
    start_date=datetime(2026, 1, 1),
    schedule=None,
    catchup=False,
    tags=["rayllm", "example", "lora"],
    params={
        "model_source": Param(str(DEMO_MODEL), type="string", description="Base model"),
        "input_uri": Param(str(DEMO_INPUT), type="string", description="Rows with 'prompt' and 'adapter'"),
        "adapters": Param(str(DEMO_LORA_DIR), type="string", description="Folder or bucket of adapters"),
    },
    render_template_as_native_obj=True,
) as dag:
    VLLMBatchOperator(
        task_id="generate",
        model_source="{{ params.model_source }}",
        input_uri="{{ params.input_uri }}",
        prompt_column="prompt",
        lora_column="adapter",
        lora_adapters=[DEMO_LORA_ADAPTER],
        dynamic_lora_loading_path="{{ params.adapters }}",
        engine_kwargs={"enable_lora": True, "max_lora_rank": 8, "max_loras": 1, "max_model_len": 512},
        sampling_params={"temperature": 0, "max_tokens": 24},
        batch_size=16,
    )
