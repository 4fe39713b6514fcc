"""Airflow provider: LLM batch inference with Ray Data on a Ray cluster.

Importing this package imports neither Airflow nor Ray: the Ray job and the scheduler both load it.
"""

__version__ = "0.1.0"


def get_provider_info() -> dict:
    from airflow_provider_rayllm.get_provider_info import get_provider_info as _info

    return _info()
