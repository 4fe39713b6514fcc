"""Shared by the device-side scripts of benchmarks/gpu (standard library only at import time).

State lives in $GPUW (default /tmp/gpu) so that a later call on the same warm machine continues:
results.json (every phase's result, merged), gpu.csv (nvidia-smi samples, one row a second, with the
phase), logs/ (phase and job logs). go.sh copies them to $OUT at the end of every call.

Also a small CLI for go.sh:
    python3 common.py gpu-clean PHASE          kill leftover GPU processes, record GPU memory after PHASE
    python3 common.py vllm-log PHASE LOGFILE   merge vLLM's start-up lines from LOGFILE into PHASE's result
    python3 common.py phase-status PHASE STATUS SECONDS
    python3 common.py note PHASE TEXT...
    python3 common.py phase-process PHASE T0 T1   the phase's process window (epoch seconds, go.sh's clock)
    python3 common.py merge-file PHASE KEY FILE   a JSON file into PHASE's result under KEY (if it exists)
    python3 common.py merge-obj PHASE JSON        a JSON object's keys into PHASE's result
    python3 common.py expand-rounds N PHASE...    the phases with ROUNDS=N's round phases (see expand_rounds)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

W = os.environ.get("GPUW", "/tmp/gpu")
RESULTS = os.path.join(W, "results.json")
GPU_CSV = os.path.join(W, "gpu.csv")
LOGS = os.path.join(W, "logs")

# The workload: N prompts of about IN_TOKENS tokens each, MAX_TOKENS generated with ignore_eos.
N_PROMPTS = 2048
IN_TOKENS = 200
MAX_TOKENS = 256

WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima "
    "mike november oscar papa quebec romeo sierra tango uniform victor whiskey "
    "xray yankee zulu river mountain forest ocean desert valley canyon island "
    "harbor village castle bridge tower garden market library museum theater "
    "engine signal vector matrix tensor kernel buffer socket thread process"
).split()


def make_prompts(tokenizer_dir: str, n: int = N_PROMPTS, target: int = IN_TOKENS) -> tuple[list[str], float]:
    """n distinct texts of `target` tokens (by the model's tokenizer); the same for offline and our job."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts, lens = [], []
    for i in range(n):
        words = [WORDS[(i * 7 + j * 13 + (i * j) % 11) % len(WORDS)] for j in range(target + 60)]
        text = f"Request {i}: summarize the following list. " + " ".join(words)
        ids = tok(text, add_special_tokens=False)["input_ids"][:target]
        text = tok.decode(ids)
        prompts.append(text)
        lens.append(len(tok(text, add_special_tokens=False)["input_ids"]))
    return prompts, sum(lens) / len(lens)


# --- results.json --------------------------------------------------------------------------------------------
def load_results() -> dict[str, Any]:
    try:
        with open(RESULTS) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"format": 1, "phases": {}, "gpu_after_phase": {}, "calls": []}


def save_results(data: dict[str, Any]) -> None:
    os.makedirs(W, exist_ok=True)
    tmp = RESULTS + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, RESULTS)


def merge_phase(phase: str, obj: dict[str, Any]) -> None:
    """Put (or update) one phase's result; a later run of the same phase replaces the earlier one's keys."""
    data = load_results()
    current = data["phases"].get(phase) or {}
    current.update(obj)
    data["phases"][phase] = current
    save_results(data)


def merge_top(key: str, obj: Any) -> None:
    data = load_results()
    data[key] = obj
    save_results(data)


# --- GPU ----------------------------------------------------------------------------------------------------
def nvsmi(*args: str, timeout: float = 20) -> str:
    r = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=timeout)
    return r.stdout


def gpu_used_mib() -> int | None:
    try:
        return sum(int(x) for x in nvsmi("--query-gpu=memory.used", "--format=csv,noheader,nounits").split())
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def gpu_apps() -> list[dict[str, Any]]:
    """Processes holding GPU memory (pid, used MiB, command)."""
    try:
        out = nvsmi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
    except (OSError, subprocess.SubprocessError):
        return []
    apps = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if not parts or not parts[0].isdigit():
            continue
        pid = int(parts[0])
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
        except OSError:
            cmd = "?"
        apps.append(
            {"pid": pid, "used_mib": int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None, "cmd": cmd}
        )
    return apps


def wait_gpu_free(timeout: float = 60, limit_mib: int = 2000, exclude: tuple[int, ...] = ()) -> dict[str, Any]:
    """Wait until no process (but those in exclude) holds the GPU and memory falls under limit_mib;
    say what is still there."""
    t0 = time.time()

    def others() -> list[dict[str, Any]]:
        return [a for a in gpu_apps() if a["pid"] not in exclude]

    apps, used = others(), gpu_used_mib()
    while (apps or (used or 0) >= limit_mib) and time.time() - t0 < timeout:
        time.sleep(2)
        apps, used = others(), gpu_used_mib()
    return {"waited_s": round(time.time() - t0, 1), "gpu_used_mib": used, "leftover_apps": apps}


