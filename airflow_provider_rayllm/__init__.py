"""Airflow provider: LLM batch inference with Ray Data on a Ray cluster.

Importing this package imports neither Airflow nor Ray: the Ray job and the scheduler both load it.
"""

from airflow_provider_rayllm.version import __version__

__all__ = ["__version__", "get_provider_info"]


def get_provider_info() -> dict:
    from airflow_provider_rayllm.get_provider_info import get_provider_info as _info

    return _info()
