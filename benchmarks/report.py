"""Merge the benchmarks' result files into benchmarks/results/<date>.json and write docs/PERFORMANCE.md.

    python benchmarks/report.py [--date YYYY-MM-DD]

Reads the newest (or the given date's) <date>-http.json, <date>-engine.json, <date>-scale.json and
<date>-load.json; a part that was not run is named as missing in the report rather than left out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
IMG = REPO / "docs" / "img"
PARTS = ("http", "engine", "scale", "load")

# H200 SXM, NVIDIA's data sheet: 141 GB HBM3e at 4.8 TB/s; 989 TFLOPS dense BF16 (1,979 with sparsity).
H200 = {"hbm_gb": 141, "hbm_tb_per_s": 4.8, "bf16_dense_tflops": 989}
# An 8B model in bf16 (Llama-3.1-8B shape: 32 layers, 8 KV heads of 128, GQA).
MODEL_8B = {"params_b": 8.03, "bytes_per_param": 2, "layers": 32, "kv_heads": 8, "head_dim": 128}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _part_files(part: str) -> list[Path]:
    return sorted(RESULTS.glob(f"20??-??-??-{part}.json"))


def latest_date() -> str:
    dates = sorted({p.name[:10] for part in PARTS for p in _part_files(part)})
    if not dates:
        raise SystemExit("no benchmark results yet: run `make bench`")
    return dates[-1]


def load_parts(day: str) -> dict[str, dict]:
    """Each part's newest result on or before ``day``: a bench run of one part keeps the others' figures
    (each section says its date)."""
    parts = {}
    for part in PARTS:
        found = [p for p in _part_files(part) if p.name[:10] <= day]
        if found:
            parts[part] = json.loads(found[-1].read_text())
            parts[part].setdefault("date", found[-1].name[:10])
    return parts


def gpu_projection() -> dict:
    weights_gb = MODEL_8B["params_b"] * MODEL_8B["bytes_per_param"]
    flops_per_token = 2 * MODEL_8B["params_b"] * 1e9
    kv_bytes_per_token = 2 * MODEL_8B["layers"] * MODEL_8B["kv_heads"] * MODEL_8B["head_dim"] * 2
    decode_steps_per_s = H200["hbm_tb_per_s"] * 1e12 / (weights_gb * 1e9)  # weights read once per step
    compute_tokens_per_s = H200["bf16_dense_tflops"] * 1e12 / flops_per_token
    kv_budget_gb = H200["hbm_gb"] * 0.9 - weights_gb
    return {
        "weights_gb": round(weights_gb, 1),
        "kv_cache_kb_per_token": round(kv_bytes_per_token / 1024, 1),
        "kv_cache_budget_gb_at_0.9": round(kv_budget_gb, 1),
        "kv_cache_tokens": int(kv_budget_gb * 1e9 / kv_bytes_per_token),
        "memory_bound_decode_steps_per_s": round(decode_steps_per_s),
        "compute_bound_tokens_per_s": round(compute_tokens_per_s),
        "batch_where_compute_binds": round(compute_tokens_per_s / decode_steps_per_s),
    }


def plot_engine(engine: dict) -> None:
    """Left: each Ray job's duration, ours against the plain script (and ours with Ray's separate tokenize and
    detokenize stages); right: steady-state output tokens/s against vLLM's offline path."""
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.4))

    def bars(ax, series, xlabel):
        series = [(n, v, c) for n, v, c in series if v]
        names = [n for n, _, _ in series]
        meds = [v["median"] for _, v, _ in series]
        errs = [
            [m - v["min"] for m, (_, v, _) in zip(meds, series)],
            [v["max"] - m for m, (_, v, _) in zip(meds, series)],
        ]
        ax.barh(names, meds, xerr=errs, color=[c for _, _, c in series], capsize=4)
        ax.set_xlabel(xlabel)

    bars(
        ax1,
        [
            ("VLLMBatchOperator's job", engine["ours_job_s"], "#2b6cb0"),
            ("plain ray.data.llm script", engine["plain_job_s"], "#718096"),
            ("ours + tokenize/detokenize stages", engine.get("ours_stages_job_s"), "#a0aec0"),
            ("ours, worker in its own process", engine.get("ours_mp_job_s"), "#cbd5e0"),
        ],
        "Ray job seconds, Jobs API start to end (median, min-max)",
    )
    ax1.set_title(
        f"{engine['rows']} rows x {engine['max_tokens']} tokens: overhead {engine['provider_overhead_ratio']:.2f}x"
    )
    steady = engine["steady_tokens_per_s"]
    bars(
        ax2,
        [
            ("ours, engine ready -> last answer", steady["ours"], "#2b6cb0"),
            ("ours + tokenize/detokenize stages", steady.get("ours_stages"), "#a0aec0"),
            ("ours, worker in its own process", steady.get("ours_mp"), "#cbd5e0"),
            ("vLLM LLM.chat offline", engine["offline_tokens_per_s"], "#718096"),
        ],
        "output tokens per second (median, min-max)",
    )
    ratio = engine["engine_efficiency_ratio"]
    ax2.set_title("engine efficiency " + ("not measured" if ratio is None else f"{ratio:.2f}x"))
    fig.tight_layout()
    IMG.mkdir(parents=True, exist_ok=True)
    fig.savefig(IMG / "engine_overhead.png", dpi=120)


