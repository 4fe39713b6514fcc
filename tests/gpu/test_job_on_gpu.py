"""The job half on a real GPU, submitted through Ray's Jobs API the way the operator submits it.

These need a GPU node and no Airflow (the lent GPU machine has none): a Ray head with the Jobs API
(RAYLLM_GPU_DASHBOARD, its http address) and a generation model folder (RAYLLM_GPU_MODEL; the benchmark's
8B-shaped config runs with load_format='dummy', so no weights travel). `benchmarks/gpu/go.sh` runs them as
its `gputests` phase. Marked `gpu`, so `make test` leaves them out.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.gpu.jobs import dashboard, gpu_used_mib, setting, submit

pytestmark = pytest.mark.gpu
ROWS = 512
MAX_TOKENS = 32


def _settings() -> tuple[str, str]:
    return dashboard(), setting("RAYLLM_GPU_MODEL", "a generation model folder")


def test_the_gpu_profile_picks_itself_sizes_the_engine_and_frees_the_gpu(tmp_path):
    address, model = _settings()
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
    status, log = submit(address, body, tmp_path / "package")
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
    while max(gpu_used_mib()) > 1024 and time.time() < deadline:
        time.sleep(2)
    assert max(gpu_used_mib()) <= 1024, f"GPU memory still held after the job: {gpu_used_mib()} MiB"
