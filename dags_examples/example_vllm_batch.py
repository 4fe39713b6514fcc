"""The reference guide's quickstart as a DAG: questions in, one answer per row out, URIs in XCom.

Trigger it from the UI to change the model, input, output or sampling settings; the defaults run on
the embedded stack (`make demo`): SmolLM2-135M-Instruct on the CPU vLLM engine.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Param

from airflow_provider_rayllm.local.defaults import DEMO_INPUT, DEMO_MODEL
from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

with DAG(
    dag_id="example_vllm_batch",
    start_date=datetime(2026, 1, 1),
    schedule=None,
    catchup=False,
    tags=["rayllm", "example"],
    params={
        "model_source": Param(str(DEMO_MODEL), type="string", description="HF id, cluster path or bucket URI"),
        "input_uri": Param(str(DEMO_INPUT), type="string", description="JSONL/Parquet/CSV with a 'prompt' column"),
        "max_tokens": Param(64, type="integer", minimum=1, maximum=4096, description="Tokens to generate per row"),
        "temperature": Param(0.0, type="number", minimum=0, maximum=2, description="Sampling temperature"),
        "engine_kwargs": Param(
            {"max_model_len": 1024},
            type="object",
            description="vLLM engine arguments. On a CPU, {'max_num_seqs': 1, 'enable_prefix_caching': false} "
            "makes greedy answers reproducible run to run (the CPU kernels are not batch-invariant).",
        ),
    },
    render_template_as_native_obj=True,
) as dag:
    answer = VLLMBatchOperator(
        task_id="answer",
        model_source="{{ params.model_source }}",
        input_uri="{{ params.input_uri }}",
        prompt_column="prompt",
        system_prompt="You are a helpful assistant. Answer in one or two sentences.",
        sampling_params={"temperature": "{{ params.temperature }}", "max_tokens": "{{ params.max_tokens }}"},
        engine_kwargs="{{ params.engine_kwargs }}",
        batch_size=16,
        concurrency=1,
    )
