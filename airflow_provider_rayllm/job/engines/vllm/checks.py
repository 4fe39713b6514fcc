"""The checks the driver runs before any engine starts: the model's source, the task type, the cluster's
resources, LoRA adapters, model-parallel settings, engine_kwargs and sampling params as vLLM judges them."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from airflow_provider_rayllm.contract.secrets import redact
from airflow_provider_rayllm.contract.spec import VLLMProcessorSpec, is_local_path, uri_scheme
from airflow_provider_rayllm.job.engines.vllm.declared import engine_arg_names, sampling_param_names
from airflow_provider_rayllm.job.engines.vllm.settings import executor_backend, world_size
from airflow_provider_rayllm.job.errors import JobError


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


def check_engine_kwargs(model_source: str, engine_kwargs: dict[str, Any]) -> None:
    """Unknown names and values vLLM's own argument class refuses fail here, before any engine starts.

    The names come from vLLM's source (``declared``), so the default path imports no vLLM. Its argument
    class checks no plain value (it is a dataclass); it builds the nested configs given as dicts
    (``compilation_config``, ``attention_config``, ...), so only those settings bring vLLM in to judge them.
    """
    known = engine_arg_names()
    nested = any(isinstance(v, dict) for k, v in engine_kwargs.items() if k != "hf_overrides")
    if known is None or nested:
        _vllm_judges_engine_kwargs(model_source, engine_kwargs)
        return
    _refuse_unknown(sorted(k for k in engine_kwargs if k not in known and k != "task_type"))
    _check_load_format(engine_kwargs.get("load_format"))


def _refuse_unknown(unknown: list[str]) -> None:
    if unknown:
        raise JobError(
            f"engine_kwargs: unknown vLLM engine argument(s) {unknown!r} (vLLM's EngineArgs has no such field)"
        )


def _check_load_format(load_format: Any) -> None:
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


def _vllm_judges_engine_kwargs(model_source: str, engine_kwargs: dict[str, Any]) -> None:
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    _refuse_unknown(sorted(k for k in engine_kwargs if k not in known and k != "task_type"))
    _check_load_format(engine_kwargs.get("load_format"))
    try:
        EngineArgs(model=model_source, **{k: v for k, v in engine_kwargs.items() if k != "task_type"})
    except (TypeError, ValueError) as exc:
        raise JobError(f"engine_kwargs: vLLM refuses {redact(engine_kwargs)!r}: {exc}") from exc


# Settings vLLM's SamplingParams checks beyond the plain numbers below (objects it builds, schemas it
# compiles, token lists checked against a tokenizer): given, they bring vLLM in to judge the whole.
_VLLM_JUDGES = ("structured_outputs", "logits_processors", "extra_args", "allowed_token_ids", "logit_bias")


def check_sampling_params(sampling_params: dict[str, Any]) -> None:
    """vLLM's SamplingParams judges the settings once, instead of failing every row in the engine.

    Its names come from vLLM's source and its range checks (``SamplingParams._verify_args``, vLLM 0.32)
    are repeated here, so the usual settings import no vLLM; the rarer ones in ``_VLLM_JUDGES`` do."""
    from airflow_provider_rayllm.job.requests.sampling import normalize_sampling_params

    params = normalize_sampling_params(sampling_params)
    n = params.get("n", 1)
    if isinstance(n, int) and n > 1:
        raise JobError(
            f"sampling_params.n={n}: Ray Data's vLLM stage keeps only the first sample of a request, so the "
            "others would be lost; ask for one sample per row (give rows a different seed for variety), or call a "
            "vLLM server with HttpLLMBatchOperator, which keeps every sample"
        )
    known = sampling_param_names()
    if known is None or any(params.get(k) for k in _VLLM_JUDGES):
        _vllm_judges_sampling_params(sampling_params, params)
        return
    unknown = sorted(k for k in params if k not in known)
    if unknown:
        raise JobError(
            f"sampling_params {sampling_params!r}: unknown vLLM sampling parameter(s) {unknown!r} "
            "(vLLM's SamplingParams has no such field)"
        )
    problem = sampling_problem(params)
    if problem:
        raise JobError(f"sampling_params {sampling_params!r}: {problem}")


def sampling_problem(p: dict[str, Any]) -> str | None:
    """What vLLM's ``SamplingParams._verify_args`` would say of these values, in its words; None if nothing."""
    num = (int, float)

    def bad(name: str, ok: Any) -> bool:
        value = p.get(name)
        return value is not None and (not isinstance(value, num) or isinstance(value, bool) or not ok(value))

    rules: list[tuple[str, Any, str]] = [
        ("n", lambda v: isinstance(v, int) and v >= 1, "must be at least 1"),
        ("presence_penalty", lambda v: -2.0 <= v <= 2.0, "must be in [-2, 2]"),
        ("frequency_penalty", lambda v: -2.0 <= v <= 2.0, "must be in [-2, 2]"),
        ("repetition_penalty", lambda v: math.isfinite(v) and v > 0.0, "must be a finite number greater than zero"),
        ("temperature", lambda v: math.isfinite(v) and v >= 0.0, "must be non-negative"),
        ("temperature", lambda v: v <= 2.0, "must be in [0, 2]"),
        ("top_p", lambda v: 0.0 < v <= 1.0, "must be in (0, 1]"),
        ("top_k", lambda v: isinstance(v, int) and v >= -1, "must be 0 (disable), or at least 1"),
        ("min_p", lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]"),
        ("max_tokens", lambda v: isinstance(v, int) and v >= 1, "must be at least 1"),
        ("min_tokens", lambda v: isinstance(v, int) and v >= 0, "must be greater than or equal to 0"),
        ("logprobs", lambda v: isinstance(v, int) and (v == -1 or v >= 0), "must be non-negative or -1"),
        ("prompt_logprobs", lambda v: isinstance(v, int) and (v == -1 or v >= 0), "must be non-negative or -1"),
    ]
    for name, ok, words in rules:
        if bad(name, ok):
            return f"{name} {words}, got {p[name]!r}."
    if p.get("max_tokens") is not None and (p.get("min_tokens") or 0) > p["max_tokens"]:
        return f"min_tokens must be less than or equal to max_tokens={p['max_tokens']}, got {p['min_tokens']}."
    stop = p.get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        return "stop cannot contain an empty string."
    if stops and p.get("detokenize") is False:
        return "stop strings are only supported when detokenize is True. Set detokenize=True to use stop."
    if any(not isinstance(t, int) for t in p.get("stop_token_ids") or []):
        return f"stop_token_ids must contain only integers, got {p['stop_token_ids']!r}."
    return None


def _vllm_judges_sampling_params(sampling_params: dict[str, Any], params: dict[str, Any]) -> None:
    import vllm.exceptions
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    params = dict(params)
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
