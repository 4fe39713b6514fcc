"""What the gpu-marked job tests share: the device's settings, a submission the way the operator makes one,
GPU memory, and the answers file the guide sections' rows are kept in."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
JOB_DEADLINE_S = 420


def setting(name: str, what: str) -> str:
    """A device setting from the environment (go.sh's gputests phase sets them all), or a skip saying which."""
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no nvidia-smi: not a GPU machine")
    value = os.environ.get(name)
    if not value:
        pytest.skip(f"set {name} ({what})")
    return value


def dashboard() -> str:
    return setting("RAYLLM_GPU_DASHBOARD", "a Ray head's Jobs API address")


def gpu_used_mib() -> list[int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [int(x) for x in out.split()]


def _pickle(fn: Callable[..., Any]) -> bytes:
    """By value: a test module is not importable inside the job."""
    import cloudpickle

    module = sys.modules[fn.__module__]
    cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(fn)
    finally:
        cloudpickle.unregister_pickle_by_value(module)


def submit(
    address: str, body: dict[str, Any], package: Path, callables: dict[str, Callable[..., Any]] | None = None
) -> tuple[str, str]:
    """The job submitted as the operator submits it (entrypoint, working_dir package, py_modules, setup hook);
    ``callables`` (preprocess / postprocess) travel cloudpickled in the package. Returns (status, log)."""
    from ray.job_submission import JobSubmissionClient

    from airflow_provider_rayllm.contract.names import ENTRYPOINT, SETUP_HOOK, SPEC_FILE
    from airflow_provider_rayllm.contract.spec import JobSpec

    package.mkdir(parents=True)
    for name, fn in (callables or {}).items():
        (package / f"{name}.pkl").write_bytes(_pickle(fn))
        body["prompt"][name] = {"pickled": f"{name}.pkl"}
    spec = JobSpec.model_validate(body)
    (package / SPEC_FILE).write_text(spec.to_json())
    client = JobSubmissionClient(address)
    sid = f"gpu-test-{uuid.uuid4().hex[:8]}"
    client.submit_job(
        entrypoint=ENTRYPOINT,
        submission_id=sid,
        runtime_env={
            "working_dir": str(package),
            "py_modules": [str(REPO / "airflow_provider_rayllm")],
            "worker_process_setup_hook": SETUP_HOOK,
        },
    )
    deadline = time.time() + JOB_DEADLINE_S
    while time.time() < deadline:
        status = str(client.get_job_status(sid)).rsplit(".", 1)[-1]
        if status in ("SUCCEEDED", "FAILED", "STOPPED"):
            return status, client.get_job_logs(sid)
        time.sleep(2)
    client.stop_job(sid)
    pytest.fail(f"{sid} still running after {JOB_DEADLINE_S} s")


def rows_of(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = []
    for f in manifest["output_files"]:
        rows.extend(pq.read_table(f["uri"].removeprefix("file://")).to_pylist())
    return rows


def keep_answers(section: str, manifest: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """A few of a guide section's answer rows, for the run's results (RAYLLM_GPU_ANSWERS, when set)."""
    path = os.environ.get("RAYLLM_GPU_ANSWERS")
    if not path:
        return
    try:
        kept = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        kept = {}
    kept[section] = {
        "model": manifest["model"],
        "resource_profile": manifest.get("resource_profile"),
        "gpu": manifest.get("gpu"),
        "rows_out": manifest["rows_out"],
        "output_tokens": manifest["output_tokens"],
        "wall_time_s": manifest["wall_time_s"],
        "timeline": manifest.get("timeline"),
        "rows": rows[:6],
    }
    Path(path).write_text(json.dumps(kept, indent=1, default=str))


def gpu_count() -> int:
    """GPUs nvidia-smi lists here (0 without nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the Hugging Face Hub cannot be reached from here (None when it can)."""
    import socket

    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
    except OSError as exc:
        return f"huggingface.co:443 cannot be reached from this machine ({type(exc).__name__}: {exc})"
    return None
