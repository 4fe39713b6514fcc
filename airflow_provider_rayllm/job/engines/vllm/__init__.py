"""The vLLM engine, in rooms:

    settings      the resource profile, engine_kwargs over the profile's defaults, placement, runtime env, feed
    hardware      the cluster's GPUs and their card; whether a CPU computes in half precision natively
    model_config  what the model's own config says (longest sequence, a classifier's labels)
    checks        what the driver checks before any engine starts
    processor     Ray Data's vLLM processor for the stream
    embed         embeddings of a one-worker engine: whole batches straight to vLLM's ``LLM.embed``
    outputs       vLLM's answers as output rows
    engine        ``VLLMEngine``: the above behind the engines' interface

The public names are importable from here too (``local.serve_app`` imports ``cpu_has_native_half``). No
module here imports vLLM at import time: the checks that need none refuse a job without its seconds of
import.
"""

from __future__ import annotations

from airflow_provider_rayllm.job.engines.vllm.checks import (
    check_engine_kwargs,
    check_lora_adapters,
    check_model_source,
    check_parallel,
    check_resources,
    check_sampling_params,
    check_task_type,
)
from airflow_provider_rayllm.job.engines.vllm.engine import VLLMEngine
from airflow_provider_rayllm.job.engines.vllm.hardware import (
    BIG_GPU_GIB,
    GpuCard,
    cluster_gpus,
    cpu_has_native_half,
    probe_gpu,
)
from airflow_provider_rayllm.job.engines.vllm.model_config import model_labels, model_max_len
from airflow_provider_rayllm.job.engines.vllm.outputs import VLLMShaper, logprob_records
from airflow_provider_rayllm.job.engines.vllm.processor import build, engine_actor_seconds, unpack_request
from airflow_provider_rayllm.job.engines.vllm.settings import (
    BIG_GPU_ENGINE_LIMITS,
    CPU_ENGINE_BUNDLE_CPUS,
    CPU_ENGINE_DEFAULTS,
    CPU_STAGE_NUM_CPUS,
    GPU_ENGINE_DEFAULTS,
    IN_FLIGHT_PER_SEQ,
    ONE_PROCESS_ENV,
    USAGE_STATS_OPT_OUT,
    Feed,
    engine_cpus,
    engine_kwargs_for,
    engine_runtime_env,
    executor_backend,
    feed_for,
    fit_to_model,
    gpu_engine_defaults,
    one_process_engine,
    placement_for,
    resolve_profile,
    with_secrets,
    world_size,
)

__all__ = [
    "BIG_GPU_ENGINE_LIMITS",
    "BIG_GPU_GIB",
    "CPU_ENGINE_BUNDLE_CPUS",
    "CPU_ENGINE_DEFAULTS",
    "CPU_STAGE_NUM_CPUS",
    "GPU_ENGINE_DEFAULTS",
    "IN_FLIGHT_PER_SEQ",
    "ONE_PROCESS_ENV",
    "USAGE_STATS_OPT_OUT",
    "Feed",
    "GpuCard",
    "VLLMEngine",
    "VLLMShaper",
    "build",
    "check_engine_kwargs",
    "check_lora_adapters",
    "check_model_source",
    "check_parallel",
    "check_resources",
    "check_sampling_params",
    "check_task_type",
    "cluster_gpus",
    "cpu_has_native_half",
    "engine_actor_seconds",
    "engine_cpus",
    "engine_kwargs_for",
    "engine_runtime_env",
    "executor_backend",
    "feed_for",
    "fit_to_model",
    "gpu_engine_defaults",
    "logprob_records",
    "model_labels",
    "model_max_len",
    "one_process_engine",
    "placement_for",
    "probe_gpu",
    "resolve_profile",
    "unpack_request",
    "with_secrets",
    "world_size",
]
