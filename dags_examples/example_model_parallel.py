"""The guide's model parallelism and cross-node sections: one engine split over several workers, and
engine replicas placed on chosen nodes.

`engine_kwargs` carries the guide's `tensor_parallel_size`, `pipeline_parallel_size` and
`distributed_executor_backend`; `placement_group_config` its bundles and strategy; `concurrency` the
number of engine replicas. The defaults run on the embedded stack started with worker nodes
(`python -m airflow_provider_rayllm.local start --worker-nodes 2`, each node offering the custom resource
`rayllm_engine_node`): two replicas of SmolLM2-135M-Instruct (`concurrency=[2, 2]`: an integer n lets
Ray Data start between 1 and n), each split into two pipeline stages, one replica per worker node.

On a CPU cluster vLLM runs an engine's workers on the engine's own node (the `mp` executor); its CPU build
refuses the `ray` executor that spreads workers over nodes, and the job says so before any engine starts.
On a GPU cluster, the guide's settings apply as written, e.g. `{"tensor_parallel_size": 2,
"pipeline_parallel_size": 2, "distributed_executor_backend": "ray"}` with
`{"bundles": [{"GPU": 1}] * 4, "strategy": "STRICT_PACK"}` and `accelerator_type="L4"`.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Param

from airflow_provider_rayllm.local.defaults import DEMO_INPUT, DEMO_MODEL
from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

# Each engine (2 pipeline stages) asks for one worker node's `rayllm_engine_node` resource, so two
# replicas land on two different nodes and none on the head.
ONE_ENGINE_PER_NODE = {
    "bundles": [{"CPU": 0.5, "rayllm_engine_node": 0.5}, {"CPU": 0.5, "rayllm_engine_node": 0.5}],
    "strategy": "STRICT_PACK",
}

with DAG(
    dag_id="example_model_parallel",
    start_date=datetime(2026, 1, 1),
    schedule=None,
    catchup=False,
    tags=["rayllm", "example", "parallelism"],
    params={
        "model_source": Param(str(DEMO_MODEL), type="string", description="HF id, cluster path or bucket URI"),
        "input_uri": Param(str(DEMO_INPUT), type="string", description="Rows with a 'prompt' column"),
        "engine_kwargs": Param(
            # Two replicas x two workers on one small machine: each worker gets a 256 MiB KV cache instead
            # of the CPU profile's share of RAM (gpu_memory_utilization=0.2 each ran the machine out of memory).
            {"pipeline_parallel_size": 2, "max_model_len": 1024, "kv_cache_memory_bytes": 256 * 1024 * 1024},
            type="object",
            description="tensor_parallel_size, pipeline_parallel_size, distributed_executor_backend and other vLLM "
            "engine arguments",
        ),
        "placement_group_config": Param(
            ONE_ENGINE_PER_NODE,
            type=["object", "null"],
            description="One bundle per engine worker ('bundles' or 'bundle_per_worker') and a 'strategy'",
        ),
        "concurrency": Param(
            [2, 2],
            type=["integer", "array"],
            description="Engine replicas: n scales between 1 and n as rows arrive, [m, n] between m and n",
        ),
        "accelerator_type": Param(None, type=["string", "null"], description="GPU type the engines need, e.g. 'L4'"),
    },
    render_template_as_native_obj=True,
) as dag:
    answer = VLLMBatchOperator(
        task_id="answer",
        model_source="{{ params.model_source }}",
        input_uri="{{ params.input_uri }}",
        prompt_column="prompt",
        system_prompt="You are a helpful assistant. Answer in one or two sentences.",
        sampling_params={"temperature": 0.0, "max_tokens": 32},
        engine_kwargs="{{ params.engine_kwargs }}",
        placement_group_config="{{ params.placement_group_config }}",
        concurrency="{{ params.concurrency }}",
        accelerator_type="{{ params.accelerator_type }}",
        batch_size=8,
    )
