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


def _round_phases(off: tuple, ours: tuple, r: int, hits: int = 0) -> dict:
    o, u = _offline(*off), _ours(*ours)
    o["vllm_log"] = {"compiled_graph_cache_hits": hits}
    u["vllm_log"] = {"compiled_graph_cache_hits": 0}
    return {f"offline_r{r}": o, f"ourjob_gen_r{r}": u}


def test_rounds_give_the_median_and_the_spread_of_each_rounds_own_pair(tmp_path):
    report = _report()
    # whole offline 100 s each round; ours 80, 150, 100 s: e2e 0.8, 1.5, 1.0 -> median 1.0 (mean 1.1).
    # busy: offline 20 s; ours 30, 22, 18 s -> 1.5, 1.1, 0.9 -> median 1.1. Round 4: ours failed, not counted.
    rounds = {
        1: ((0, 60, 70, 75, 90, 100), (0, 5, 50, 60, 80, 80)),
        2: ((0, 60, 70, 80, 90, 100), (0, 5, 120, 130, 142, 150)),
        3: ((0, 60, 70, 85, 90, 100), (0, 5, 70, 71, 88, 100)),
    }
    phases: dict = {}
    for r, (off, ours) in rounds.items():
        phases.update(_round_phases(off, ours, r, hits=1 if r == 3 else 0))
    phases["offline_r4"] = _offline(0, 60, 70, 75, 90, 100)
    phases["ourjob_gen_r4"] = {"ok": False, "status": "FAILED"}
    # an embeddings pair with two rounds: e2e 1.2 and 1.4 -> median 1.3 (the mean of the two)
    phases["offline_embed_r1"] = _offline(0, 30, 31, 32, 35, 50)
    phases["ourjob_embed_r1"] = _ours(0, 3, 40, 41, 50, 60)
    phases["offline_embed_r2"] = _offline(0, 30, 31, 32, 35, 50)
    phases["ourjob_embed_r2"] = _ours(0, 3, 40, 41, 50, 70)
    (tmp_path / "results.json").write_text(json.dumps({"format": 1, "phases": phases, "calls": []}))
    s = report.summarize(tmp_path, 3.5)

    gen = s["rounds"]["generate"]
    assert gen["rounds_run"] == [1, 2, 3, 4] and gen["rounds_counted"] == [1, 2, 3]
    assert gen["e2e_ratio"] == {"median": 1.0, "min": 0.8, "max": 1.5, "values": [0.8, 1.5, 1.0]}
    assert gen["busy_ratio"]["median"] == 1.1 and gen["busy_ratio"]["values"] == [1.5, 1.1, 0.9]
    assert gen["first_token_s"]["values"] == [60, 130, 71] and gen["first_token_s"]["median"] == 71
    assert gen["offline_first_token_s"] == {"median": 80, "min": 75, "max": 85, "values": [75, 80, 85]}
    assert gen["warm_rounds"] == [3]  # offline r3 loaded a compiled graph: flagged, still counted
    assert gen["per_round"][3]["counted"] is False and "ourjob_gen_r4" in gen["per_round"][3]["why_not"]
    # each round pairs its own offline and our job's runs (round 2's ours against round 2's offline)
    assert gen["per_round"][1]["ours_whole_s"] == 150 and gen["per_round"][1]["offline_whole_s"] == 100
    # the top-level keys: no plain offline / ourjob_gen pair here, so the plain key holds the median
    assert s["e2e_ratio_generate"] == s["e2e_ratio_generate_median"] == 1.0
    assert s["e2e_ratio_generate_spread"] == [0.8, 1.5]
    assert s["e2e_ratio_generate_rounds"] == [0.8, 1.5, 1.0]
    assert s["busy_ratio_generate_median"] == 1.1 and s["busy_ratio_generate_spread"] == [0.9, 1.5]
    assert s["first_token_s_median"] == 71 and s["offline_first_token_s_spread"] == [75, 85]
    assert s["rounds"]["embed"]["e2e_ratio"]["values"] == [1.2, 1.4]
    assert s["e2e_ratio_embed_median"] == 1.3 and s["e2e_ratio_embed_spread"] == [1.2, 1.4]
    assert "| **median** |" in report.markdown(s)


def test_rounds_leave_the_plain_pair_s_ratio_alone(tmp_path):
    report = _report()
    phases = {"offline": _offline(0, 60, 70, 75, 90, 100), "ourjob_gen": _ours(0, 5, 50, 60, 80, 90)}
    phases.update(_round_phases((0, 60, 70, 75, 90, 100), (0, 5, 50, 60, 80, 120), 1))
    (tmp_path / "results.json").write_text(json.dumps({"format": 1, "phases": phases, "calls": []}))
    s = report.summarize(tmp_path, 3.5)
    assert s["e2e_ratio_generate"] == 0.9 and s["e2e_ratio_generate_median"] == 1.2


def test_go_sh_rounds_interleave_each_pair():
    _report()  # puts benchmarks/gpu on sys.path
    import common

    assert common.expand_rounds(2, ["head", "offline", "ourjob_gen", "offline_embed", "ourjob_embed"]) == [
        "head",
        "offline_r1",
        "ourjob_gen_r1",
        "offline_r2",
        "ourjob_gen_r2",
        "offline_embed_r1",
        "ourjob_embed_r1",
        "offline_embed_r2",
        "ourjob_embed_r2",
    ]
    assert common.expand_rounds(1, ["ourjob_embed", "stop_head"]) == ["ourjob_embed_r1", "stop_head"]
