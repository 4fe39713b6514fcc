"""The engines behind one small interface (``base.Engine``): vLLM, an HTTP endpoint, a Serve deployment.

``ENGINES`` picks the engine by the spec's kind. Each engine's module is imported only when a job of its
kind opens it: an HTTP job never imports the vLLM engine.
"""

from __future__ import annotations

from typing import Callable

from airflow_provider_rayllm.contract.spec import JobSpec
from airflow_provider_rayllm.job.engines.base import Engine
from airflow_provider_rayllm.job.errors import JobError


def _vllm() -> type[Engine]:
    from airflow_provider_rayllm.job.engines.vllm.engine import VLLMEngine

    return VLLMEngine


def _http() -> type[Engine]:
    from airflow_provider_rayllm.job.engines.http import HttpEngine

    return HttpEngine


def _serve() -> type[Engine]:
    from airflow_provider_rayllm.job.engines.serve import ServeEngine

    return ServeEngine


# The spec's kind (``JobSpec.kind``) -> the engine's class, imported when asked for.
ENGINES: dict[str, Callable[[], type[Engine]]] = {"vllm": _vllm, "http": _http, "serve": _serve}


def engine_class(kind: str) -> type[Engine]:
    if kind not in ENGINES:
        raise JobError(f"no engine for kind {kind!r}; engines: {sorted(ENGINES)}")
    return ENGINES[kind]()


def open_engine(spec: JobSpec, package_dir: str) -> Engine:
    return engine_class(spec.kind)(spec, package_dir)