def plot_http(http: dict) -> None:
    plt = _plt()
    panels = [(part, http[part]) for part in ("caller", "e2e") if http.get(part)]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.0), squeeze=False)
    titles = {"caller": "one caller, instant local endpoint", "e2e": "whole job, local vLLM server"}
    for ax, (part, figures) in zip(axes[0], panels):
        methods = [m for m in ("ours_steady", "ours", "asyncio") if m in figures["rows_per_s"]]
        labels = {"ours_steady": "HttpCaller, actor up", "ours": "ours, start included", "asyncio": "bare asyncio"}
        spreads = [figures["rows_per_s"][m] for m in methods]
        medians = [s["median"] for s in spreads]
        errors = [[m - s["min"] for m, s in zip(medians, spreads)], [s["max"] - m for m, s in zip(medians, spreads)]]
        ax.barh([labels[m] for m in methods], medians, xerr=errors, color="#2b6cb0", capsize=4)
        ax.set_xlabel("rows/s (median, min-max over rounds)")
        ax.set_title(f"{titles[part]}: {figures['rows']:,} rows")
        for i, m in enumerate(medians):
            ax.text(m, i, f" {m:.0f}", va="center")
    fig.tight_layout()
    IMG.mkdir(parents=True, exist_ok=True)
    fig.savefig(IMG / "http_throughput.png", dpi=120)


def _share_of_job(point: dict, key: str) -> tuple[list[float], list[float]]:
    """A series of (seconds since the job's start, value), with time as a share (%) of that job's length."""
    job_s = point["job_s"]
    kept = [(t, v) for t, v in point[key] if 0 <= t <= job_s]
    return [t / job_s * 100 for t, _ in kept], [v for _, v in kept]


def plot_scale(scale: dict) -> None:
    plt = _plt()
    points = scale["scale"]
    rows = [p["rows"] for p in points]
    series = [p for p in points if p.get("object_store_series")]
    files = [p for p in points if p.get("output_files_series")]
    panels = 2 + bool(series) + bool(files)
    grid = (2, 2) if panels > 2 else (1, 2)
    fig, axes = plt.subplots(*grid, figsize=(11, 3.3 * grid[0]), squeeze=False)
    axes = list(axes.flat)
    for unused in axes[panels:]:
        unused.set_visible(False)
    ax1, ax2 = axes[0], axes[1]
    ax1.plot(rows, [p["rows_per_s"] for p in points], marker="o", color="#2b6cb0")
    ax1.set_xscale("log")
    ax1.set_ylim(bottom=0)
    ax1.set_xlabel("rows")
    ax1.set_ylabel("rows per second")
    ax1.set_title("throughput by job size")
    ax2.plot(rows, [p["driver_peak_mb"] for p in points], marker="o", label="Ray job driver", color="#2b6cb0")
    ax2.plot(rows, [p["worker_peak_mb"] for p in points], marker="s", label="Airflow worker (task)", color="#c05621")
    ax2.set_xscale("log")
    ax2.set_ylim(bottom=0)
    ax2.set_xlabel("rows")
    ax2.set_ylabel("peak RSS, MB")
    ax2.legend(fontsize=8)
    ax2.set_title("memory by job size")
    # Each job's own time axis, as a share of that job: a streaming job's lines look alike whatever its size.
    extra = iter(axes[2:])
    if series:
        # A job that held its input would climb with it; a streaming one stays in one band.
        ax = next(extra)
        for p in series:
            xs, ys = _share_of_job(p, "object_store_series")
            ax.step(xs, ys, where="post", label=f"{p['rows']:,} rows ({p['job_s']:.0f} s)")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("share of the job's time, %")
        ax.set_ylabel("object store in use, MB")
        ax.legend(fontsize=8)
        ax.set_title("object store over each job (Ray's metric)")
    if files:
        # Output files on disk while the job runs, as a share of the files it ends with: a job that wrote
        # only at its end would stay at 0 until 100 % of its time; a streaming one follows the diagonal.
        ax = next(extra)
        for p in files:
            xs, counts = _share_of_job(p, "output_files_series")
            final = max(counts[-1], 1) if counts else 1
            ax.step(xs, [c / final * 100 for c in counts], where="post", label=f"{p['rows']:,} rows")
        ax.plot([0, 100], [0, 100], color="#999999", linewidth=0.8, linestyle="--", label="even pace")
        ax.set_xlim(0, 100)
        ax.set_ylim(0, 105)
        ax.set_xlabel("share of the job's time, %")
        ax.set_ylabel("output files written, % of the job's")
        ax.legend(fontsize=8)
        ax.set_title("outputs appear while each job runs")
    fig.tight_layout()
    IMG.mkdir(parents=True, exist_ok=True)
    fig.savefig(IMG / "scale.png", dpi=120)


def _missing(part: str) -> str:
    return f"_Not measured in this run: `benchmarks/results/<date>-{part}.json` is missing (run `make bench`)._\n"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _samples(spread: dict | None, digits: int = 3) -> str:
    return "-" if not spread else ", ".join(f"{v:.{digits}f}" for v in spread["samples"])