def kill_gpu_apps(apps: list[dict[str, Any]]) -> list[int]:
    killed = []
    for app in apps:
        try:
            os.kill(app["pid"], signal.SIGTERM)
            killed.append(app["pid"])
        except OSError:
            pass
    if killed:
        time.sleep(5)
        for pid in killed:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(2)
    return killed


class GpuMon:
    """nvidia-smi sampling every second (memory used MiB, utilization %, power W) in a background
    process; rows are appended to gpu.csv with the phase name and kept here for summaries."""

    FIELDS = "memory.used,utilization.gpu,power.draw"

    def __init__(self, phase: str, interval_ms: int = 1000):
        self.phase = phase
        self.samples: list[tuple[float, int, int, float]] = []
        os.makedirs(W, exist_ok=True)
        new = not os.path.exists(GPU_CSV)
        self.csv = open(GPU_CSV, "a")
        if new:
            self.csv.write("phase,time,mem_used_mib,util_pct,power_w\n")
        try:
            self.proc: subprocess.Popen | None = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={self.FIELDS}", "--format=csv,noheader,nounits", "-lms", str(interval_ms)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        except OSError:  # no nvidia-smi (a dry run on a CPU machine)
            self.proc = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        if self.proc is None or self.proc.stdout is None:
            return
        for line in self.proc.stdout:
            try:
                mem, util, power = [p.strip() for p in line.split(",")[:3]]
                row = (time.time(), int(mem), int(util), float(power) if power not in ("[N/A]", "") else -1.0)
            except ValueError:
                continue
            self.samples.append(row)
            self.csv.write(f"{self.phase},{row[0]:.1f},{row[1]},{row[2]},{row[3]:.0f}\n")
            self.csv.flush()

    def stop(self) -> dict[str, Any]:
        if self.proc is not None:
            try:
                self.proc.terminate()
                self.proc.wait(timeout=5)
            except Exception:
                self.proc.kill()
        self.thread.join(timeout=2)
        self.csv.close()
        return self.summary()

    def summary(self, a: float | None = None, b: float | None = None) -> dict[str, Any]:
        xs = [s for s in self.samples if (a is None or s[0] >= a) and (b is None or s[0] <= b)]
        if not xs:
            return {"samples": 0}
        return {
            "samples": len(xs),
            "mem_used_max_mib": max(s[1] for s in xs),
            "util_mean_pct": round(sum(s[2] for s in xs) / len(xs), 1),
            "util_busy_share": round(sum(1 for s in xs if s[2] > 0) / len(xs), 3),
            "power_mean_w": round(sum(s[3] for s in xs) / len(xs), 1),
        }


