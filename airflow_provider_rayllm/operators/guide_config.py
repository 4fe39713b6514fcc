"""The guide's own processor config, accepted as it is: a user who already has a
``vLLMEngineProcessorConfig`` (or an ``HttpRequestProcessorConfig``), or a dict of its fields, passes it as
``processor_config``; each field it sets fills the operator argument of the same name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# vLLMEngineProcessorConfig's fields that are VLLMBatchOperator arguments under the same name.
VLLM_FIELDS = {
    name: name
    for name in (
        "model_source",
        "task_type",
        "engine_kwargs",
        "concurrency",
        "batch_size",
        "accelerator_type",
        "runtime_env",
        "max_concurrent_batches",
        "max_tasks_in_flight_per_actor",
        "max_pending_requests",
        "placement_group_config",
        "chat_template_stage",
        "tokenize_stage",
        "detokenize_stage",
        "prepare_multimodal_stage",
        "dynamic_lora_loading_path",
        "log_engine_metrics",
        "apply_chat_template",
        "tokenize",
        "detokenize",
        "has_image",
        "chat_template",
    )
}
# HttpRequestProcessorConfig's fields and the HttpLLMBatchOperator arguments they fill.
HTTP_FIELDS = {
    "qps": "qps",
    "concurrency": "concurrency",
    "batch_size": "batch_size",
    "max_retries": "max_retries",
    "base_retry_wait_time_in_s": "backoff_base_s",
}
# Fields this provider takes elsewhere, and where.
REFUSED = {
    "url": "the endpoint's base URL is the host of http_conn_id (the requests and the key go to that host only)",
    "headers": "the API key is the password of http_conn_id (a job secret, never in the spec)",
    "session_factory": "the job keeps one HTTP session per caller actor",
    "http_request_stage": "the job's callers are configured by max_in_flight, timeout_s and the retry settings",
}


def config_fields(config: Any) -> dict[str, Any]:
    """The fields a guide config sets: Ray's pydantic object (the fields given, not its defaults) or a dict."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    dump = getattr(config, "model_dump", None)
    if dump is None:
        raise TypeError(
            f"processor_config must be the guide's processor config object or a dict of its fields, got "
            f"{type(config).__name__}"
        )
    return dump(exclude_unset=True)


def mapped_arguments(
    operator: str, config: Any, fields: Mapping[str, str], given: Mapping[str, Any], defaults: Mapping[str, Any]
) -> dict[str, Any]:
    """{argument: value} for each field ``config`` sets. A field this provider takes elsewhere, one it does not
    know, or one also given as a keyword with another value is a TypeError naming it."""
    out: dict[str, Any] = {}
    for field, value in config_fields(config).items():
        if field in REFUSED:
            raise TypeError(f"{operator}: processor_config.{field} is not taken here: {REFUSED[field]}")
        if field == "should_continue_on_error":
            # The job always goes on past a bad row (an error row with its reason); max_error_fraction decides.
            if value is False:
                out["max_error_fraction"] = 0.0
            continue
        if field not in fields:
            raise TypeError(f"{operator}: processor_config.{field} is not a setting this operator takes")
        name = fields[field]
        if field == "engine_kwargs" and isinstance(value, dict):
            # Ray's config copies its task_type into engine_kwargs; the operator passes task_type itself.
            value = {k: v for k, v in value.items() if k != "task_type"}
        mine = given.get(name)
        if mine is not None and mine != defaults.get(name) and mine != value:
            raise TypeError(
                f"{operator}: {name} is given both as an argument ({mine!r}) and in processor_config "
                f"({value!r}); give it once"
            )
        out[name] = value
    return out
