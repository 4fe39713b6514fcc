"""What every benchmark sets up: a scratch home with its own Airflow settings, and a log folder."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOG_DIR = REPO / "benchmarks" / "results" / "logs"


def bench_home(prefix: str) -> Path:
    """A fresh scratch folder; Airflow (imported after this) keeps its home and settings there."""
    home = Path(tempfile.mkdtemp(prefix=f"rayllm-{prefix}-"))
    os.environ.setdefault("AIRFLOW_HOME", str(home / "airflow"))
    os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    return home
