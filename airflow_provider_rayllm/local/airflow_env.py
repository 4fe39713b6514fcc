"""An Airflow environment for the embedded stack: its own AIRFLOW_HOME, SQLite, our example DAGs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from airflow_provider_rayllm.local.cluster import ClusterInfo, LocalRayCluster

REPO_DAGS = Path(__file__).resolve().parents[2] / "dags_examples"


def home_env(home: Path) -> dict[str, str]:
    """Airflow's settings for the embedded stack's home: its SQLite database and our example DAGs."""
    home.mkdir(parents=True, exist_ok=True)
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO_DAGS),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
    }


def airflow_env(home: Path, cluster: LocalRayCluster, info: ClusterInfo, output_base: Path) -> dict[str, str]:
    env = cluster.env()
    env.update(home_env(home))
    env["AIRFLOW_CONN_RAY_DEFAULT"] = info.airflow_conn_uri(output_base=str(output_base))
    return env


def airflow_bin() -> str:
    candidate = Path(sys.executable).with_name("airflow")
    return str(candidate) if candidate.exists() else "airflow"


def migrate(env: dict[str, str]) -> None:
    db = Path(env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].removeprefix("sqlite:///"))
    stamp = db.with_suffix(".migrated")
    if stamp.exists() and db.exists():
        return
    subprocess.run([airflow_bin(), "db", "migrate"], env=env, check=True, capture_output=True)
    stamp.touch()
