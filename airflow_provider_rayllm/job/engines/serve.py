"""The Serve engine: rows -> requests to an LLM deployment already running on the cluster's Ray Serve.

Ray Data's ServeDeploymentProcessor holds a handle to the deployment; each row becomes one OpenAI-style
request (the same body the HTTP pipeline sends), answered by the deployment's engine. No engine starts in
the job, so consecutive tasks (the turns of a conversation, a chain of steps) share one engine.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Callable, ClassVar

from airflow_provider_rayllm.contract.spec import JobSpec, ServeProcessorSpec
from airflow_provider_rayllm.job.engines.base import Engine
from airflow_provider_rayllm.job.engines.http import extract, openai_body
from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.job.shaping import Shaper
from airflow_provider_rayllm.job.stream import (
    ACTOR_RETRIES,
    ERROR,
    LIGHT,
    PRE_ERROR,
    REQUEST,
    count,
    light_tasks,
    to_python,
)

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
        raise JobError(
            f"serve_app {serve.app_name!r}: Ray Serve is not running on the cluster ({type(exc).__name__}: {exc})"
        ) from None
    apps = status.applications
    if serve.app_name not in apps:
        raise JobError(
            f"serve_app {serve.app_name!r}: no such Serve application on the cluster; running: {sorted(apps)}"
        )
    app = apps[serve.app_name]
    if serve.deployment_name not in app.deployments:
        raise JobError(
            f"serve_deployment {serve.deployment_name!r}: application {serve.app_name!r} has no such deployment; "
            f"it has {sorted(app.deployments)}"
        )
    if str(getattr(app.status, "value", app.status)) != "RUNNING":
        raise JobError(f"serve_app {serve.app_name!r} is {app.status} ({app.message or 'no message'}), not RUNNING")


@functools.cache
def request_class(dtype: str) -> Any:
    """Ray Serve LLM's request model of that name (the public EmbeddingRequest is a Union of two)."""
    import typing

    from ray.serve.llm import openai_api_models as models

    for value in vars(models).values():
        for candidate in typing.get_args(value) or (value,):
            if getattr(candidate, "__name__", None) == dtype:
                return candidate
    raise JobError(f"Ray Serve LLM has no request model {dtype!r}")


class LazyRequest:
    """Stands in for Ray Serve LLM's request model ``dtype`` in Ray's ``dtype_mapping``: Ray's stage builds each
    request by calling the class it was given, and this one returns an instance of the real model. Naming the
    real classes when the processor is built imported them, and vLLM with them, in the job's driver (7-9 s and
    as many CPU-seconds a job on 2 cores); the stage's actors import them at their first request, as before."""

    dtype: ClassVar[str] = ""

    def __new__(cls, **request_kwargs: Any) -> Any:
        return request_class(cls.dtype)(**request_kwargs)


def _stand_in(dtype: str) -> type[LazyRequest]:
    """A module-level subclass per request model (``Lazy<dtype>``): pickled by name into the stage's actors."""
    cls = type(f"Lazy{dtype}", (LazyRequest,), {"dtype": dtype, "__module__": __name__})
    globals()[cls.__name__] = cls
    return cls


# The request models by the names a preprocess gives as ``dtype``, one for each method in METHODS.
LAZY_REQUESTS: dict[str, type[LazyRequest]] = {dtype: _stand_in(dtype) for _, dtype, _ in METHODS.values()}


class ServeShaper(Shaper):
    """The deployment's answer, read like the HTTP endpoint's body; the guide's postprocess sees the
    response's own fields (``choices``, ``usage``, ``data``)."""

    def __init__(self, spec: JobSpec, package_dir: str):
        super().__init__(spec, package_dir)
        assert spec.serve is not None
        self.endpoint = METHODS[spec.serve.endpoint][2]

    def answer(self, row: dict[str, Any]) -> tuple[Any, int, int, dict[str, Any]]:
        endpoint = self.endpoint
        if row.get("object") == "text_completion" or (row.get("choices") and "text" in (row["choices"][0] or {})):
            endpoint = "completions"  # a preprocess may call another method than the task's own
        value = to_python(extract(row, endpoint))
        usage = row.get("usage") or {}
        return value, count(usage.get("prompt_tokens")), count(usage.get("completion_tokens")), {}

    def view(self, row: dict[str, Any], kept: dict[str, Any], value: Any) -> dict[str, Any]:
        view = {k: to_python(v) for k, v in row.items() if not k.startswith("__")}
        view.update(kept)
        return view