def _timeline_table(e: dict) -> str:
    """Our job's steps, seconds from its driver's start (medians over the rounds, from the manifest and the log)."""
    t = e.get("timeline_median_s") or {}
    rows = [
        ("the plan started (checks passed, rows about to stream)", "plan_started_s"),
        ("the engine ready (vLLM's `init engine` line)", "engine_init_s"),
        ("the first answer", "first_answer_s"),
        ("the first output file written", "first_output_file_s"),
        ("the last answer", "last_answer_s"),
    ]
    table = "\n".join(f"| {label} | {_fmt(t.get(key))} |" for label, key in rows)
    plain = e.get("plain_engine_ready_s")
    return f"""Our job step by step, seconds from its driver's start (medians):

| step | seconds |
|---|---|
{table}

The plain script's engine was ready {_fmt(plain)} s after its job started (the same vLLM line).
"""


def _occupancy_text(e: dict) -> str:
    occ = e.get("engine_occupancy") or {}
    ours, plain = occ.get("ours") or {}, occ.get("plain") or {}
    if ours.get("mean_running") is None:
        return ""
    feed = e["resolved"]["feed"]
    allowed = feed["batch_size"] * feed["max_concurrent_batches"]
    seqs = e["resolved"]["engine_kwargs"].get("max_num_seqs", "vLLM's default")
    plain_text = (
        f"; the plain script's engine {plain['mean_running']:.0f} (peak {plain['max_running']})"
        if plain.get("mean_running") is not None
        else ""
    )
    return (
        f"While generating, our engine ran **{ours['mean_running']:.0f} requests at once** on average (peak "
        f"{ours['max_running']}; vLLM's stats lines in the job log){plain_text}, with {allowed} rows allowed in "
        f"flight (`batch_size` x `max_concurrent_batches`) and `max_num_seqs` {seqs}.\n"
    )


# The provider-overhead target is judged on a median of at least this many interleaved rounds.
OVERHEAD_ROUNDS = 5


def _overhead_rounds(shown: dict) -> str:
    """When the engine run shown below has fewer rounds than the target asks, the newest engine result
    (any engine file, e.g. <date>-engine-rayjob.json) that has them, quoted first."""
    if shown["rounds"] >= OVERHEAD_ROUNDS:
        return ""
    for path in sorted(RESULTS.glob("20??-??-??-engine*.json"), reverse=True):
        e = json.loads(path.read_text())
        if e.get("rounds", 0) >= OVERHEAD_ROUNDS and e.get("provider_overhead"):
            return f"""
**Provider overhead over {e["rounds"]} interleaved rounds: {e["provider_overhead_ratio"]:.2f}x** (target <= 1.05x;
rounds {_samples(e["provider_overhead"], 2)}), from `{path.relative_to(REPO)}` ({e["rows"]} prompts,
{e["max_tokens"]} output tokens each): our Ray job over the plain script's, Ray job against Ray job. The whole
operator over the plain job: median {e["operator_overhead"]["median"]:.2f}x. The run below has {shown["rounds"]} rounds.
"""
    return ""


def engine_section(e: dict | None) -> str:
    if e is None:
        return "## Provider overhead and engine efficiency\n\n" + _missing("engine")
    resolved = e["resolved"]
    steady, offline = e["steady_tokens_per_s"], e["offline_tokens_per_s"]
    ratio = e["engine_efficiency_ratio"]
    if ratio is None:
        efficiency = (
            "**Engine efficiency: not measured in this run** (no round had an engine-ready to last-answer window)."
        )
    else:
        efficiency = (
            f"**Engine efficiency: {ratio:.2f}x** (target >= 0.85x; rounds {_samples(e['engine_efficiency'], 2)}): "
            f"our steady-state output tokens/s, from vLLM's `init engine` line in our job's log to the last answer, "
            f"median **{steady['ours']['median']:.0f}**, over vLLM's own `LLM.chat` over the same prompts and engine "
            f"settings after a warm-up, median **{offline['median']:.0f}** tokens/s."
        )
    ab = ""
    if e.get("ours_stages_job_s"):
        stages = steady.get("ours_stages")
        ab = (
            f"\n**Ray's separate tokenize and detokenize stages** (the A/B of folding them into the engine, "
            f"{len(e['ours_stages_job_s']['samples'])} round(s)): our job with them took "
            f"{e['ours_stages_job_s']['median']:.1f} s against {e['ours_job_s']['median']:.1f} s without"
            + (f", {stages['median']:.0f} against {steady['ours']['median']:.0f} steady tokens/s" if stages else "")
            + ". The default leaves them off: vLLM's engine tokenizes and detokenizes itself.\n"
        )
    if e.get("ours_mp_job_s"):
        mp = steady.get("ours_mp")
        ab += (
            f"\n**One process for the CPU engine's worker** ({len(e['ours_mp_job_s']['samples'])} round(s)): with "
            f"vLLM's own layout (the worker a process of its own, `VLLM_ENABLE_V1_MULTIPROCESSING=1`) our job took "
            f"{e['ours_mp_job_s']['median']:.1f} s against {e['ours_job_s']['median']:.1f} s with the worker inside "
            "the engine core (the default)"
            + (f", {mp['median']:.0f} against {steady['ours']['median']:.0f} steady tokens/s" if mp else "")
            + ".\n"
        )
    command = e.get("command", "benchmarks/engine_bench.py")
    return f"""## Provider overhead and engine efficiency (VLLMBatchOperator)
{_overhead_rounds(e)}

Run {e["date"]}: `{command}`. {e["rows"]} prompts, exactly {e["max_tokens"]} output tokens each (`ignore_eos`),
{e["model"]}, engine_kwargs `{json.dumps(resolved["engine_kwargs"])}`, batch_size {resolved["feed"]["batch_size"]} x
max_concurrent_batches {resolved["feed"]["max_concurrent_batches"]}; {e["rounds"]} interleaved rounds of our
operator, the same `ray.data.llm` pipeline as a plain script through the Jobs API (the engine and processor
settings our job resolved), and vLLM's offline `LLM.chat`.

![overhead and efficiency](img/engine_overhead.png)

**Provider overhead: {e["provider_overhead_ratio"]:.2f}x** (target <= 1.05x; rounds
{_samples(e["provider_overhead"])}): our Ray job's duration over the plain script's, both from the Jobs API's
start and end times (medians {e["ours_job_s"]["median"]:.1f} s and {e["plain_job_s"]["median"]:.1f} s). The whole
operator (task start to the manifest in hand, non-deferred) over the plain job: median
{e["operator_overhead"]["median"]:.2f}x.

{_timeline_table(e)}
{efficiency}

{_occupancy_text(e)}{ab}"""


