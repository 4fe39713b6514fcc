"""Ray's ``worker_process_setup_hook`` for our jobs: every worker process of the job runs it first."""

from __future__ import annotations

import os

from airflow_provider_rayllm.contract.names import COMPILE_CACHE_ENV
from airflow_provider_rayllm.job import compat, secrets


def setup() -> None:
    compat.install()
    secrets.load_into_env()
    if os.environ.get(COMPILE_CACHE_ENV):  # an engine actor whose vLLM cache lives in a bucket
        from airflow_provider_rayllm.job.engines.vllm import compile_cache

        compile_cache.start_if_asked()
