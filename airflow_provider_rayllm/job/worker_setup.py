"""Ray's ``worker_process_setup_hook`` for our jobs: every worker process of the job runs it first."""

from __future__ import annotations

from airflow_provider_rayllm.job import compat, secrets


def setup() -> None:
    compat.install()
    secrets.load_into_env()
