"""The engines behind one small interface (``base.Engine``): vLLM, an HTTP endpoint, a Serve deployment."""

from __future__ import annotations

from airflow_provider_rayllm.contract.spec import JobSpec
from airflow_provider_rayllm.job.engines.base import Engine


def open_engine(spec: JobSpec, package_dir: str) -> Engine:
    if spec.kind == "vllm":
        from airflow_provider_rayllm.job.engines.vllm import VLLMEngine

        return VLLMEngine(spec, package_dir)
    if spec.kind == "http":
        from airflow_provider_rayllm.job.engines.http import HttpEngine

        return HttpEngine(spec, package_dir)
    from airflow_provider_rayllm.job.engines.serve import ServeEngine

    return ServeEngine(spec, package_dir)
