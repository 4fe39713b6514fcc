"""Summarize a GPU run: benchmarks/results/<date>-gpu/ (what the device returned) -> benchmarks/results/<date>-gpu.json,
and print a markdown section for docs/PERFORMANCE.md (beside its "GPU projection"; this script edits no doc).

    python benchmarks/gpu/report.py [--date YYYY-MM-DD | --dir DIR] [--price-per-hour 3.50] [--out FILE]

Input layout (copy the device call's files there as they come back; the last call's results.json holds
every phase run so far):
    benchmarks/results/<date>-gpu/results.json    {"format": 1, "phases": {phase: {...}}, "gpu_after_phase": {...}, "calls": [...]}
    benchmarks/results/<date>-gpu/go.log          (optional) the call's log
    benchmarks/results/<date>-gpu/gpu.csv         (optional) phase,time,mem_used_mib,util_pct,power_w, one row a second
    benchmarks/results/<date>-gpu/logs/*.log      (optional) our job's logs, head and tail
    benchmarks/results/<date>-gpu/gputests*.xml   (optional) the gpu tests' JUnit files, one per call
    benchmarks/results/<date>-gpu/notes.json      (optional) written by hand: {key: value} added to the summary
Phases read: envcheck, offline (vLLM LLM.chat, the ceiling), ourjob_gen and ourjob_gen_matched (our driver
through the Jobs API), offline_embed and ourjob_embed (MiniLM), head, gpu_after_phase; and go.sh's ROUNDS phases
(offline_r<n>, ourjob_gen_r<n>, offline_embed_r<n>, ourjob_embed_r<n>): `rounds` pairs each round's offline run
with our job's run of the same round over the same windows and gives every round's figures, their median and
spread (min, max); top-level <key>_median, <key>_spread and <key>_rounds for e2e_ratio_<task>, busy_ratio_<task>,
first_token_s and offline_first_token_s (and, where no plain pair ran, <key> itself holds the median).
A results folder of another name: --dir benchmarks/results/<name> writes benchmarks/results/<name>.json.

Numbers: output tokens/s of the timed call (offline) or of the engine phase (ours) and over the whole job;
efficiency = ours / offline; cost per million output tokens = price per GPU-hour / (3600 x tokens/s) x 1e6.
The end-to-end comparison (e2e_ratio_generate, e2e_ratio_embed, busy_ratio_generate, first_token_s,
offline_first_token_s, startup_breakdown) uses the same windows on both sides, from exact clock times:
the offline script's whole process (go.sh's clock before the interpreter and after its exit) against our job
from submission to SUCCEEDED (Ray's job record, milliseconds); the timed offline call against our engine's
ready (Ray's task record of the engine actor's constructor) -> the last answer the job counted (manifest
timeline, from the driver's start). The guide sections' answers (gputests) and the gpu tests' outcomes
(gputests.xml, or one gputests-<n>.xml per call that ran the phase: a later call's outcome of a test replaces
an earlier one's) are carried over.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(HERE))

import common  # noqa: E402  (standard library only at import time)

# On paper (benchmarks/report.py's gpu_projection, repeated so this script runs alone): an 8B bf16 model on
# one H200 SXM: 4.8 TB/s, 989 TFLOPS dense BF16.
H200 = {"hbm_gb": 141, "hbm_tb_per_s": 4.8, "bf16_dense_tflops": 989}
MODEL_8B = {"params_b": 8.03, "bytes_per_param": 2, "layers": 32, "kv_heads": 8, "head_dim": 128}


def projection() -> dict:
    try:
        sys.path.insert(0, str(REPO))
        from benchmarks.report import gpu_projection

        return gpu_projection()
    except Exception:
        weights_gb = MODEL_8B["params_b"] * MODEL_8B["bytes_per_param"]
        steps = H200["hbm_tb_per_s"] * 1e12 / (weights_gb * 1e9)
        compute = H200["bf16_dense_tflops"] * 1e12 / (2 * MODEL_8B["params_b"] * 1e9)
        return {
            "weights_gb": round(weights_gb, 1),
            "memory_bound_decode_steps_per_s": round(steps),
            "compute_bound_tokens_per_s": round(compute),
            "batch_where_compute_binds": round(compute / steps),
        }


def find_dir(args: argparse.Namespace) -> Path:
    if args.dir:
        return Path(args.dir)
    if args.date:
        return RESULTS / f"{args.date}-gpu"
    dirs = sorted(p for p in RESULTS.glob("20??-??-??-gpu") if (p / "results.json").exists())
    if not dirs:
        raise SystemExit("no benchmarks/results/<date>-gpu/results.json yet: copy the device call's files there")
    return dirs[-1]


def per_m(price_per_hour: float, tok_per_s: float | None) -> float | None:
    return None if not tok_per_s else price_per_hour / 3600 / tok_per_s * 1e6


def gpu_csv(path: Path) -> dict[str, dict]:
    """Per phase: samples, memory max, mean utilization, share of seconds the GPU was busy, mean power."""
    if not path.exists():
        return {}
    rows: dict[str, list] = {}
    with path.open() as f:
        for r in csv.DictReader(f):
            try:
                rows.setdefault(r["phase"], []).append(
                    (float(r["time"]), int(r["mem_used_mib"]), int(r["util_pct"]), float(r["power_w"]))
                )
            except (KeyError, ValueError):
                pass
    out = {}
    for phase, xs in rows.items():
        out[phase] = {
            "samples": len(xs),
            "mem_used_max_mib": max(x[1] for x in xs),
            "util_mean_pct": round(sum(x[2] for x in xs) / len(xs), 1),
            "util_busy_share": round(sum(1 for x in xs if x[2] > 0) / len(xs), 3),
            "power_mean_w": round(sum(x[3] for x in xs) / len(xs), 1),
        }
    return out


def vllm_startup(p: dict, src: Path) -> dict:
    """vLLM's start-up lines: from the result, else parsed again from the phase's log file."""
    v = p.get("vllm_log")
    if not v:
        log = src / "logs" / f"{p.get('_phase', '')}.log"
        v = common.parse_vllm_log(log.read_text(errors="replace")) if log.exists() else {}
    keys = (
        "dynamo_transform_s",
        "graph_compile_s",
        "torch_compile_total_s",
        "compiled_graph_cache_hits",
        "weights_load_s",
        "model_load_s",
        "model_load_gib",
        "memory_profiling_s",
        "cuda_graph_capture_s",
        "kv_cache_gib",
        "kv_cache_tokens",
        "max_concurrency_x",
        "init_engine_s",
        "init_engine_compile_s",
        "running_reqs_max",
        "engines_started",
    )
    return {k: v.get(k) for k in keys if v.get(k) is not None}


def summarize(src: Path, price: float) -> dict[str, Any]:
    data = json.loads((src / "results.json").read_text())
    phases = data.get("phases", {})
    for name, p in phases.items():
        p["_phase"] = name
    csv_gpu = gpu_csv(src / "gpu.csv")
    env = phases.get("envcheck", {})
    mods = env.get("modules", {})
    out: dict[str, Any] = {
        "date": src.name[:10],
        "source": str(src.relative_to(REPO)) if src.is_relative_to(REPO) else str(src),
        "device": {
            "nvidia_smi": env.get("nvidia_smi") or _gpu_name(phases),
            "python": ((env.get("python") or "").split() or [None])[0],
            "torch": (env.get("torch_cuda") or {}).get("value"),
            "vllm": (mods.get("vllm") or {}).get("version"),
            "ray": (mods.get("ray") or {}).get("version"),
            "pyarrow": mods.get("pyarrow"),
            "pydantic": mods.get("pydantic"),
            "aiohttp": mods.get("aiohttp"),
            "flash_attn": (env.get("flash_attn") or {}).get("value"),
            "our_job_imports_without_airflow": (env.get("our_job_imports") or {}).get("value"),
        },
        "price_per_gpu_hour_usd": price,
        "workload": (data.get("calls") or [{}])[-1].get("workload"),
        "gpu_projection": projection(),
        "phases_run": {k: v.get("phase_status") for k, v in phases.items()},
    }

    off = phases.get("offline") or {}
    offline_tps = off.get("output_tok_per_s") if off.get("ok") else None
    if off:
        out["offline"] = {
            "ok": off.get("ok"),
            "mode": off.get("mode"),
            "n_prompts": off.get("n_prompts"),
            "avg_prompt_tokens": off.get("avg_prompt_tokens"),
            "output_tokens": off.get("output_tokens"),
            "gen_s": off.get("gen_s"),
            "output_tok_per_s": offline_tps,
            "total_tok_per_s": off.get("total_tok_per_s"),
            "scheduler": off.get("scheduler"),
            "startup_s": {
                "import_vllm": off.get("import_s"),
                "engine_init": off.get("engine_init_s"),
                "warmup_call": off.get("warmup_s"),
            },
            "vllm_startup": vllm_startup(off, src),
            "gpu_during_gen": off.get("gpu_during_gen"),
            "gpu_phase": csv_gpu.get("offline") or off.get("gpu"),
            "usd_per_m_output_tokens": per_m(price, offline_tps),
            "share_of_compute_roofline": (
                offline_tps / out["gpu_projection"]["compute_bound_tokens_per_s"] if offline_tps else None
            ),
            "error": off.get("error"),
        }

    ours = {}
    for name in ("ourjob_gen", "ourjob_gen_matched", "ourjob_embed", "ourjob_embed_nochunk"):
        p = phases.get(name)
        if not p:
            continue
        eng_tps = p.get("output_tok_per_s_engine_phase")
        wall_tps = p.get("output_tok_per_s_wall")
        spec = p.get("spec") or {}
        proc = spec.get("processor") or {}
        man = p.get("manifest") or {}
        entry = {
            "ok": p.get("ok"),
            "status": p.get("status"),
            "task": p.get("task"),
            "rows": p.get("rows_out"),
            "rows_errored": p.get("rows_errored"),
            "input_tokens": p.get("input_tokens"),
            "output_tokens": p.get("output_tokens"),
            "wall_s": p.get("wall_s"),
            "engine_phase_s": p.get("engine_phase_s"),
            "timeline_s": p.get("timeline_s"),
            "queued_s": p.get("queued_s"),
            "first_output_s_manifest": man.get("first_output_s"),
            "driver_wall_s_manifest": man.get("wall_time_s"),
            "engine_kwargs_given": proc.get("engine_kwargs"),
            "engine_kwargs_used": man.get("engine_kwargs"),
            "resource_profile": man.get("resource_profile"),
            "batch_size": proc.get("batch_size"),
            "max_concurrent_batches": proc.get("max_concurrent_batches"),
            "vllm_startup": vllm_startup(p, src),
            "gpu_job": csv_gpu.get(name) or p.get("gpu"),
            "gpu_engine_phase": p.get("gpu_engine_phase"),
            "gpu_after_job": {
                "leftover_apps": (p.get("gpu_after_job") or {}).get("leftover_apps"),
                "gpu_used_mib": (p.get("gpu_after_job") or {}).get("gpu_used_mib"),
                "killed": p.get("leftovers_killed"),
            },
            "manifest_found": p.get("manifest_file_found"),
            "error_lines": p.get("error_lines"),
            "error": p.get("error"),
        }
        if p.get("task") == "generate":
            entry.update(
                {
                    "output_tok_per_s_engine_phase": eng_tps,
                    "output_tok_per_s_wall": wall_tps,
                    "efficiency_engine_phase_vs_offline": eng_tps / offline_tps if eng_tps and offline_tps else None,
                    "efficiency_wall_vs_offline": wall_tps / offline_tps if wall_tps and offline_tps else None,
                    "usd_per_m_output_tokens_engine_phase": per_m(price, eng_tps),
                    "usd_per_m_output_tokens_wall": per_m(price, wall_tps),
                    "all_rows_full_length": p.get("all_rows_full_length"),
                    "running_reqs_max": (p.get("vllm_log") or {}).get("running_reqs_max"),
                }
            )
        else:
            entry.update(
                {
                    "rows_per_s_engine_phase": p.get("rows_per_s_engine_phase"),
                    "input_tok_per_s_engine_phase": p.get("input_tok_per_s_engine_phase"),
                    "embed_check": p.get("embed_check"),
                }
            )
        ours[name] = entry
    out["ours"] = ours

    oe = phases.get("offline_embed")
    if oe:
        out["offline_embed"] = {
            "ok": oe.get("ok"),
            "rows": oe.get("rows"),
            "gen_s": oe.get("gen_s"),
            "rows_per_s": oe.get("rows_per_s"),
            "input_tok_per_s": oe.get("input_tok_per_s"),
            "startup_s": {"import_vllm": oe.get("import_s"), "engine_init": oe.get("engine_init_s")},
            "vllm_startup": vllm_startup(oe, src),
            "error": oe.get("error"),
        }
        e = ours.get("ourjob_embed") or {}
        if oe.get("rows_per_s") and e.get("rows_per_s_engine_phase"):
            e["efficiency_engine_phase_vs_offline"] = e["rows_per_s_engine_phase"] / oe["rows_per_s"]

    out.update(honest_windows(phases, src))
    rounds = rounds_summary(phases, src)
    if rounds:
        out["rounds"] = rounds
        out.update(round_keys(rounds, out))
    out["guide_answers"] = (phases.get("gputests") or {}).get("guide_answers")
    out["gpu_tests"] = gpu_tests(src)
    # What a person wrote about the run (notes.json beside results.json): caveats, outcomes read from a log
    # whose JUnit file was never written; kept under their own keys, never over a measured value.
    try:
        written = json.loads((src / "notes.json").read_text())
    except (OSError, ValueError):
        written = {}
    for key, value in written.items():
        if out.get(key) is None:
            out[key] = value

    out["gpu_after_phase"] = {
        k: {
            "gpu_used_mib": v.get("gpu_used_mib"),
            "leftover_apps": len(v.get("leftover_apps") or []),
            "killed": v.get("killed"),
        }
        for k, v in (data.get("gpu_after_phase") or {}).items()
    }
    out["head"] = {k: (phases.get("head") or {}).get(k) for k in ("auth_mode", "up_s", "cluster_resources", "num_gpus")}
    notes = []
    for name, p in phases.items():
        for line in (p.get("vllm_log") or {}).get("notable_lines") or []:
            if re.search(
                r"does not officially support|crash|out of memory|Free memory|CUDA error|No module named", line, re.I
            ):
                notes.append(f"{name}: {line.strip()[-220:]}")
    out["notable"] = notes[:20]
    return out


def _span(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(b - a, 3)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else round(a / b, 3)


def offline_windows(p: dict) -> dict:
    """vLLM's offline script: the whole process (go.sh's clock before the interpreter starts and after it
    exits) and the engine-busy window (the timed call), from exact clock times."""
    t = dict(p.get("times") or {})
    proc = p.get("process_window") or [None, None]
    if not t.get("first_answer_from"):
        # Before the bar was told apart: vLLM's "Rendering conversations" bar, not a finished request.
        t["first_answer"] = None
    return {
        "whole_s": _span(proc[0], proc[1]),
        "busy_s": _span(t.get("call_start"), t.get("call_end")),
        "first_answer_s": _span(proc[0], t.get("first_answer")),
        "startup": {
            "process_to_engine_ready_s": _span(proc[0], t.get("engine_ready")),
            "import_vllm_s": p.get("import_s"),
            "engine_init_s": p.get("engine_init_s"),
            "engine_ready_to_call_s": _span(t.get("engine_ready"), t.get("call_start")),
            "call_to_first_answer_s": _span(t.get("call_start"), t.get("first_answer")),
            "after_call_to_exit_s": _span(t.get("call_end"), proc[1]),
        },
    }


def ours_windows(p: dict, log_ready: float | None = None) -> dict:
    """Our job: submitted -> terminal state (Ray's job record) and engine ready (the engine actor's constructor
    end in Ray's task record) -> the last answer the job counted."""
    w = dict(p.get("windows") or {})
    if not str(w.get("engine_ready_from") or "").startswith("ray task record") and log_ready is not None:
        # The exact source was not read: vLLM's "init engine ... took" line, to the second (device clock, UTC).
        w["engine_ready"], w["engine_ready_from"] = log_ready, "vLLM 'init engine' log line (1 s resolution)"
    return {
        "whole_s": _span(w.get("submitted"), w.get("ended")),
        "busy_s": _span(w.get("engine_ready"), w.get("last_answer")),
        "busy_from": w.get("engine_ready_from"),
        "engine_ready_error": w.get("engine_ready_error"),
        "first_answer_s": _span(w.get("submitted"), w.get("first_answer")),
        "startup": {
            "submitted_to_driver_s": _span(w.get("submitted"), w.get("driver_started")),
            "driver_to_engine_ready_s": _span(w.get("driver_started"), w.get("engine_ready")),
            "engine_ready_to_first_answer_s": _span(w.get("engine_ready"), w.get("first_answer")),
            "last_answer_to_end_s": _span(w.get("last_answer"), w.get("ended")),
        },
    }


def init_engine_at(log: Path) -> float | None:
    """The epoch second of vLLM's first "init engine ... took" line in a job log (the device's clock is UTC)."""
    from datetime import datetime, timezone

    if not log.exists():
        return None
    for line in log.read_text(errors="replace").splitlines():
        m = re.search(r"INFO (\d\d-\d\d \d\d:\d\d:\d\d) \[core\.py:\d+\] init engine", line)
        if m:
            year = datetime.now(timezone.utc).year
            return (
                datetime.strptime(f"{year}-{m.group(1)}", "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc).timestamp()
            )
    return None


# The end-to-end comparison's pairs: (task, the offline script's phase, our job's phase).
PAIRS = (("generate", "offline", "ourjob_gen"), ("embed", "offline_embed", "ourjob_embed"))
FIRST_TOKEN_MEANS = (
    "seconds to the first finished request (a whole answer): ours from submission, offline from the process start"
)


def pair_windows(off: dict, ours: dict, log: Path | None = None) -> dict | None:
    """One offline run against one run of our job over the same windows (None unless both are ok): the whole run
    as a user pays for it (our job submitted -> SUCCEEDED against the offline script's whole process) and the
    engine's busy time; ratios are ours / offline, in seconds for the same rows (above 1: ours takes longer)."""
    if not (off.get("ok") and ours.get("ok")):
        return None
    o, u = offline_windows(off), ours_windows(ours, init_engine_at(log) if log else None)
    return {
        "e2e_ratio": _ratio(u["whole_s"], o["whole_s"]),
        "busy_ratio": _ratio(u["busy_s"], o["busy_s"]),
        "first_token_s": u["first_answer_s"],
        "offline_first_token_s": o["first_answer_s"],
        "windows": {"offline": o, "ours": u},
    }


def honest_windows(phases: dict, src: Path | None = None) -> dict:
    """Both sides over the same windows (pair_windows) for the plain phases (offline / ourjob_gen,
    offline_embed / ourjob_embed)."""
    out: dict[str, Any] = {}
    for task, off_name, ours_name in PAIRS:
        pw = pair_windows(
            phases.get(off_name) or {}, phases.get(ours_name) or {}, src / "logs" / f"{ours_name}.log" if src else None
        )
        if pw is None:
            out[f"e2e_ratio_{task}"] = None
            continue
        o, u = pw["windows"]["offline"], pw["windows"]["ours"]
        out[f"e2e_ratio_{task}"] = pw["e2e_ratio"]
        out[f"busy_ratio_{task}"] = pw["busy_ratio"]
        out[f"windows_{task}"] = pw["windows"]
        if task == "generate":
            out["first_token_s"] = pw["first_token_s"]
            out["offline_first_token_s"] = pw["offline_first_token_s"]
            out["first_token_means"] = FIRST_TOKEN_MEANS
            out["startup_breakdown"] = {"offline": o["startup"], "ours": u["startup"]}
    return out


# Per round: the figures whose median and spread (min, max) are given over the rounds both sides finished.
ROUND_FIGURES = (
    "e2e_ratio",
    "busy_ratio",
    "first_token_s",
    "offline_first_token_s",
    "offline_whole_s",
    "ours_whole_s",
    "offline_busy_s",
    "ours_busy_s",
)


def spread(values: list[float]) -> dict[str, Any]:
    """The median of the values, their min and max, and the values themselves (in round order)."""
    import statistics

    if not values:
        return {"median": None, "min": None, "max": None, "values": []}
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "values": values,
    }


def rounds_summary(phases: dict, src: Path | None = None) -> dict[str, Any]:
    """go.sh's ROUNDS: for each pair, every round's offline run against our job's run of the SAME round over the
    same windows (pair_windows), then the median and the spread (min, max) of each figure over the rounds where
    both sides finished. A round counts only with both sides ok; its compile-cache hits are shown (0 on both
    sides: the round compiled cold)."""
    out: dict[str, Any] = {}
    for task, off_base, ours_base in PAIRS:
        rounds = sorted(
            {
                int(m.group(2))
                for m in map(common.ROUND_PHASE.match, phases)
                if m and m.group(1) in (off_base, ours_base)
            }
        )
        if not rounds:
            continue
        per_round = []
        for r in rounds:
            off_name, ours_name = f"{off_base}_r{r}", f"{ours_base}_r{r}"
            off, ours = phases.get(off_name) or {}, phases.get(ours_name) or {}
            entry: dict[str, Any] = {
                "round": r,
                "offline_phase": off_name if off else None,
                "ours_phase": ours_name if ours else None,
                "offline_status": off.get("phase_status"),
                "ours_status": ours.get("status") or ours.get("phase_status"),
            }
            pw = pair_windows(off, ours, src / "logs" / f"{ours_name}.log" if src else None)
            if pw is None:
                missing = [n for n, p in ((off_name, off), (ours_name, ours)) if not p.get("ok")]
                entry.update(counted=False, why_not=f"not ok or not run: {', '.join(missing)}")
                per_round.append(entry)
                continue
            o, u = pw["windows"]["offline"], pw["windows"]["ours"]
            hits = {
                side: (p.get("vllm_log") or {}).get("compiled_graph_cache_hits")
                for side, p in (("offline", off), ("ours", ours))
            }
            entry.update(
                counted=True,
                e2e_ratio=pw["e2e_ratio"],
                busy_ratio=pw["busy_ratio"],
                first_token_s=pw["first_token_s"],
                offline_first_token_s=pw["offline_first_token_s"],
                offline_whole_s=o["whole_s"],
                ours_whole_s=u["whole_s"],
                offline_busy_s=o["busy_s"],
                ours_busy_s=u["busy_s"],
                ours_busy_from=u["busy_from"],
                compiled_graph_cache_hits=hits,
                cold=None if None in hits.values() else not any(hits.values()),
                caches_emptied_before={
                    "offline": off.get("caches_emptied_before"),
                    "ours": ours.get("caches_emptied_before"),
                },
                startup={"offline": o["startup"], "ours": u["startup"]},
            )
            if task == "generate":
                entry["offline_output_tok_per_s"] = off.get("output_tok_per_s")
                entry["ours_output_tok_per_s_engine_phase"] = ours.get("output_tok_per_s_engine_phase")
            else:
                entry["offline_rows_per_s"] = off.get("rows_per_s")
                entry["ours_rows_per_s_engine_phase"] = ours.get("rows_per_s_engine_phase")
            per_round.append(entry)
        counted = [e for e in per_round if e["counted"]]
        out[task] = {
            "rounds_run": rounds,
            "rounds_counted": [e["round"] for e in counted],
            "warm_rounds": [e["round"] for e in counted if e.get("cold") is False],
            **{k: spread([e[k] for e in counted if e.get(k) is not None]) for k in ROUND_FIGURES},
            "per_round": per_round,
        }
    return out


def round_keys(rounds: dict[str, Any], plain: dict[str, Any]) -> dict[str, Any]:
    """The rounds' figures as top-level keys: <figure>_median, <figure>_spread ([min, max]) and <figure>_rounds
    (each counted round's value, in round order) for e2e_ratio_<task>, busy_ratio_<task> and (generation)
    first_token_s / offline_first_token_s; where the plain phases gave no ratio, the plain key holds the median."""
    out: dict[str, Any] = {}
    for task, r in rounds.items():
        names = {"e2e_ratio": f"e2e_ratio_{task}", "busy_ratio": f"busy_ratio_{task}"}
        if task == "generate":
            names.update(first_token_s="first_token_s", offline_first_token_s="offline_first_token_s")
        for figure, key in names.items():
            st = r[figure]
            out[f"{key}_median"] = st["median"]
            out[f"{key}_spread"] = [st["min"], st["max"]]
            out[f"{key}_rounds"] = st["values"]
            if plain.get(key) is None and st["median"] is not None:
                out[key] = st["median"]
                out[f"{key}_basis"] = f"median of {len(st['values'])} rounds ({task} rounds {r['rounds_counted']})"
        if task == "generate" and plain.get("first_token_means") is None:
            out["first_token_means"] = FIRST_TOKEN_MEANS
    return out


def _xml_order(path: Path) -> int:
    """gputests.xml first, then gputests-<n>.xml by n (the call that returned it)."""
    m = re.fullmatch(r"gputests-(\d+)\.xml", path.name)
    return int(m.group(1)) if m else 0


def gpu_tests(src: Path) -> dict | None:
    """The gputests phase's JUnit files (gputests.xml, gputests-<n>.xml): each test's outcome, seconds, skip
    reason and file; a test run in several calls keeps the latest call's outcome."""
    import xml.etree.ElementTree as ET

    files = sorted(src.glob("gputests*.xml"), key=_xml_order)
    if not files:
        return None
    by_test: dict[str, dict] = {}
    for path in files:
        for case in ET.parse(path).getroot().iter("testcase"):
            outcome, reason = "passed", None
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None:
                    outcome, reason = (
                        {"failure": "failed", "error": "error", "skipped": "skipped"}[tag],
                        node.get("message"),
                    )
            name = f"{case.get('classname')}::{case.get('name')}"
            by_test[name] = {
                "test": name,
                "outcome": outcome,
                "s": float(case.get("time") or 0),
                "reason": reason,
                "file": path.name,
            }
    tests = list(by_test.values())
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    return {"counts": counts, "tests": tests}


def _f(x: Any, fmt: str = "{:,.0f}") -> str:
    if x is None:
        return "-"
    try:
        return fmt.format(x)
    except (ValueError, TypeError):
        return str(x)


def _gpu_name(found: Any) -> str | None:
    """The card our job's manifest names (``gpu.name``), for a run without the envcheck phase."""
    if isinstance(found, dict):
        gpu = found.get("gpu")
        if isinstance(gpu, dict) and isinstance(gpu.get("name"), str):
            return gpu["name"]
        found = list(found.values())
    if isinstance(found, list):
        for value in found:
            name = _gpu_name(value)
            if name:
                return name
    return None


def markdown(s: dict) -> str:
    d = s["device"]
    card = d.get("nvidia_smi") or "H200"
    short = "H100" if "H100" in card else "H200"
    lines = [f"## GPU measurement (one {short}, {s['date']})", ""]
    lines.append(
        f"Measured on a lent machine with one {card} (Python {d.get('python') or '?'}, "
        f"vLLM {d.get('vllm') or '?'}, Ray {d.get('ray') or '?'}). Workload: {_workload(s)}. "
        f"Prices at ${s['price_per_gpu_hour_usd']:.2f} per GPU-hour."
    )
    lines += [
        "",
        "| run | output tokens/s | vs offline | whole job | GPU memory max | GPU busy (mean util) | $ per M output tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    off = s.get("offline")
    if off:
        g = off.get("gpu_during_gen") or {}
        lines.append(
            f"| vLLM offline `LLM.{off.get('mode') or 'chat'}` (timed call; max_num_seqs "
            f"{_f((off.get('scheduler') or {}).get('max_num_seqs'))}, max_num_batched_tokens "
            f"{_f((off.get('scheduler') or {}).get('max_num_batched_tokens'))}) | **{_f(off.get('output_tok_per_s'))}** | 1.00x | "
            f"{_f(off.get('gen_s'), '{:.1f}')} s call | {_f((off.get('gpu_phase') or {}).get('mem_used_max_mib'))} MiB | "
            f"{_f(g.get('util_mean_pct'), '{:.0f}')} % | {_f(off.get('usd_per_m_output_tokens'), '${:.3f}')} |"
        )
    for name, o in s.get("ours", {}).items():
        if o.get("task") != "generate":
            continue
        label = {
            "ourjob_gen": "VLLMBatchOperator's job, GPU defaults",
            "ourjob_gen_matched": "same, offline's scheduler limits, batch 128 x 16",
        }.get(name, name)
        used = o.get("engine_kwargs_used") or {}
        lines.append(
            f"| {label} (max_num_seqs {_f(used.get('max_num_seqs'))}, max_num_batched_tokens {_f(used.get('max_num_batched_tokens'))}; "
            f"{o.get('status')}) | **{_f(o.get('output_tok_per_s_engine_phase'))}** engine phase, {_f(o.get('output_tok_per_s_wall'))} whole job | "
            f"{_f(o.get('efficiency_engine_phase_vs_offline'), '{:.2f}x')} / {_f(o.get('efficiency_wall_vs_offline'), '{:.2f}x')} | "
            f"{_f(o.get('wall_s'), '{:.0f}')} s | {_f((o.get('gpu_job') or {}).get('mem_used_max_mib'))} MiB | "
            f"{_f((o.get('gpu_engine_phase') or {}).get('util_mean_pct'), '{:.0f}')} % | "
            f"{_f(o.get('usd_per_m_output_tokens_engine_phase'), '${:.3f}')} / {_f(o.get('usd_per_m_output_tokens_wall'), '${:.3f}')} |"
        )
    p = s["gpu_projection"]
    if off and off.get("output_tok_per_s"):
        lines += [
            "",
            f"Against the projection above: offline reaches {off['share_of_compute_roofline']:.0%} of the "
            f"compute-bound ~{p['compute_bound_tokens_per_s']:,} tokens/s (a batch of ~{p['batch_where_compute_binds']} "
            f"sequences binds compute on paper; vLLM ran up to {_f((off.get('scheduler') or {}).get('max_num_seqs'))} at once).",
        ]
    lines += [
        "",
        "Start-up (seconds):",
        "",
        "| step | offline | "
        + " | ".join(k for k, o in s.get("ours", {}).items() if o.get("task") == "generate")
        + " |",
        "|---|---|" + "---|" * sum(1 for o in s.get("ours", {}).values() if o.get("task") == "generate"),
    ]
    gens = [o for o in s.get("ours", {}).values() if o.get("task") == "generate"]
    ov = (off or {}).get("vllm_startup", {})

    def row(label: str, offline_value: Any, fn) -> None:
        lines.append(
            f"| {label} | {_f(offline_value, '{:.1f}')} | " + " | ".join(_f(fn(o), "{:.1f}") for o in gens) + " |"
        )

    row("submission -> driver's first line", None, lambda o: (o.get("timeline_s") or {}).get("driver_started"))
    row("-> checks done", None, lambda o: (o.get("timeline_s") or {}).get("checks_done"))
    row("-> source read", None, lambda o: (o.get("timeline_s") or {}).get("source_read"))
    row("-> rows prepared", None, lambda o: (o.get("timeline_s") or {}).get("rows_prepared"))
    row("import vllm", (off or {}).get("startup_s", {}).get("import_vllm"), lambda o: None)
    row(
        "engine init (LLM(...) / actor: vLLM's init engine)",
        (off or {}).get("startup_s", {}).get("engine_init"),
        lambda o: o["vllm_startup"].get("init_engine_s"),
    )
    row(
        "  of which torch.compile",
        ov.get("torch_compile_total_s"),
        lambda o: o["vllm_startup"].get("torch_compile_total_s"),
    )
    row(
        "  of which CUDA graph capture",
        ov.get("cuda_graph_capture_s"),
        lambda o: o["vllm_startup"].get("cuda_graph_capture_s"),
    )
    row("  weights (dummy) load", ov.get("model_load_s"), lambda o: o["vllm_startup"].get("model_load_s"))
    row("submission -> engine ready", None, lambda o: (o.get("timeline_s") or {}).get("engine_ready"))
    row("first output row (after the driver's start; manifest)", None, lambda o: o.get("first_output_s_manifest"))
    row("engine phase (engine ready -> rows out)", (off or {}).get("gen_s"), lambda o: o.get("engine_phase_s"))
    row("whole job (submission -> end)", None, lambda o: o.get("wall_s"))
    lines.append(
        f"| KV cache (GiB / tokens) | {_f(ov.get('kv_cache_gib'), '{:.1f}')} / {_f(ov.get('kv_cache_tokens'))} | "
        + " | ".join(
            f"{_f(o['vllm_startup'].get('kv_cache_gib'), '{:.1f}')} / {_f(o['vllm_startup'].get('kv_cache_tokens'))}"
            for o in gens
        )
        + " |"
    )
    emb, oe = s.get("ours", {}).get("ourjob_embed"), s.get("offline_embed")
    if emb or oe:
        lines += ["", "Embeddings (all-MiniLM-L6-v2, real weights):", ""]
        if oe:
            lines.append(
                f"- vLLM offline `LLM.embed`: {_f(oe.get('rows'))} rows in {_f(oe.get('gen_s'), '{:.2f}')} s = "
                f"{_f(oe.get('rows_per_s'))} rows/s ({_f(oe.get('input_tok_per_s'))} input tokens/s)."
            )
        if emb:
            chk = emb.get("embed_check") or {}
            lines.append(
                f"- our job ({emb.get('status')}): {_f(emb.get('rows'))} rows, engine phase {_f(emb.get('engine_phase_s'), '{:.1f}')} s = "
                f"{_f(emb.get('rows_per_s_engine_phase'))} rows/s"
                + (
                    f" ({emb['efficiency_engine_phase_vs_offline']:.2f}x offline)"
                    if emb.get("efficiency_engine_phase_vs_offline")
                    else ""
                )
                + f", whole job {_f(emb.get('wall_s'), '{:.0f}')} s; against sentence-transformers on {_f(chk.get('rows'))} rows: "
                f"cosine min {_f(chk.get('cosine_min'), '{:.5f}')}, mean {_f(chk.get('cosine_mean'), '{:.5f}')}."
            )
    for task in ("generate", "embed"):
        w = s.get(f"windows_{task}")
        if not w:
            continue
        o, u = w["offline"], w["ours"]
        lines += [
            "",
            f"Same windows, {task} (exact clock times; ours / offline, seconds for the same rows):",
            "",
            "| window | offline | ours | ratio |",
            "|---|---|---|---|",
            f"| whole run (offline: the script's process; ours: submitted -> SUCCEEDED) | {_f(o['whole_s'], '{:.1f}')} | "
            f"{_f(u['whole_s'], '{:.1f}')} | **{_f(s.get(f'e2e_ratio_{task}'), '{:.2f}x')}** |",
            f"| engine busy (offline: the timed call; ours: engine ready -> last answer) | {_f(o['busy_s'], '{:.1f}')} | "
            f"{_f(u['busy_s'], '{:.1f}')} | {_f(s.get(f'busy_ratio_{task}'), '{:.2f}x')} |",
            f"| first finished request (from process start / submission) | {_f(o['first_answer_s'], '{:.1f}')} | "
            f"{_f(u['first_answer_s'], '{:.1f}')} | |",
        ]
    for task, r in (s.get("rounds") or {}).items():
        lines += [
            "",
            f"Rounds, {task} (each round cold on both sides: the node's vLLM, Inductor and Triton caches emptied "
            f"before every run; offline then ours; ratios ours / offline of the same round):",
            "",
            "| round | offline whole s | ours whole s | e2e ratio | offline busy s | ours busy s | busy ratio | "
            "first answer offline / ours s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for e in r["per_round"]:
            if not e["counted"]:
                lines.append(f"| {e['round']} | {e['why_not']} | | | | | | |")
                continue
            lines.append(
                f"| {e['round']}{'' if e.get('cold') is not False else ' (warm!)'} | {_f(e['offline_whole_s'], '{:.1f}')} | "
                f"{_f(e['ours_whole_s'], '{:.1f}')} | {_f(e['e2e_ratio'], '{:.3f}')} | {_f(e['offline_busy_s'], '{:.1f}')} | "
                f"{_f(e['ours_busy_s'], '{:.1f}')} | {_f(e['busy_ratio'], '{:.3f}')} | "
                f"{_f(e['offline_first_token_s'], '{:.1f}')} / {_f(e['first_token_s'], '{:.1f}')} |"
            )
        for stat in ("median", "min", "max"):
            lines.append(
                f"| **{stat}** | {_f(r['offline_whole_s'][stat], '{:.1f}')} | {_f(r['ours_whole_s'][stat], '{:.1f}')} | "
                f"**{_f(r['e2e_ratio'][stat], '{:.3f}')}** | {_f(r['offline_busy_s'][stat], '{:.1f}')} | "
                f"{_f(r['ours_busy_s'][stat], '{:.1f}')} | {_f(r['busy_ratio'][stat], '{:.3f}')} | "
                f"{_f(r['offline_first_token_s'][stat], '{:.1f}')} / {_f(r['first_token_s'][stat], '{:.1f}')} |"
            )
        lines.append(
            f"\n(min and max of each column are taken over the rounds on their own, not from one round; "
            f"rounds counted: {r['rounds_counted']} of {r['rounds_run']})"
        )
    left = {k: v for k, v in s.get("gpu_after_phase", {}).items() if v.get("leftover_apps")}
    lines += [
        "",
        "After every phase the GPU was checked for processes left behind: "
        + (
            "none held memory."
            if not left
            else "left behind: "
            + ", ".join(f"{k} ({v['leftover_apps']} process(es), killed)" for k, v in left.items())
            + "."
        ),
    ]
    if s.get("notable"):
        lines += ["", "vLLM said:"] + [f"- `{n}`" for n in s["notable"][:6]]
    return "\n".join(lines) + "\n"


def _workload(s: dict) -> str:
    off = s.get("offline") or {}
    w = s.get("workload") or {}
    return (
        f"{_f(off.get('n_prompts') or w.get('N'))} prompts of ~{_f(off.get('avg_prompt_tokens'))} tokens "
        f"(chat template included), 256 tokens out each (ignore_eos, greedy), an 8B-shaped Llama with random "
        f"weights (load_format=dummy), bf16, max_model_len 2048, gpu_memory_utilization 0.9"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--date")
    ap.add_argument("--dir")
    ap.add_argument("--price-per-hour", type=float, default=3.50, help="USD per H200 GPU-hour (default 3.50)")
    ap.add_argument("--out", help="default benchmarks/results/<date>-gpu.json")
    args = ap.parse_args()
    src = find_dir(args)
    summary = summarize(src, args.price_per_hour)
    out = Path(args.out) if args.out else RESULTS / f"{src.name}.json"
    out.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print(f"<!-- wrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out} -->\n")
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
