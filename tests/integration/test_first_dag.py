"""README's "Your first DAG", followed literally: its shell blocks, as they are, in a fresh home (a new user's
machine), from the repository. The run must succeed, write its rows to the local S3 endpoint, and its log must
say nothing a user would have to act on."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
# What a successful run's log must not hold (a user would think something went wrong).
ALARMS = ("Traceback", "[error]", "EngineDeadError", "0/0 rows", " 0.0 tokens/s", "ERROR")


def readme_blocks() -> str:
    """The shell blocks between README's first-dag markers, joined in their order."""
    text = (REPO / "README.md").read_text()
    section = text.split("<!-- first-dag:start", 1)[1].split("<!-- first-dag:end -->", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 3, "the section's three shell blocks"
    return "\n".join(blocks)


def test_the_readmes_first_dag_runs_as_written(tmp_path, smollm2):
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW_", "RAYLLM_"))}
    # A fresh home; the models the set-up prepared stay where it put them (their folder, not a copy).
    env.update(HOME=str(home), RAYLLM_MODELS_DIR=str(Path(smollm2).parent))
    env.pop("VIRTUAL_ENV", None)
    script = "set -eo pipefail\n" + readme_blocks()
    proc = subprocess.Popen(
        ["bash", "-c", script],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        # The services the section started and stopped: nothing of them may be left running.
        subprocess.run(["pkill", "-f", f"{home}/.cache/airflow_provider_rayllm"], check=False)
    log = Path("/tmp/first-dag.log").read_text()
    assert proc.returncode == 0, out[-3000:] + "\n--- dags test log ---\n" + log[-6000:]
    finished = [line for line in out.splitlines() if "] Finished: " in line]
    assert finished and "3 rows in, 3 out" in finished[-1], out[-3000:]
    assert "s3://rayllm-demo/first-dag/2026-12-01" in finished[-1]
    assert [line for line in out.splitlines() if "Progress:" in line], "progress lines while it ran"
    alarming = [line for line in log.splitlines() if any(alarm in line for alarm in ALARMS)]
    assert alarming == [], "a successful run's log says something alarming:\n" + "\n".join(alarming[:20])
    services = (home / ".cache" / "airflow_provider_rayllm" / "services.log").read_text()
    assert "services stopped" in services, services[-2000:]
    assert not (home / ".cache" / "airflow_provider_rayllm" / "services.env").exists(), "removed when they stop"
