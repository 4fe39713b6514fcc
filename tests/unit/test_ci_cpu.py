"""scripts/ci_cpu.py: a real recording of a child process, and the grouping of processes by kind."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("ci_cpu", REPO / "scripts" / "ci_cpu.py")
assert _spec and _spec.loader
ci_cpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ci_cpu)


def test_a_busy_process_started_while_recording_is_counted_under_its_kind(tmp_path):
    out = tmp_path / "cpu.json"
    recorder = subprocess.Popen([sys.executable, str(REPO / "scripts" / "ci_cpu.py"), "record", str(out)])
    time.sleep(1.0)
    # A process that spins for a second of CPU time, titled as a Ray actor is (a name of its own: other tests'
    # Ray processes run beside this one).
    name = f"CiCpuSpinner{os.getpid()}"
    spin = f"import time, setproctitle; setproctitle.setproctitle('ray::{name}')\n"
    spin += "t = time.process_time()\nwhile time.process_time() - t < 1.0: pass\ntime.sleep(0.5)"
    subprocess.run([sys.executable, "-c", spin], check=True)
    recorder.send_signal(signal.SIGTERM)
    assert recorder.wait(timeout=30) == 0
    result = ci_cpu.summary(out, top=10)
    row = next(r for r in result["by_kind"] if r["kind"] == f"Ray: {name}")
    assert row["processes"] == 1 and 0.8 <= row["cpu_s"] <= 1.6, row
    assert json.loads(out.read_text())["seconds"] > 1.0


def test_kinds_name_the_stage_actor_the_driver_and_a_worker_that_never_ran_a_task():
    assert ci_cpu.kind(["ray::IDLE", "ray::MapWorker(MapBatches(HttpCaller)).submit"]) == "Ray Data actor: HttpCaller"
    assert ci_cpu.kind(["python -m airflow_provider_rayllm.job spec.json"]).startswith("job driver")
    assert ci_cpu.kind([".venv/bin/python .../ray/_private/workers/default_worker.py --node-ip-address=1"]) == (
        "Ray: worker that never ran a task"
    )
    assert ci_cpu.kind(["VLLM::EngineCore"]) == "vLLM engine core / workers"
