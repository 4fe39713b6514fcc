"""The job half on a real GPU, submitted through Ray's Jobs API the way the operator submits it.

These need a GPU node and no Airflow (the lent GPU machine has none): a Ray head with the Jobs API
(RAYLLM_GPU_DASHBOARD, its http address) and a generation model folder (RAYLLM_GPU_MODEL; the benchmark's
8B-shaped config runs with load_format='dummy', so no weights travel). `benchmarks/gpu/go.sh` runs them as
its `gputests` phase. Marked `gpu`, so `make test` leaves them out.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
ROWS = 512
MAX_TOKENS = 32


def _settings() -> tuple[str, str]:
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no nvidia-smi: not a GPU machine")
    dashboard, model = os.environ.get("RAYLLM_GPU_DASHBOARD"), os.environ.get("RAYLLM_GPU_MODEL")
    if not dashboard or not model:
        pytest.skip("set RAYLLM_GPU_DASHBOARD (a Ray head's Jobs API) and RAYLLM_GPU_MODEL (a model folder)")
    return dashboard, model


def _gpu_used_mib() -> list[int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [int(x) for x in out.split()]


def _submit(dashboard: str, body: dict, package: Path) -> tuple[str, str]:
    from ray.job_submission import JobSubmissionClient

    from airflow_provider_rayllm.contract.names import ENTRYPOINT, SETUP_HOOK, SPEC_FILE
    from airflow_provider_rayllm.contract.spec import JobSpec

    spec = JobSpec.model_validate(body)
    package.mkdir(parents=True)
    (package / SPEC_FILE).write_text(spec.to_json())
    client = JobSubmissionClient(dashboard)
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
    deadline = time.time() + 420
    while time.time() < deadline:
        status = str(client.get_job_status(sid)).rsplit(".", 1)[-1]
        if status in ("SUCCEEDED", "FAILED", "STOPPED"):
            return status, client.get_job_logs(sid)
        time.sleep(2)
    client.stop_job(sid)
    pytest.fail(f"{sid} still running after 420 s")


def test_the_gpu_profile_picks_itself_sizes_the_engine_and_frees_the_gpu(tmp_path):
    dashboard, model = _settings()
    from airflow_provider_rayllm.contract.storage import read_manifest
    from airflow_provider_rayllm.job.engines.vllm.hardware import GpuCard
    from airflow_provider_rayllm.job.engines.vllm.settings import BIG_GPU_ENGINE_LIMITS, GPU_ENGINE_DEFAULTS

    source = tmp_path / "rows.jsonl"
    with source.open("w") as f:
        for i in range(ROWS):
            f.write(json.dumps({"id": i, "prompt": f"Write a short story about the number {i}."}) + "\n")
    out = tmp_path / "out"
    body = {
        "version": 1,
        "kind": "vllm",
        "source": {"uris": [str(source)], "format": "jsonl"},
        "prompt": {
            "prompt_column": "prompt",
            "id_column": "id",
            "sampling_params": {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0},
        },
        "processor": {
            "model_source": model,
            "task_type": "generate",
            "engine_kwargs": {"load_format": "dummy", "max_model_len": 2048},
        },
        "sink": {"uri": str(out), "format": "parquet"},
        "run": {"dag_id": "gpu_tests", "run_id": tmp_path.name, "task_id": "generate"},
    }
    status, log = _submit(dashboard, body, tmp_path / "package")
    assert status == "SUCCEEDED", log[-4000:]

    manifest = read_manifest(str(out))
    assert manifest["resource_profile"] == "gpu"
    assert (manifest["rows_in"], manifest["rows_out"], manifest["rows_errored"]) == (ROWS, ROWS, 0)
    # ignore_eos: every row writes exactly max_tokens tokens
    assert manifest["output_tokens"] == ROWS * MAX_TOKENS
    card = GpuCard(manifest["gpu"]["name"], manifest["gpu"]["memory_gib"])
    expected = BIG_GPU_ENGINE_LIMITS if card.big else GPU_ENGINE_DEFAULTS
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        assert manifest["engine_kwargs"][name] == expected[name], (card, name)
    feed = manifest["feed"]
    assert feed["batch_size"] * feed["max_concurrent_batches"] >= expected["max_num_seqs"]

    import pyarrow.dataset as pads

    table = pads.dataset([str(Path(f["uri"].removeprefix("file://"))) for f in manifest["output_files"]]).to_table()
    assert sorted(table.column("id").to_pylist()) == list(range(ROWS))

    # The job's engines are gone with it: nothing of it stays on the GPU.
    deadline = time.time() + 60
    while max(_gpu_used_mib()) > 1024 and time.time() < deadline:
        time.sleep(2)
    assert max(_gpu_used_mib()) <= 1024, f"GPU memory still held after the job: {_gpu_used_mib()} MiB"
