"""benchmarks/gpu/report.py's end-to-end comparison: both sides over the same windows, from the exact clock
times the device scripts record (no GPU needed: results.json as the device writes it)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _report():
    sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
    spec = importlib.util.spec_from_file_location("gpu_report", REPO / "benchmarks" / "gpu" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


T = 1_800_000_000.0  # an epoch second; every time below is an offset from it


def _offline(start: float, ready: float, call: float, first: float, end: float, exit_: float) -> dict:
    return {
        "ok": True,
        "import_s": 20.0,
        "engine_init_s": ready - start - 20.0,
        "process_window": [T + start, T + exit_],
        "times": {
            "process_start": T + start,
            "engine_ready": T + ready,
            "call_start": T + call,
            "first_answer": T + first,
            "first_answer_from": "Processed prompts bar",
            "call_end": T + end,
        },
    }


def _ours(submitted: float, driver: float, ready: float, first: float, last: float, ended: float) -> dict:
    return {
        "ok": True,
        "windows": {
            "submitted": T + submitted,
            "ended": T + ended,
            "driver_started": T + driver,
            "engine_ready": T + ready,
            "engine_ready_from": "ray task record: engine actor constructor end",
            "first_answer": T + first,
            "last_answer": T + last,
        },
    }


def test_the_comparison_uses_the_same_windows_on_both_sides(tmp_path):
    report = _report()
    off = (0.0, 75.5, 76.25, 101.0, 112.75, 118.0)
    ours = (0.0, 4.5, 88.0, 110.0, 131.5, 140.25)
    off_e = (0.0, 40.0, 40.5, 41.0, 47.0, 49.0)
    ours_e = (0.0, 4.0, 55.0, 56.0, 61.0, 66.0)
    phases = {
        "offline": _offline(*off),
        "ourjob_gen": _ours(*ours),
        "offline_embed": _offline(*off_e),
        "ourjob_embed": _ours(*ours_e),
        "gputests": {"guide_answers": {"quickstart": {"rows": [{"response": "Machine learning is ..."}]}}},
    }
    (tmp_path / "results.json").write_text(json.dumps({"format": 1, "phases": phases, "calls": []}))
    s = report.summarize(tmp_path, 3.5)

    # whole run: the offline process (start -> exit) against submission -> terminal state
    assert s["e2e_ratio_generate"] == round((ours[5] - ours[0]) / (off[5] - off[0]), 3)
    assert s["e2e_ratio_embed"] == round((ours_e[5] - ours_e[0]) / (off_e[5] - off_e[0]), 3)
    # engine busy: the timed call against engine ready -> last answer
    assert s["busy_ratio_generate"] == round((ours[4] - ours[2]) / (off[4] - off[2]), 3)
    assert s["first_token_s"] == ours[3] - ours[0]
    assert s["offline_first_token_s"] == off[3] - off[0]
    start = s["startup_breakdown"]
    assert start["ours"]["driver_to_engine_ready_s"] == ours[2] - ours[1]
    assert start["offline"]["process_to_engine_ready_s"] == off[1] - off[0]
    assert start["offline"]["after_call_to_exit_s"] == off[5] - off[4]
    assert s["guide_answers"] == phases["gputests"]["guide_answers"]
    assert "| whole run" in report.markdown(s)


def test_no_ratio_without_both_sides(tmp_path):
    report = _report()
    phases = {"offline": _offline(0, 70, 71, 90, 100, 105), "ourjob_gen": {"ok": False, "status": "FAILED"}}
    (tmp_path / "results.json").write_text(json.dumps({"format": 1, "phases": phases, "calls": []}))
    s = report.summarize(tmp_path, 3.5)
    assert s["e2e_ratio_generate"] is None and "busy_ratio_generate" not in s
