"""Embeddings straight from vLLM's offline engine: whole batches of the stream to ``LLM.embed``, the vectors
back as one fixed-size list column.

Ray's vLLM stage drives vLLM's async engine one row at a time (a request object, a task and an output
object per row, then a row dict): on the H100 it answered MiniLM's 8,192 rows at about 800 rows/s, where
vLLM's own ``LLM.embed`` over the same prompts does about 2,300 (benchmarks/results/2026-12-06-gpu-rounds).
An embedding has no tokens to stream, so nothing is gained by answering it alone: this stage hands every
batch to ``LLM.embed`` at once, as the offline script does, and builds the answered block column by column.

It serves the jobs it can serve exactly as Ray's stage would (``direct_embed`` says which): an embed task on
one worker per replica (no tensor or pipeline parallelism, no placement group of the user's), no LoRA, no
images and none of Ray's CPU stages. A row vLLM refuses (a prompt longer than the model takes) fails alone: a
batch that raises is split in halves until the refused rows stand alone, and each carries vLLM's message in
the error column, as Ray's stage does with ``should_continue_on_error``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from airflow_provider_rayllm.contract.spec import VLLMProcessorSpec
from airflow_provider_rayllm.job.engines.vllm.processor import unpack_request
from airflow_provider_rayllm.job.engines.vllm.settings import Feed, engine_cpus, engine_runtime_env, world_size
from airflow_provider_rayllm.job.stream import ACTOR_RETRIES, ERROR, PRE_ERROR, REQUEST

log = logging.getLogger("airflow_provider_rayllm.job")

# vLLM's errors after which its engine is gone: the actor exits, and Ray starts a fresh one and retries
# the batch there (a call on the same actor would fail again).
FATAL_ERRORS = ("EngineDeadError", "EngineGenerateError")
# A request's own fields this stage reads; any other field of the request stays on the row for postprocess.
PROMPT_FIELDS = ("prompt", "prompt_token_ids", "tokenized_prompt", "pooling_params")


def direct_embed(spec: VLLMProcessorSpec, engine_kwargs: dict[str, Any]) -> str | None:
    """Why this job's embeddings go through Ray's vLLM stage instead of this one; None when they need not."""
    if spec.task_type != "embed":
        return f"task_type {spec.task_type!r}"
    if world_size(engine_kwargs) != 1:
        return "tensor or pipeline parallel engine"
    if spec.placement_group_config is not None:
        return "placement_group_config given"
    if spec.dynamic_lora_loading_path:
        return "LoRA adapters"
    if spec.tokenize_stage is not False or spec.prepare_multimodal_stage is not False:
        return "Ray's tokenize or multimodal stage asked for"
    if engine_kwargs.get("distributed_executor_backend"):
        return "distributed_executor_backend given"
    return None


def apply(
    ds: Any,
    spec: VLLMProcessorSpec,
    profile: str,
    engine_kwargs: dict[str, Any],
    placement: dict[str, Any] | None,
    feed: Feed,
) -> Any:
    """The stage on the stream: ``spec.concurrency`` actors, each holding one engine with the resources Ray's
    stage would give it, fed batches of ``feed.rows_in_flight`` rows (the rows Ray's stage keeps in flight to
    an engine)."""
    import ray.data

    size = spec.concurrency
    pool = {"size": size} if isinstance(size, int) else {"min_size": size[0], "max_size": size[1]}
    if spec.max_tasks_in_flight_per_actor is not None:
        pool["max_tasks_in_flight_per_actor"] = spec.max_tasks_in_flight_per_actor
    remote: dict[str, Any] = {"num_cpus": engine_cpus(spec, placement, engine_kwargs)}
    if profile == "gpu":
        remote["num_gpus"] = 1
    if spec.accelerator_type:
        remote["accelerator_type"] = spec.accelerator_type
    runtime_env = engine_runtime_env(spec, profile, engine_kwargs)
    if runtime_env:
        remote["runtime_env"] = runtime_env
    return ds.map_batches(
        VLLMEmbedStage,
        fn_constructor_kwargs={"model_source": spec.model_source, "engine_kwargs": engine_kwargs},
        batch_size=feed.rows_in_flight,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(**pool),
        **ACTOR_RETRIES,
        **remote,
    )


class VLLMEmbedStage:
    """One engine replica: vLLM's ``LLM`` for embeddings, called once per batch of the stream."""

    def __init__(self, model_source: str, engine_kwargs: dict[str, Any]):
        from vllm import LLM

        kwargs = {"runner": "pooling", "convert": "embed", **engine_kwargs}
        kwargs.pop("model", None)
        self.llm = LLM(model=_local_model(model_source), **kwargs)

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa
        from vllm import PoolingParams

        n = batch.num_rows
        errors: list[str] = [""] * n
        requests: list[dict[str, Any]] = [{} for _ in range(n)]
        prompts: list[Any] = [None] * n
        params: list[Any] = [None] * n
        rows = zip(batch.column(PRE_ERROR).to_pylist(), batch.column(REQUEST).to_pylist())
        for i, (pre_error, body) in enumerate(rows):
            request = unpack_request({PRE_ERROR: pre_error, REQUEST: body or "{}"})
            errors[i] = str(request.pop(ERROR) or "")
            if errors[i]:
                continue
            requests[i] = request
            try:
                prompts[i], given = _prompt(request)
                if given is not None:
                    params[i] = PoolingParams(**given)
            except (ValueError, TypeError) as exc:  # vLLM refuses unknown pooling_params with a TypeError
                errors[i] = f"request: {type(exc).__name__}: {exc}"
        todo = [i for i in range(n) if not errors[i]]
        if any(params[i] is not None for i in todo):  # one call takes parameters for every prompt or for none
            params = [p if p is not None else PoolingParams() for p in params]
        answers: dict[int, Any] = {}
        embedded = self._embed([prompts[i] for i in todo], [params[i] for i in todo])
        if len(embedded) != len(todo):  # never leave a row without its answer or its error
            raise RuntimeError(f"vLLM answered {len(embedded)} of {len(todo)} prompts")
        for i, answer in zip(todo, embedded):
            if isinstance(answer, str):
                errors[i] = answer
            else:
                answers[i] = answer

        columns = {name: batch.column(name) for name in batch.column_names if name not in (REQUEST, PRE_ERROR)}
        columns[ERROR] = pa.array(errors, pa.string())
        columns["prompt"] = pa.array([_prompt_text(requests[i]) for i in range(n)], pa.string())
        columns["embeddings"] = _vectors([answers[i].outputs.embedding if i in answers else None for i in range(n)])
        columns["num_input_tokens"] = pa.array(
            [len(answers[i].prompt_token_ids or []) if i in answers else 0 for i in range(n)], pa.int64()
        )
        extra = sorted({k for r in requests for k in r if k not in PROMPT_FIELDS and k not in columns})
        for name in extra:  # the request's other fields, for the user's postprocess (as Ray's stage keeps them)
            columns[name] = pa.array([requests[i].get(name) for i in range(n)])
        return pa.table(columns)

    def _embed(self, prompts: list[Any], params: list[Any]) -> list[Any]:
        """vLLM's answer for each prompt, or the error text of each prompt vLLM refused."""
        if not prompts:
            return []
        try:
            given = params if params[0] is not None else None
            return list(self.llm.embed(prompts, pooling_params=given, use_tqdm=False))
        except Exception as exc:
            if type(exc).__name__ in FATAL_ERRORS:
                log.error(
                    "vLLM engine died (%s: %s); the actor exits so that Ray starts a fresh one", type(exc).__name__, exc
                )
                os._exit(1)
            if len(prompts) == 1:
                return [f"{type(exc).__name__}: {exc}"]
        half = len(prompts) // 2
        return self._embed(prompts[:half], params[:half]) + self._embed(prompts[half:], params[half:])


