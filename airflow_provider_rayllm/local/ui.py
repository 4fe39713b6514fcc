"""`make ui`: Airflow's UI (its API server) on loopback over the demo's database, with the demo's DAG run in it.

The demo ran `airflow dags test` against a SQLite database in its own Airflow home; this serves that database.
The process becomes the API server (it stops on Ctrl-C or SIGTERM like one). The Ray head the demo started
is gone by then, so the "Ray job" link leads nowhere; the run's page, its logs, XCom and the "Report" link
(a ``file://`` URL: open it in a browser on this machine) are all there.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from airflow_provider_rayllm.contract.names import MANIFEST_NAME
from airflow_provider_rayllm.local.airflow_env import airflow_bin, home_env, migrate
from airflow_provider_rayllm.local.cluster import free_port

WORK = Path.home() / ".cache" / "airflow_provider_rayllm" / "demo"
DEMO_DAG, DEMO_TASK = "example_vllm_batch", "answer"
DEFAULT_PORT = 8080


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def latest_demo_manifest(work: Path = WORK) -> dict[str, Any] | None:
    """The manifest of the demo's newest run (its run id, its report), or None before the first demo."""
    found = sorted((work / "output").glob(f"{DEMO_DAG}/*/{DEMO_TASK}/{MANIFEST_NAME}"), key=lambda p: p.stat().st_mtime)
    return json.loads(found[-1].read_text()) if found else None


def port_or_free(port: int) -> int:
    """``port`` when nothing listens on it on loopback, else a free one."""
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) != 0:
            return port
    return free_port()


def ui_env(home: Path | None) -> dict[str, str]:
    """The environment the API server runs in: the demo's Airflow home, or (``home`` None) the Airflow this
    environment already configures."""
    env = dict(os.environ)
    if home is not None:
        env.update(home_env(home))
    # One person on loopback: every request is an admin's, with no login page.
    env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS"] = "True"
    return env


def serve(port: int = DEFAULT_PORT, home: Path | None = WORK / "airflow", work: Path = WORK) -> int:
    """Put the DAGs in the database, say where to look, and become the API server."""
    if home is not None and not (home / "airflow.db").exists():
        _say(f"no demo run yet (no database in {home}): run `make demo` first")
        return 1
    env = ui_env(home)
    if home is not None:
        migrate(env)
    airflow = airflow_bin()
    # The UI lists DAGs from the database: the demo's `dags test` stored only the one it ran.
    done = subprocess.run([airflow, "dags", "reserialize"], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        _say(done.stderr[-3000:])
        return done.returncode
    port = port_or_free(port)
    url = f"http://127.0.0.1:{port}"
    _say(f"Airflow UI at {url} (Ctrl-C stops it)")
    manifest = latest_demo_manifest(work) if home is not None else None
    if manifest:
        run_id = manifest["run"]["run_id"]
        _say(f"the demo's run: {url}/dags/{DEMO_DAG}/runs/{run_id}/tasks/{DEMO_TASK} (Details tab: Report)")
        if manifest.get("report_uri"):
            _say(f"its report: {manifest['report_uri']}")
    os.execvpe(airflow, [airflow, "api-server", "-H", "127.0.0.1", "-p", str(port), "-w", "1"], env)
    return 0  # not reached: the process is the API server now