def _rate(spread: dict) -> str:
    return f"{spread['median']:,.0f} (min {spread['min']:,.0f}, max {spread['max']:,.0f})"


def http_section(h: dict | None) -> str:
    if h is None or "includes" not in h:
        return "## HTTP path (HttpLLMBatchOperator)\n\n" + _missing("http")
    text = f"""## HTTP path (HttpLLMBatchOperator)

`{h["command"]}` ({h["date"]}): {h["rounds"]} interleaved rounds of each side; batch_size {h["batch_size"]},
{h["actors"]} caller actor, {h["in_flight"]} requests in flight, max_tokens {h["max_tokens"]}. Each caller actor keeps
several batches in flight on one event loop and one connection pool, so a slow row holds back only its own batch.

![throughput](img/http_throughput.png)
"""
    c, e = h.get("caller"), h.get("e2e")
    if c:
        r = c["rows_per_s"]
        text += f"""
**Per caller: {h["rows_per_s_per_caller"]:,.0f} rows/s** (target >= 5,000), {c["rows"]:,} rows against a local chat
endpoint that answers at once (the project's echo server; client and server share the 2 cores).

| side | what it includes | rows/s, median (min, max) |
|---|---|---|
| ours, actor up | {h["includes"]["caller_ours"]} | {_rate(r["ours_steady"])} |
| ours, start included | the same map, timed from its start | {_rate(r["ours"])} |
| bare asyncio client | {h["includes"]["caller_asyncio"]} | {_rate(r["asyncio"])} |

Ours over the bare client, paired by round: {c["ours_steady_over_asyncio"]["median"]:.2f}x once the actor is up,
{c["ours_over_asyncio"]["median"]:.2f}x with its start.
"""
    if e:
        text += f"""
**End to end: {h["e2e_ratio_vs_asyncio"]:.2f}x a bare asyncio client** (target >= 0.95x; rounds
{", ".join(f"{x:.2f}" for x in e["ratio"]["samples"])}), {e["rows"]:,} chat requests to vLLM's OpenAI-compatible
server (SmolLM2-135M on the CPU engine), both sides as Ray jobs on one local cluster.

| side | what it includes | seconds, median (min, max) | rows/s |
|---|---|---|---|
| ours | {h["includes"]["e2e_ours"]} | {e["seconds"]["ours"]["median"]:.1f} ({e["seconds"]["ours"]["min"]:.1f}, {e["seconds"]["ours"]["max"]:.1f}) | {e["rows_per_s"]["ours"]["median"]:.1f} |
| bare asyncio client | {h["includes"]["e2e_asyncio"]} | {e["seconds"]["asyncio"]["median"]:.1f} ({e["seconds"]["asyncio"]["min"]:.1f}, {e["seconds"]["asyncio"]["max"]:.1f}) | {e["rows_per_s"]["asyncio"]["median"]:.1f} |
"""
    return text


# (header, cell) per column of the scale table; the streamed columns only where a run measured them.
_SCALE_COLUMNS = [
    ("rows", lambda p: f"{p['rows']:,}", False),
    ("rows/s", lambda p: f"{p['rows_per_s']:.0f}", False),
    ("seconds", lambda p: f"{p['seconds']:.0f}", False),
    (
        "first output file (s after job start)",
        lambda p: "-" if p.get("first_output_s") is None else f"{p['first_output_s']:.1f}",
        True,
    ),
    ("object store peak MB", lambda p: f"{p['object_store_peak_mb']:.1f}", True),
    ("spilled MB", lambda p: f"{p['spilled_mb']:.0f}", True),
    ("driver peak MB", lambda p: f"{p['driver_peak_mb']:.0f}", False),
    ("Airflow worker peak MB", lambda p: f"{p['worker_peak_mb']:.0f}", False),
]


def _run_of(p: dict) -> str:
    run = p.get("run") or {}
    return " ".join(str(run[k]) for k in ("started", "commit") if run.get(k)) or "-"


def _scale_table(points: list[dict]) -> str:
    streamed = all("object_store_peak_mb" in p for p in points)
    columns = [(head, cell) for head, cell, needs_stream in _SCALE_COLUMNS if streamed or not needs_stream]
    if all(p.get("worker_processes") is not None for p in points):
        columns.append(("Ray worker processes started", lambda p: str(p["worker_processes"])))
    if any(p.get("run") for p in points):  # sizes from more than one run: say which run measured each
        columns.append(("run (start, commit)", _run_of))
    lines = ["| " + " | ".join(head for head, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(p) for _, cell in columns) + " |" for p in points]
    return "\n".join(lines)