def _local_model(model_source: str) -> str:
    """The model's folder on this node: a bucket's model is downloaded first, as Ray's stage does."""
    if "://" not in model_source:
        return model_source
    from ray.llm._internal.common.utils.download_utils import NodeModelDownloadable, download_model_files

    return (
        download_model_files(
            model_id=model_source,
            mirror_config=None,
            download_model=NodeModelDownloadable.MODEL_AND_TOKENIZER,
            download_extra_files=False,
        )
        or model_source
    )


def _prompt(request: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    """A request's prompt as vLLM takes it (text, or token ids) and its pooling parameters."""
    tokens = request.get("prompt_token_ids", request.get("tokenized_prompt"))
    if tokens is not None:
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ValueError("prompt_token_ids must be a list of token ids")
        prompt: Any = {"prompt_token_ids": tokens}
    else:
        prompt = request.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError(f"the request has no prompt text (prompt={prompt!r})")
    params = request.get("pooling_params")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"pooling_params must be a dict, got {type(params).__name__}")
    return prompt, params


def _prompt_text(request: dict[str, Any]) -> str:
    prompt = request.get("prompt")
    return prompt if isinstance(prompt, str) else ""


def _vectors(vectors: list[Any]) -> Any:
    """The vectors as one fixed-size list column of float32 (null where a row has none); a list column where
    their lengths differ (rows asking for other ``dimensions``)."""
    import numpy as np
    import pyarrow as pa

    sizes = {len(v) for v in vectors if v is not None}
    if len(sizes) != 1:
        return pa.array(vectors, pa.list_(pa.float32()))
    (size,) = sizes
    values = np.zeros((len(vectors), size), dtype=np.float32)
    for i, v in enumerate(vectors):
        if v is not None:
            values[i] = v
    mask = pa.array([v is None for v in vectors])
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), size, mask=mask)
