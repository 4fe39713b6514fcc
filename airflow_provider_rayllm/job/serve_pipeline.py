"""The Serve pipeline: rows -> requests to an LLM deployment already running on the cluster's Ray Serve.

Ray Data's ServeDeploymentProcessor holds a handle to the deployment; each row becomes one OpenAI-style
request (the same body the HTTP pipeline sends), answered by the deployment's engine. No engine starts in
the job, so consecutive tasks (the turns of a conversation, a chain of steps) share one engine.
"""

from __future__ import annotations

import json
from typing import Any

from airflow_provider_rayllm.job import progress
from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.job.http_pipeline import extract, openai_body
from airflow_provider_rayllm.job.prompts import REQUEST, STASH
from airflow_provider_rayllm.spec import OUTPUT_TOKENS_IN, OUTPUT_TOKENS_OUT, ServeProcessorSpec

SERVE_ERROR = "__inference_error__"
# Our endpoint names -> (the Serve LLM server's method, its request class, the HTTP pipeline's endpoint)
METHODS = {
    "chat": ("chat", "ChatCompletionRequest", "chat/completions"),
    "completions": ("completions", "CompletionRequest", "completions"),
    "embeddings": ("embeddings", "EmbeddingCompletionRequest", "embeddings"),
}


def check(serve: ServeProcessorSpec) -> None:
    """The application and deployment exist and are running, before any row is sent."""
    from ray import serve as ray_serve

    try:
        status = ray_serve.status()
    except Exception as exc:  # no Serve instance on the cluster
        raise JobError(f"serve_app {serve.app_name!r}: Ray Serve is not running on the cluster ({type(exc).__name__}: {exc})") from None
    apps = status.applications
    if serve.app_name not in apps:
        raise JobError(f"serve_app {serve.app_name!r}: no such Serve application on the cluster; running: {sorted(apps)}")
    app = apps[serve.app_name]
    if serve.deployment_name not in app.deployments:
        raise JobError(
            f"serve_deployment {serve.deployment_name!r}: application {serve.app_name!r} has no such deployment; "
            f"it has {sorted(app.deployments)}"
        )
    if str(getattr(app.status, "value", app.status)) != "RUNNING":
        raise JobError(f"serve_app {serve.app_name!r} is {app.status} ({app.message or 'no message'}), not RUNNING")


def request_class(dtype: str) -> Any:
    """Ray Serve LLM's request model of that name (the public EmbeddingRequest is a Union of two)."""
    import typing

    from ray.serve.llm import openai_api_models as models

    for value in vars(models).values():
        for candidate in typing.get_args(value) or (value,):
            if getattr(candidate, "__name__", None) == dtype:
                return candidate
    raise JobError(f"Ray Serve LLM has no request model {dtype!r}")


def infer(
    good: Any,
    rows: int,
    serve: ServeProcessorSpec,
    output_column: str,
    light: dict[str, Any],
    watch: progress.ProgressLog,
    checkpoint_uri: str | None = None,
) -> tuple[Any, Any]:
    """(output rows, error rows), as the other pipelines give them."""
    from ray.data.llm import ServeDeploymentProcessorConfig, build_processor

    method, dtype, endpoint = METHODS[serve.endpoint]

    def request(row: dict[str, Any]) -> dict[str, Any]:
        body = openai_body(json.loads(row[REQUEST]), endpoint, serve.model)
        return {"method": method, "dtype": dtype, "request_kwargs": {**body, "stream": False} if method != "embeddings" else body}

    def output(row: dict[str, Any]) -> dict[str, Any]:
        value = extract(row, endpoint)
        usage = row.get("usage") or {}
        return {
            **dict(row[STASH] or {}),
            output_column: value.tolist() if hasattr(value, "tolist") else value,
            OUTPUT_TOKENS_IN: int(usage.get("prompt_tokens") or 0),
            OUTPUT_TOKENS_OUT: int(usage.get("completion_tokens") or 0),
        }

    def tokens(row: dict[str, Any]) -> dict[str, Any]:
        """The usage the deployment reported, as the column the progress stage counts."""
        usage = row.get("usage") or {}
        return {**row, OUTPUT_TOKENS_OUT: int(usage.get("completion_tokens") or 0) if not row.get(SERVE_ERROR) else 0}

    config = ServeDeploymentProcessorConfig(
        deployment_name=serve.deployment_name,
        app_name=serve.app_name,
        dtype_mapping={dtype: request_class(dtype)},
        concurrency=serve.concurrency,
        batch_size=serve.batch_size,
        should_continue_on_error=True,
        request_timeout_s=serve.request_timeout_s,
    )
    processor = build_processor(config, preprocess=request, postprocess=tokens, preprocess_map_kwargs=light, postprocess_map_kwargs=light)
    # The stage's actors only wait on the deployment's answers: a whole CPU each would starve a small
    # cluster whose CPUs the deployment's replicas already hold.
    for stage in processor.stages.values():
        stage.map_batches_kwargs.setdefault("num_cpus", light["num_cpus"])

    return progress.infer_rows(
        good, rows, serve.batch_size, processor, watch, SERVE_ERROR, OUTPUT_TOKENS_OUT, output, light, checkpoint_uri
    )