def scale_section(s: dict | None) -> str:
    if s is None:
        return "## Scale\n\n" + _missing("scale")
    points = s["scale"]
    checks = s.get("checks") or {}
    verdicts = ""
    if checks:
        verdicts = (
            "\nAgainst the targets (smallest against largest size):\n\n"
            f"- spilled to disk: **{checks['spilled_mb_max']:.0f} MB** at most (target 0)\n"
            f"- object store peak, largest / smallest: **{checks['object_store_peak_ratio']:.2f}x** (target <= 1.25x)\n"
            f"- Ray driver peak, largest / smallest: **{checks['driver_peak_ratio']:.2f}x** (target <= 1.25x)\n"
            f"- first output file at **{checks['first_output_share_at_largest']:.1%}** of the largest job's time "
            "(target <= 10 %)\n"
        )
        if len(points) >= 3:
            # Ray Data keeps a window of blocks whose size is set by its object-store budget, not by the input:
            # once a job is large enough to fill it, the peak stays put. The two largest sizes show that.
            a, b = points[-2], points[-1]
            verdicts += (
                f"- object store peak, {b['rows']:,} / {a['rows']:,} rows: "
                f"**{b['object_store_peak_mb'] / max(a['object_store_peak_mb'], 1e-9):.2f}x**\n"
            )
        if "marginal_rate_change" in checks:
            verdicts += (
                f"- marginal rate of the last step against the first: **{checks['marginal_rate_change']:+.1%}** "
                "(target within 10 %)\n"
            )
    spread = [p["rows_per_s"] for p in points]
    legend = ""
    if any(p.get("object_store_series") for p in points) and any(p.get("output_files_series") for p in points):
        legend = (
            "\nTop: throughput and peak memory by size. Bottom, on each job's own time axis (a share of its "
            "length): the object store in use, and the output files on disk as a share of the job's last count. "
            "A job that held its input would climb on the bottom left, and stay at 0 on the bottom right until "
            "its end.\n"
        )
    return f"""## Scale (HTTP path, fast local endpoint; `make bench` of {s.get("date", "?")})

{s["description"]}

![scale](img/scale.png)
{legend}
{_scale_table(points)}

Throughput, slowest size against fastest: {min(spread) / max(spread):.0%}.
{verdicts}{_scale_fit(points)}{s.get("notes", "")}
"""


def _scale_fit(points: list[dict]) -> str:
    """Seconds = fixed + rows / rate, fitted by least squares: what a job costs before its first row, and per row."""
    if len(points) < 2:
        return ""
    xs, ys = [p["rows"] for p in points], [p["seconds"] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    fixed = my - slope * mx
    drv, wrk = [p["driver_peak_mb"] for p in points], [p["worker_peak_mb"] for p in points]
    marginal = [(b["rows"] - a["rows"]) / (b["seconds"] - a["seconds"]) for a, b in zip(points, points[1:])]
    flat = (
        f" The marginal rates are within {(max(marginal) - min(marginal)) / statistics.median(marginal):.0%} of each other."
        if len(marginal) > 1
        else ""
    )
    steps = "; ".join(
        f"{a['rows']:,} -> {b['rows']:,} rows: {(b['rows'] - a['rows']) / (b['seconds'] - a['seconds']):.0f} rows/s"
        for a, b in zip(points, points[1:])
    )
    if fixed >= 0:
        bound = f"""a job costs about **{fixed:.0f} s** whatever its size (submission, driver start,
actor start, the manifest) plus **{slope * 1e6:.0f} s per million rows** (a least-squares fit of seconds
against rows over the sizes above). The marginal rate between sizes ({steps}) is the pipeline's
own throughput; small jobs look slower only because the fixed part weighs more in them."""
    else:  # the smaller job ran at a lower rate than the larger: the fit has no fixed part to show
        bound = f"""**{slope * 1e6:.0f} s per million rows**; the smaller job ran at a lower rate than the
larger one, so a least-squares fit over the sizes above finds no fixed part. The marginal rate between sizes
({steps}) is the pipeline's own throughput."""
    return f"""
What bounds the spread: {bound}{flat} Peak memory across
a {xs[-1] / xs[0]:,.0f}x range of rows: Ray driver {min(drv):.0f}-{max(drv):.0f} MB, Airflow worker
{min(wrk):.0f}-{max(wrk):.0f} MB (rows stream through Ray's object store, not through either process).
"""


def gpu_measured() -> str:
    """Every run on a lent GPU (benchmarks/gpu/report.py wrote each ``<date>-gpu*.json``), as that script words
    it, each followed by its hand-written notes (``<same name>.md``) when there are any."""
    # by date, then a date's first hold (``-gpu``) before its later ones (``-gpu-<hold>``)
    runs = sorted(
        RESULTS.glob("20??-??-??-gpu*.json"), key=lambda p: (p.name[:10], p.stem != f"{p.name[:10]}-gpu", p.name)
    )
    if not runs:
        return ""
    import importlib.util

    # benchmarks/gpu/report.py shares this file's name: load it by path, not through sys.path
    spec = importlib.util.spec_from_file_location("gpu_report", REPO / "benchmarks" / "gpu" / "report.py")
    gpu_report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_report)
    sections = []
    for run in runs:
        text = gpu_report.markdown(json.loads(run.read_text()))
        hold = run.stem.split("-gpu", 1)[1].lstrip("-")
        if hold:  # a later machine hold of the same date: say which
            first, _, rest = text.partition("\n")
            text = f"{first.rstrip(')')}, {hold})\n{rest}"
        if "***" in text:
            text += (
                "\n\n`***` above is what that run's manifest showed: its redaction then took `max_num_batched_tokens` "
                "for a secret (fixed since; the value was 16,384, as the job log's engine line says)."
            )
        notes = run.with_suffix(".md")
        if notes.exists():
            text += "\n\n" + notes.read_text().strip()
        sections.append(
            f"\n{text}\n\nRaw: `{run.relative_to(REPO)}` and its folder of logs; "
            "the calls that made it: `benchmarks/gpu/plan.md`.\n"
        )
    return "".join(sections)


