"""Where a job's seconds go on the GPU, ours beside the offline script's: one bar per side and task, from the
round whose end-to-end ratio is the median of a rounds run (report.py's ``rounds`` section).

    .venv/bin/python benchmarks/gpu/plot_seconds.py benchmarks/results/2026-12-06-gpu-rounds.json

writes docs/img/gpu_seconds.png. Offline counts from its process start, ours from the Jobs API's submission;
each bar's parts add up to that side's whole window.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "docs" / "img" / "gpu_seconds.png"


def median_round(task: dict[str, Any]) -> dict[str, Any]:
    counted = [r for r in task["per_round"] if r.get("counted")]
    middle = statistics.median_low([r["e2e_ratio"] for r in counted])
    return next(r for r in counted if r["e2e_ratio"] == middle)


def parts(r: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    """Each side's window in its parts, seconds: (label, seconds), in order."""
    off, ours = r["startup"]["offline"], r["startup"]["ours"]
    ready = off["process_to_engine_ready_s"]
    offline = [
        ("import vLLM", off["import_vllm_s"]),
        ("engine init", off["engine_init_s"]),
        ("other start-up", ready - off["import_vllm_s"] - off["engine_init_s"]),
        ("engine busy", r["offline_busy_s"]),
    ]
    offline.append(("after the answers", r["offline_whole_s"] - sum(s for _, s in offline)))
    mine = [
        ("submitted -> driver", ours["submitted_to_driver_s"]),
        ("driver -> engine ready", ours["driver_to_engine_ready_s"]),
        ("engine busy", r["ours_busy_s"]),
    ]
    mine.append(("after the answers", r["ours_whole_s"] - sum(s for _, s in mine)))
    return {"offline script": offline, "our job": mine}


COLORS = {
    "import vLLM": "#9ecae1",
    "engine init": "#4292c6",
    "other start-up": "#c6dbef",
    "submitted -> driver": "#fdd0a2",
    "driver -> engine ready": "#f16913",
    "engine busy": "#41ab5d",
    "after the answers": "#bdbdbd",
}


def plot(summary: dict[str, Any], out: Path = OUT) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: list[tuple[str, list[tuple[str, float]]]] = []
    for task in ("generate", "embed"):
        if task not in summary.get("rounds", {}):
            continue
        r = median_round(summary["rounds"][task])
        for side, bits in parts(r).items():
            rows.append((f"{task}, {side}\n(round {r['round']}, ratio {r['e2e_ratio']:.3f})", bits))
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.7 * len(rows)))
    seen: set[str] = set()
    for y, (_, bits) in enumerate(reversed(rows)):
        left = 0.0
        for label, seconds in bits:
            ax.barh(
                y,
                seconds,
                left=left,
                color=COLORS[label],
                edgecolor="white",
                label=None if label in seen else label,
            )
            if seconds >= 6:
                ax.text(left + seconds / 2, y, f"{seconds:.0f}", ha="center", va="center", fontsize=8)
            seen.add(label)
            left += seconds
        ax.text(left + 1, y, f"{left:.1f} s", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [name for name, _ in reversed(rows)], fontsize=8)
    ax.set_xlabel("seconds (offline: from its process start; ours: from the job's submission)")
    ax.set_title(
        f"Where a job's seconds go, median round ({(summary.get('device') or {}).get('nvidia_smi') or 'GPU'})",
        fontsize=10,
    )
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.17))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("summary", type=Path, help="report.py's JSON of a rounds run")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    print(plot(json.loads(args.summary.read_text()), args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
