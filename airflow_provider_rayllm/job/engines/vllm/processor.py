"""Ray Data's vLLM processor for the stream: its config, our requests unpacked for it, and how long its engine
actors held their resources."""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

from airflow_provider_rayllm.contract.spec import VLLMProcessorSpec
from airflow_provider_rayllm.job import actor_table
from airflow_provider_rayllm.job.compat import config_only_transformers
from airflow_provider_rayllm.job.engines.vllm.chat_template import ChatTemplate
from airflow_provider_rayllm.job.engines.vllm.settings import CPU_STAGE_NUM_CPUS, Feed, engine_runtime_env
from airflow_provider_rayllm.job.stream import ACTOR_RETRIES, ERROR, PRE_ERROR, REQUEST, light_tasks

log = logging.getLogger("airflow_provider_rayllm.job")


def _stage(value: bool | dict[str, Any], profile: str) -> bool | dict[str, Any]:
    if profile != "cpu" or value is False:
        return value
    stage = dict(value) if isinstance(value, dict) else {}
    stage.setdefault("num_cpus", CPU_STAGE_NUM_CPUS)
    return stage


def unpack_request(
    row: dict[str, Any], engine_detokenizes: bool = True, template: ChatTemplate | None = None
) -> dict[str, Any]:
    """Ray's preprocess: our request, unpacked; a row that could not be prompted carries its reason in
    Ray's error column, so every stage of the processor passes it through untouched.

    When the engine makes the text (no detokenize stage), a request's ``detokenize: False`` (the guide's
    VLM preprocess sets it, leaving the text to Ray's detokenize stage) is dropped: kept, it would leave
    every answer empty. With ``template`` (``chat_template.find``), a request's messages become its prompt
    here, in place of Ray's chat-template stage; a conversation the template refuses is that row's error."""
    error = row.pop(PRE_ERROR, "")
    body = row.pop(REQUEST, "{}")
    if error:
        return {ERROR: error}
    request = json.loads(body)
    if template is not None and "messages" in request:
        try:
            request["prompt"] = template.render(request.pop("messages"))
        except Exception as exc:  # the template's own raise_exception, or a conversation it cannot render
            return {ERROR: f"chat template: {type(exc).__name__}: {exc}"}
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
    replicas: int,
    template: ChatTemplate | None = None,
) -> Any:
    """Ray's vLLM processor; with ``template`` the chat template is applied in its preprocess, and Ray's
    chat-template stage (an actor that imports transformers) is left out. Its pre- and postprocess steps run at
    most ``replicas`` (the engine's) tasks at once, as the job's progress tap does, so the postprocess fuses
    with it."""
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
        chat_template_stage=_stage(
            spec.chat_template_stage if spec.task_type == "generate" and template is None else False, profile
        ),
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
    light = light_tasks(replicas)
    with config_only_transformers():  # Ray reads the model's architecture for its telemetry only
        processor = build_processor(
            config,
            preprocess=functools.partial(unpack_request, engine_detokenizes=not detokenize_on, template=template),
            preprocess_map_kwargs=light,
            postprocess_map_kwargs=light,
            builder_kwargs=builder_kwargs,
        )
    for stage in processor.stages.values():  # every stage is a pool of actors
        for name, value in ACTOR_RETRIES.items():
            stage.map_batches_kwargs.setdefault(name, value)
    return processor


def engine_actor_seconds(class_marker: str, requested_at: float) -> float | None:
    """Seconds the job's engine actors held their resources (the sum over replicas), each from ``requested_at``
    (epoch seconds: when the plan asked for it), from the GCS actor table; None if unknown."""
    try:
        actors = actor_table.job_actors(class_marker)
    except Exception as exc:  # the lifetime only feeds the cost estimate, never the job's outcome
        log.warning("engine lifetime unknown (GCS actor table: %s)", exc)
        return None
    return actor_table.held_seconds(actors, requested_at)