# --- vLLM's start-up lines --------------------------------------------------------------------------------
_NUM = r"([\d.,]+)"
VLLM_LINES = {
    # name: (regex, how to combine several matches: "sum" | "first" | "last" | "max" | "count")
    "dynamo_transform_s": (r"Dynamo bytecode transform time: " + _NUM + r" s", "sum"),
    "graph_compile_s": (r"Compiling a graph for compile range .*? takes " + _NUM + r" s", "sum"),
    "compiled_graph_cache_hits": (r"Directly load the compiled graph", "count"),
    "torch_compile_total_s": (r"torch\.compile took " + _NUM + r" s in total", "sum"),
    "weights_load_s": (r"Loading weights took " + _NUM + r" seconds", "sum"),
    "model_load_gib": (r"Model loading took " + _NUM + r" GiB", "max"),
    "model_load_s": (r"Model loading took [\d.,]+ GiB(?: memory)? and " + _NUM + r" seconds", "sum"),
    "memory_profiling_s": (r"Memory profiling takes " + _NUM + r" seconds", "sum"),
    "kv_cache_gib": (r"Available KV cache memory: " + _NUM + r" GiB", "max"),
    "kv_cache_tokens": (r"[GC]PU KV cache size: " + _NUM + r" tokens", "max"),
    "max_concurrency_x": (r"Maximum concurrency for [\d,]+ tokens per request: " + _NUM + r"x", "max"),
    "cuda_graph_capture_s": (r"Graph capturing finished in " + _NUM + r" secs", "sum"),
    "cuda_graph_gib": (r"Graph capturing finished in [\d.]+ secs, took " + _NUM + r" GiB", "max"),
    "init_engine_s": (
        r"init engine \(profile, create kv cache, warmup model\) took " + _NUM + r" (?:s|seconds)",
        "sum",
    ),
    "init_engine_compile_s": (r"init engine .*? took [\d.]+ s \(compilation: " + _NUM + r" s", "sum"),
    "engines_started": (r"init engine \(profile, create kv cache, warmup model\) took", "count"),
    "gen_throughput_samples": (r"Avg generation throughput: " + _NUM + r" tokens/s", "count"),
    "gen_throughput_max": (r"Avg generation throughput: " + _NUM + r" tokens/s", "max"),
    "running_reqs_max": (r"Avg generation throughput: [\d.]+ tokens/s, Running: " + _NUM + r" reqs", "max"),
    "warnings": (r"(?:WARNING|Warning)", "count"),
    "errors": (r"(?:\bERROR\b|Traceback \(most recent call last\))", "count"),
}
NOTABLE = re.compile(
    r"(does not officially support|may cause the engine to crash|out of memory|OutOfMemory|Free memory on device"
    r"|CUDA error|RuntimeError|Unauthorized|No module named|ImportError|FA3|FlashAttention|attention backend"
    r"|Using .*backend|max_num_seqs|max_num_batched_tokens|chunked prefill|prefix caching)",
    re.I,
)


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_vllm_log(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (pattern, how) in VLLM_LINES.items():
        found = re.findall(pattern, text)
        if how == "count":
            out[name] = len(found)
            continue
        vals = []
        for v in found:
            try:
                vals.append(float(str(v).replace(",", "")))
            except ValueError:
                pass
        if not vals:
            out[name] = None
        elif how == "sum":
            out[name] = round(sum(vals), 3)
        elif how == "max":
            out[name] = max(vals)
        elif how == "first":
            out[name] = vals[0]
        else:
            out[name] = vals[-1]
    notable, seen = [], set()
    for line in ANSI.sub("", text).splitlines():
        if NOTABLE.search(line) and "RAYLLM_" not in line:
            key = re.sub(r"\d+", "#", line[-200:])
            if key not in seen:
                seen.add(key)
                notable.append(line[-300:])
    out["notable_lines"] = notable[:40]
    return out


def trim_text(text: str, head: int = 300, tail: int = 1200) -> str:
    lines = text.splitlines()
    if len(lines) <= head + tail:
        return text
    return "\n".join(lines[:head] + [f"... [{len(lines) - head - tail} lines cut] ..."] + lines[-tail:]) + "\n"


# --- the prefix phase's figures --------------------------------------------------------------------------------
PREFIX_SIDES = {"grouped": "prefix_grouped", "window0": "prefix_window0"}


def prefix_side(r: dict[str, Any]) -> dict[str, Any]:
    """One side's figures: job wall from Ray's job record (submitted -> terminal), answering from the engine
    actor's constructor end (Ray's task record; else the driver's mark) to the last answered row."""
    w = r.get("windows") or {}
    wall = w["ended"] - w["submitted"] if w.get("ended") and w.get("submitted") else r.get("wall_s")
    answering = w["last_answer"] - w["engine_ready"] if w.get("last_answer") and w.get("engine_ready") else None
    tokens_in, hits = r.get("input_tokens") or 0, r.get("prefix_cache_hit_rate_logged_pct") or []
    return {
        "status": r.get("status"),
        "rows": r.get("rows_out"),
        "input_tokens": tokens_in,
        "output_tokens": r.get("output_tokens"),
        "job_wall_s": wall,
        "answering_s": answering,
        "answering_from": w.get("engine_ready_from"),
        "prompt_tokens_per_s": tokens_in / answering if answering and tokens_in else None,
        "prompt_tokens_per_s_wall": tokens_in / wall if wall and tokens_in else None,
        "prefix_cache_hit_rate_last_pct": hits[-1] if hits else None,
        "prefix_cache_hit_rate_max_pct": max(hits) if hits else None,
        "kv_cache_tokens": (r.get("vllm_log") or {}).get("kv_cache_tokens"),
        "init_engine_s": (r.get("vllm_log") or {}).get("init_engine_s"),
        "torch_compile_s": (r.get("vllm_log") or {}).get("torch_compile_total_s"),
        "prefix_grouping_lines": r.get("prefix_grouping_lines"),
    }


def prefix_summary(phases: dict[str, Any]) -> dict[str, Any]:
    sides = {name: prefix_side(phases[p]) for name, p in PREFIX_SIDES.items() if p in phases}
    submitted = {
        n: (phases[p].get("windows") or {}).get("submitted") or 0 for n, p in PREFIX_SIDES.items() if p in phases
    }
    out: dict[str, Any] = {"sides": sides, "order": sorted(submitted, key=submitted.__getitem__)}
    if len(sides) == 2 and all(s["status"] == "SUCCEEDED" for s in sides.values()):
        g, o = sides["grouped"], sides["window0"]
        out["ratio_grouped_over_window0"] = {
            "prompt_tokens_per_s": g["prompt_tokens_per_s"] / o["prompt_tokens_per_s"]
            if g["prompt_tokens_per_s"] and o["prompt_tokens_per_s"]
            else None,
            "job_wall_s": o["job_wall_s"] / g["job_wall_s"] if g["job_wall_s"] and o["job_wall_s"] else None,
        }
    return out


# --- rounds (go.sh's ROUNDS) -----------------------------------------------------------------------------------
# The end-to-end comparison's pairs: each round runs the offline side, then ours (in the order PHASES gives).
ROUND_PAIRS = (("offline", "ourjob_gen"), ("offline_embed", "ourjob_embed"))
# go.sh's ROUNDS: each pair's phases run again as <phase>_r<n> (report.py reads them back by this name).
ROUND_PHASE = re.compile(rf"^({'|'.join(p for pair in ROUND_PAIRS for p in pair)})_r(\d+)$")


def expand_rounds(rounds: int, phases: list[str]) -> list[str]:
    """PHASES with each comparison pair's phases run `rounds` times, interleaved round by round:
    ["head", "offline", "ourjob_gen"], 2 -> ["head", "offline_r1", "ourjob_gen_r1", "offline_r2", "ourjob_gen_r2"].
    A pair's rounds take the place of its first phase in PHASES; a pair named in part runs that part alone."""
    if rounds < 1:
        raise ValueError(f"rounds must be 1 or more, not {rounds}")
    out: list[str] = []
    done: set[str] = set()
    for phase in phases:
        pair = next((p for p in ROUND_PAIRS if phase in p), None)
        if pair is None:
            if phase not in out:
                out.append(phase)
            continue
        if phase in done:
            continue
        members = [p for p in phases if p in pair]
        members = [p for i, p in enumerate(members) if p not in members[:i]]
        done.update(members)
        out += [f"{p}_r{r}" for r in range(1, rounds + 1) for p in members]
    return out


# --- CLI for go.sh --------------------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else ""
    if cmd == "gpu-clean":
        phase = argv[1]
        state = wait_gpu_free(timeout=float(os.environ.get("GPU_CLEAN_WAIT_S", "20")))
        killed = kill_gpu_apps(state["leftover_apps"]) if state["leftover_apps"] else []
        after = {
            "gpu_used_mib_before_kill": state["gpu_used_mib"],
            "leftover_apps": state["leftover_apps"],
            "killed": killed,
            "gpu_used_mib": gpu_used_mib(),
            "at": time.time(),
        }
        data = load_results()
        data.setdefault("gpu_after_phase", {})[phase] = after
        save_results(data)
        for app in state["leftover_apps"]:
            print(
                f"== leftover GPU process after {phase}: pid {app['pid']} {app['used_mib']} MiB {app['cmd']}",
                flush=True,
            )
        print(
            f"== GPU memory used after {phase}: {after['gpu_used_mib']} MiB"
            + (f" (killed {killed})" if killed else ""),
            flush=True,
        )
        return 0
    if cmd == "vllm-log":
        phase, path = argv[1], argv[2]
        try:
            with open(path, errors="replace") as f:
                text = f.read()
        except OSError:
            return 0
        merge_phase(phase, {"vllm_log": parse_vllm_log(text)})
        return 0
    if cmd == "note":
        merge_phase(argv[1], {"note": " ".join(argv[2:])})
        return 0
    if cmd == "phase-process":
        merge_phase(argv[1], {"process_window": [float(argv[2]), float(argv[3])]})
        return 0
    if cmd == "merge-file":
        try:
            with open(argv[3]) as f:
                merge_phase(argv[1], {argv[2]: json.load(f)})
        except (OSError, ValueError):
            pass
        return 0
    if cmd == "merge-obj":
        merge_phase(argv[1], json.loads(argv[2]))
        return 0
    if cmd == "expand-rounds":
        try:
            print(" ".join(expand_rounds(int(argv[1]), argv[2:])))
        except ValueError as e:
            print(e, file=sys.stderr)
            return 2
        return 0
    if cmd == "prefix-summary":  # the prefix phase: grouped against window 0, from the two jobs' entries
        merge_phase("prefix", prefix_summary(load_results()["phases"]))
        print(f"RESULT_PREFIX {json.dumps(load_results()['phases']['prefix'].get('ratio_grouped_over_window0'))}")
        return 0
    if cmd == "phase-status":
        phase, status, seconds = argv[1], argv[2], float(argv[3])
        merge_phase(phase, {"phase_status": status, "phase_wall_s": seconds, "finished_at": time.time()})
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