def gpu_section() -> str:
    g = gpu_projection()
    return f"""## GPU projection (on paper)

An 8B model in bf16 on one H200 (141 GB HBM3e at 4.8 TB/s, 989 TFLOPS dense BF16, from NVIDIA's data sheet):

- weights: {g["weights_gb"]} GB, read once per decode step, so memory bandwidth caps a replica at
  **~{g["memory_bound_decode_steps_per_s"]} decode steps/s**: one sequence decodes at most that many tokens/s;
- each step yields one token per running sequence, so tokens/s grows with the batch until compute binds at
  2 x 8.03e9 FLOP per token = **~{g["compute_bound_tokens_per_s"]:,} tokens/s**, reached near
  **{g["batch_where_compute_binds"]} sequences** in flight (KV-cache reads push this later in practice);
- KV cache: {g["kv_cache_kb_per_token"]} KB per token (32 layers x 8 KV heads x 128 x K,V x 2 bytes); at
  gpu_memory_utilization 0.9 that leaves {g["kv_cache_budget_gb_at_0.9"]} GB, about {g["kv_cache_tokens"]:,} tokens of context
  across all running sequences.

What the operator sets when the cluster has GPUs (`resource_profile="auto"` picks it): `enable_prefix_caching`
(batch prompts share system prompts and templates), `enable_chunked_prefill` (long prompts do not stall
decoding), `gpu_memory_utilization=0.9` (the KV cache is what lets the batch reach the compute-bound region
above); one GPU per engine unless `tensor_parallel_size` / `pipeline_parallel_size` ask for more, with a
placement group of one GPU bundle per shard. `batch_size` x `max_concurrent_batches` (default 32 x 8 = 256 rows
in flight per replica; Ray documents its default of 8 concurrent batches as enough from 32 rows per batch) should
reach `max_num_seqs`; the operator warns when it cannot.
"""


def startup_section() -> str:
    """Job start-up against a plain vLLM script (benchmarks/startup_bench.py), from its newest run."""
    found = _part_files("startup")
    head = "## Start-up: submitted to first answer (VLLMBatchOperator against a plain vLLM script)\n\n"
    if not found:
        return head + _missing("startup")
    r = json.loads(found[-1].read_text())
    ours, offline = r["ours"], r["offline"]

    def cell(side: dict, key: str) -> str:
        v = side.get(key)
        return "-" if not v else f"{v['median']:.1f} ({v['min']:.1f}-{v['max']:.1f})"

    rows = [
        ("ours: driver start (process, imports, ray.init)", cell(ours, "driver_start_s")),
        ("ours: driver checks and plan start", cell(ours, "driver_checks_and_plan_s")),
        (
            "ours: plan start to vLLM's first log line (processor build, actor start, imports)",
            cell(ours, "plan_to_vllm_first_log_s"),
        ),
        ("ours: submitted to engine ready", cell(ours, "submitted_to_engine_ready_s")),
        ("**ours: submitted to first answer**", cell(ours, "submitted_to_first_answer_s")),
        ("ours: submitted to last answer", cell(ours, "submitted_to_last_answer_s")),
        ("ours: publish (last answer to job end)", cell(ours, "publish_s")),
        ("**ours: submitted to SUCCEEDED**", cell(ours, "submitted_to_succeeded_s")),
        ("plain: process start to engine ready", cell(offline, "start_to_engine_ready_s")),
        ("**plain: process start to first token**", cell(offline, "start_to_first_token_s")),
        ("**plain: process start to exit**", cell(offline, "start_to_end_s")),
    ]
    table = "| step | seconds, median (min-max) |\n|---|---|\n" + "".join(f"| {a} | {b} |\n" for a, b in rows)
    pre = r.get("driver_preflight_s") or {}
    checks = ""
    if {"before", "after"} <= set(pre):
        imports = r.get("driver_preflight_imports", {})
        checks = (
            f"\nThe driver's checks alone (a fresh Ray driver, the preflight of the same job): "
            f"{pre['before']['median']:.1f} s when they imported vLLM (torch imported: "
            f"{imports.get('before', {}).get('torch')}), {pre['after']['median']:.1f} s reading the model's "
            f"config files and vLLM's source (torch imported: {imports.get('after', {}).get('torch')}): "
            f"**{r['per_job_saving_s']:.1f} s less before a bad setting is refused**. A job that runs still "
            "imports torch and vLLM in its driver when Ray Data's processor is built (Ray 2.60's "
            "`build_processor` imports its stage modules; `vllm_engine_stage.py` imports torch), so its "
            "saving is the checks' work beyond those imports; a full job with the old checks was not run "
            "side by side.\n"
        )
    return (
        head + f"{r['rounds']} interleaved round(s) of {r['date']}, {r['rows']} rows x {r['max_tokens']} tokens, "
        "SmolLM2 on the CPU engine, 2 CPUs (`benchmarks/startup_bench.py`). Ours counts from the Jobs API's "
        "submission to its end: the driver process, its checks, Ray Data starting the engine actor (it is "
        "asked for when the stream starts, while the input is read), vLLM's imports and engine start in the "
        "actor and its engine core, the rows, the output files and the publish. The plain script counts from "
        "its process start to its exit: imports, `LLM(...)` and `LLM.chat` over the same rows with the engine "
        "settings our job resolved; no Ray, no files written. First answer (ours) is the first row answered "
        "whole; first token (plain) is vLLM's own first-token time of its first request.\n\n" + table + checks
    )