class UsageTokens:
    """Completion (or prompt) tokens of a batch of the deployment's answers (their ``usage`` field)."""

    def __init__(self, key: str = "completion_tokens"):
        self.key = key

    def __call__(self, batch: Any) -> int:
        if "usage" not in batch.column_names:
            return 0
        return sum(count((u or {}).get(self.key)) for u in batch.column("usage").to_pylist())


class ServeRequest:
    """Ray's preprocess: our request as the deployment method's keyword arguments."""

    def __init__(self, serve: ServeProcessorSpec):
        self.method, self.dtype, self.endpoint = METHODS[serve.endpoint]
        self.model = serve.model

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        error = row.pop(PRE_ERROR, "")
        body = row.pop(REQUEST, "{}")
        if error:
            return {ERROR: error}
        request = json.loads(body)
        if "method" in request and "request_kwargs" in request:  # the guide's preprocess names the call itself
            dtype = request.get("dtype") or next(d for m, d, _ in METHODS.values() if m == request["method"])
            return {"method": request["method"], "dtype": dtype, "request_kwargs": request["request_kwargs"], ERROR: ""}
        kwargs = openai_body(request, self.endpoint, self.model)
        if self.method != "embeddings":
            kwargs["stream"] = False
        return {"method": self.method, "dtype": self.dtype, "request_kwargs": kwargs, ERROR: ""}


class ServeEngine(Engine):
    """Requests to an LLM deployment already running on the cluster's Ray Serve."""

    def __init__(self, spec: JobSpec, package_dir: str):
        super().__init__(spec, package_dir)
        assert spec.serve is not None
        self.serve = spec.serve

    def check(self) -> None:
        check(self.serve)

    def describe(self) -> str:
        s = self.serve
        return (
            f"Serve deployment {s.deployment_name} of application {s.app_name} (model {s.model}); "
            f"{s.concurrency} actor(s), batches of {s.batch_size}"
        )

    def block_rows(self) -> int:
        return self.serve.batch_size

    def actor_name(self) -> str:
        return "ServeDeploymentStageUDF"

    def reserved_cpus(self) -> float:
        return self.serve.concurrency * LIGHT["num_cpus"]

    def replicas(self) -> int:
        return self.serve.concurrency

    def apply(self, ds: Any) -> Any:
        from ray.data.llm import ServeDeploymentProcessorConfig, build_processor

        config = ServeDeploymentProcessorConfig(
            deployment_name=self.serve.deployment_name,
            app_name=self.serve.app_name,
            # Every request model, so a preprocess may call any method of the deployment (the guide's chain
            # calls completions).
            dtype_mapping=dict(LAZY_REQUESTS),
            concurrency=self.serve.concurrency,
            batch_size=self.serve.batch_size,
            should_continue_on_error=True,
            request_timeout_s=self.serve.request_timeout_s,
        )
        light = light_tasks(self.replicas())
        processor = build_processor(
            config, preprocess=ServeRequest(self.serve), preprocess_map_kwargs=light, postprocess_map_kwargs=light
        )
        # The stage's actors only wait on the deployment's answers: a whole CPU each would starve a small
        # cluster whose CPUs the deployment's replicas already hold.
        for stage in processor.stages.values():
            stage.map_batches_kwargs.setdefault("num_cpus", LIGHT["num_cpus"])
            for name, value in ACTOR_RETRIES.items():
                stage.map_batches_kwargs.setdefault(name, value)
        return processor(ds)

    def shaper(self) -> Shaper:
        return ServeShaper(self.spec, self.package_dir)

    def tokens_out(self) -> Callable[[Any], int]:
        return UsageTokens()

    def tokens_in(self) -> Callable[[Any], int]:
        return UsageTokens("prompt_tokens")

    def details(self, totals: dict[str, Any]) -> dict[str, Any]:
        return {"serve_app": self.serve.app_name, "serve_deployment": self.serve.deployment_name}