def incremental_section() -> str:
    """Incremental runs against full runs (benchmarks/incremental_bench.py), from its newest run."""
    found = _part_files("incremental")
    head = "## Incremental runs: a table that changed by a few percent (HttpLLMBatchOperator)\n\n"
    if not found:
        return head + _missing("incremental")
    r = json.loads(found[-1].read_text())
    if "full" not in r or "incremental" not in r:
        return head + _missing("incremental")

    def cell(side: str, key: str, digits: int = 1) -> str:
        v = r[side][key]
        return f"{v['median']:,.{digits}f} ({v['min']:,.{digits}f}-{v['max']:,.{digits}f})"

    rows = [
        ("rows computed (sent to the endpoint)", "rows_computed", 0),
        ("rows reused from the base run", "rows_reused", 0),
        ("base rows dropped (ids gone from the table)", "rows_dropped", 0),
        ("tokens spent (in + out)", "tokens", 0),
        ("**wall time, task start to manifest (s)**", "seconds", 1),
    ]
    table = "| | full run | incremental run |\n|---|---|---|\n" + "".join(
        f"| {label} | {cell('full', key, d)} | {cell('incremental', key, d)} |\n" for label, key, d in rows
    )
    speedup = r["speedup"]
    return (
        head + f"{r['rounds']} interleaved round(s) of {r['date']} (`{r['command']}`): {r['description']} "
        f"Medians (min-max).\n\n" + table + f"\n**The incremental run took {speedup['median']:.1f}x less time** "
        f"(per round: {', '.join(f'{x:.1f}' for x in speedup['samples'])}) and computed "
        f"{r['incremental']['rows_computed']['median']:,.0f} rows instead of {r['full']['rows_computed']['median']:,.0f}. "
        "Its remaining time is the job's fixed cost (submission, driver, reading the whole table to key every "
        "row) and the adoption of the base's files (each read, filtered and written again without its stale "
        "rows).\n"
    )


def prefix_section() -> str:
    """Prefix grouping against the input's own order (benchmarks/prefix_bench.py), from its newest run."""
    found = _part_files("prefix")
    head = "## Prefix grouping: one document, many questions (VLLMBatchOperator, CPU engine)\n\n"
    if not found:
        return head + _missing("prefix")
    r = json.loads(found[-1].read_text())
    w, f, ratio = r["workload"], r["figures"], r["ratio_grouped_over_input_order"]

    def cell(side: str, key: str, digits: int = 1) -> str:
        v = f[side][key]
        return f"{v['median']:.{digits}f} ({v['min']:.{digits}f}-{v['max']:.{digits}f})"

    rows = [
        ("prompt tokens/s while answering", "prompt_tokens_per_s", 0),
        ("output tokens/s while answering", "output_tokens_per_s", 1),
        ("answering: engine ready to last answered row, s", "answering_s", 1),
        ("**job wall: submitted to SUCCEEDED, s**", "job_wall_s", 1),
        ("prompt tokens/s over the job wall", "prompt_tokens_per_s_wall", 0),
    ]
    table = "| median (min-max) | grouped | input order |\n|---|---|---|\n" + "".join(
        f"| {label} | {cell('grouped', key, d)} | {cell('input_order', key, d)} |\n" for label, key, d in rows
    )

    def last_hits(side: str) -> str:
        rates = [run["prefix_cache_hit_rate_logged_pct"] for run in r["runs"][side]]
        return ", ".join(f"{values[-1]:.0f}%" if values else "-" for values in rates)

    hit_line = (
        "vLLM's logged prefix-cache hit rate, its last stats line per run: grouped "
        f"{last_hits('grouped')}; input order {last_hits('input_order')}.\n\n"
    )

    def per_round(key: str, higher_better: bool) -> str:
        pairs = zip(r["runs"]["grouped"], r["runs"]["input_order"])
        ratios = [(g[key] / o[key]) if higher_better else (o[key] / g[key]) for g, o in pairs]
        return ", ".join(f"{x:.2f}x" for x in ratios)

    alone = r.get("grouping_stage_alone")
    cost_line = ""
    if alone:
        cost_line = (
            f"Why it is on by default for generation: where it cannot help (no shared prefix, or a cache that "
            f"holds every prefix) it costs one reorder per window in a light task, {alone['rows']:,} requests "
            f"({alone['request_mib']} MiB) in {alone['seconds']:.2f} s here ({alone['rows_per_s']:,} rows/s, far "
            "above an engine's pace), and the first rows wait for one window to be read; the output's row order "
            "was never the input's. Pooling tasks (embed, classify, score) run without vLLM's prefix cache, so "
            "it is off for them; with `image_column` each row carries its image, so no default window either.\n\n"
        )
    return (
        head + f"{r['rounds']} round(s) of {r['date']}, both sides in each round in alternating order "
        f"(`{r['command']}`): {w['prefixes']} documents of about 1,000 tokens ({w['document_words']} words) x "
        f"{w['questions_per_prefix']} questions, listed question-major so that consecutive rows never share a "
        f"document; SmolLM2 on the CPU engine, {w['max_tokens']} output tokens per row, batch_size "
        f"{w['batch_size']}, engine_kwargs `{json.dumps(w['engine_kwargs'])}`. The KV cache is set small on "
        "purpose: it holds fewer documents than the input has, the case grouping is for (a cache that holds "
        "every document hits in any order). Grouped: the default `prefix_window_rows` (2,048 rows, the whole "
        "input here); input order: `prefix_window_rows=0`. Job wall includes the driver, engine start-up, "
        "answering and publish; prompt tokens count cached ones too, as vLLM reports "
        "them.\n\n"
        f"**Prompt tokens/s: {ratio['prompt_tokens_per_s']:.2f}x** with grouping (target >= 1.5x); "
        f"**job wall: {ratio['job_wall_s']:.2f}x** shorter; answering {ratio['answering_s']:.2f}x shorter "
        f"(ratios of the medians). Round by round, the two sides of a round side by side: prompt tokens/s "
        f"{per_round('prompt_tokens_per_s', True)}; job wall {per_round('job_wall_s', False)} (the machine's "
        "load from other work changed between rounds, so the rounds differ more than the sides of one round)."
        "\n\n"
        + table
        + "\n"
        + hit_line
        + cost_line
        + "Not measured here: 64 questions to each of 8 documents (the input-order side pays a full prefill "
        "per row, about half an hour of it on these 2 CPUs), a KV cache that holds every document (ordering "
        "then matters little: each prefix is computed once whatever the order), several replicas, a GPU.\n"
    )


def load_section(load: dict | None) -> str:
    if load is None:
        return "## Load: deferred operators at once\n\n" + _missing("load")
    lag = load["trigger_loop_lag_ms"]
    return f"""## Load: {load["operators"]} deferred operators at once

{load["operators"]} HttpLLMBatchOperator tasks ({load["rows_per_job"]} rows each) submitted and deferred in
{load["submit_and_defer_s"]} s; their triggers waited in one event loop, as in Airflow's triggerer, while the
cluster ran {load["driver_slots"]} drivers at a time (`entrypoint_resources`). All triggers fired after
{load["all_triggers_fired_s"]} s; jobs succeeded: {load["jobs_succeeded"]}/{load["operators"]}; Ray jobs:
{load["ray_jobs"]} ({load["jobs_submitted_twice"]} submitted twice); complete outputs: {load["outputs_complete"]}.
Event-loop lag while waiting: median {lag["median"]} ms, p99 {lag["p99"]} ms, max {lag["max"]} ms.
"""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--date")
    args = parser.parse_args()
    day = args.date or latest_date()
    parts = load_parts(day)
    http, engine, scale, load = (parts.get(p) for p in PARTS)
    merged: dict = {"date": day, "parts": sorted(parts)}
    if engine:
        merged.update(
            provider_overhead_ratio=engine["provider_overhead_ratio"],
            engine_efficiency_ratio=engine["engine_efficiency_ratio"],
        )
        plot_engine(engine)
    if http:
        merged.update({k: http.get(k) for k in ("rows_per_s_per_caller", "e2e_ratio_vs_asyncio")})
        plot_http(http)
    if scale:
        merged["scale"] = [
            {k: p[k] for k in ("rows", "rows_per_s", "driver_peak_mb", "worker_peak_mb")} for p in scale["scale"]
        ]
        plot_scale(scale)
    if load:
        merged["load"] = {k: v for k, v in load.items() if k != "date"}
    merged["gpu_projection"] = gpu_projection()
    merged["settings"] = {
        p: {k: v for k, v in parts[p].items() if k not in ("runs", "methods", "scale", "caller", "e2e")} for p in parts
    }
    merged["versions"] = next((parts[p]["versions"] for p in parts if "versions" in parts[p]), {})
    out = RESULTS / f"{day}.json"
    out.write_text(json.dumps(merged, indent=2))
    versions = merged["versions"]
    text = f"""# Performance

Figures from `make bench` (2 CPUs, no GPU; Ray {versions.get("ray", "?")}, vLLM {versions.get("vllm", "?")}),
each part from its newest run: {", ".join(f"{p} {parts[p]['date']}" for p in PARTS if p in parts)}. Timings on
this machine are noisy: every comparison runs in interleaved rounds and reports the median and the spread. Raw
numbers: `{out.relative_to(REPO)}` (merged) and the `<date>-<part>.json` files beside it.

{engine_section(engine)}
{startup_section()}
{incremental_section()}
{prefix_section()}
{http_section(http)}
{scale_section(scale)}
{load_section(load)}
{gpu_section()}{gpu_measured()}"""
    (REPO / "docs" / "PERFORMANCE.md").write_text(text)
    print(f"wrote {out.relative_to(REPO)} and docs/PERFORMANCE.md ({', '.join(sorted(parts)) or 'no parts'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
