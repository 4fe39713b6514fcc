"""How CPU vLLM engines share a small machine: OMP_WAIT_POLICY=PASSIVE in the local cluster's environment (so in
every engine process) against GNU OpenMP's default (spin, then sleep), on the same rows, SmolLM2 on the CPU
engine at the product's defaults. A setting looked at for the embedded stack and not kept (docs/DEVELOPING.md).

Each round runs, for each policy in a rotated order:
- pair: two engine jobs at once, each on a local Ray cluster of its own (as the two pytest workers of
  `make test` run them): the machine's CPU seconds (/proc/stat, user + nice + system) from the moment both
  processes start to the moment both end (cluster starts included, the same on both sides), that window's
  wall, and each job's own wall (VLLMBatchOperator.execute, not deferred: submission to manifest);
- alone: one engine job with the machine to itself: its wall and the machine's CPU seconds.

Writes benchmarks/results/<date>-omp-wait.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import bench_home, cpu_versions, machine, spread, write_results  # noqa: E402

POLICIES = ("default", "passive")


def machine_cpu_s() -> float:
    import psutil

    used = psutil.cpu_times()  # the machine's, read from /proc/stat
    return used.user + used.nice + used.system


def child(policy: str, rows: int, max_tokens: int, out: Path) -> None:
    """One local cluster, one engine job; its figures to ``out``."""
    home = bench_home("omp-wait")
    # The cluster's processes, and through its raylet every engine, inherit this process's environment.
    if policy == "default":
        os.environ.pop("OMP_WAIT_POLICY", None)
    else:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    from airflow_provider_rayllm.local.cluster import LocalRayCluster
    from airflow_provider_rayllm.local.models import smollm2_path
    from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator
    from tests.integration.helpers import StandInTI, write_jsonl

    cluster = LocalRayCluster(state_dir=home / "ray", num_cpus=2)
    info = cluster.start()
    try:
        os.environ["AIRFLOW_CONN_RAY_DEFAULT"] = info.airflow_conn_uri(output_base=str(home / "outputs"))
        prompts = [{"id": i, "prompt": f"Tell me one fact about the number {i}."} for i in range(rows)]
        op = VLLMBatchOperator(
            task_id="answer",
            model_source=str(smollm2_path()),
            input_uri=write_jsonl(home / "prompts.jsonl", prompts),
            output_uri=str(home / "out"),
            prompt_column="prompt",
            sampling_params={"temperature": 0.0, "max_tokens": max_tokens},
            deferrable=False,
            poll_interval=0.5,
        )
        started = time.time()
        manifest = op.execute({"ti": StandInTI("omp_wait", "manual__1", "answer")})
        job_s = time.time() - started
    finally:
        cluster.stop()
    figures = {"job_s": round(job_s, 2), "rows_out": manifest["rows_out"], "output_tokens": manifest["output_tokens"]}
    out.write_text(json.dumps(figures))


def run_children(policy: str, count: int, args: argparse.Namespace, scratch: Path) -> dict:
    outs = [scratch / f"{policy}-{i}-{time.time_ns()}.json" for i in range(count)]
    cpu0, t0 = machine_cpu_s(), time.time()
    procs = []
    for out in outs:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            policy,
            "--rows",
            str(args.rows),
            "--max-tokens",
            str(args.max_tokens),
        ]
        procs.append(subprocess.Popen([*cmd, "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for proc in procs:
        if proc.wait(timeout=900) != 0:
            raise RuntimeError(f"a {policy} job failed (exit {proc.returncode}); run it with --child to see why")
    jobs = [json.loads(out.read_text()) for out in outs]
    if any(job["rows_out"] != args.rows for job in jobs):
        raise RuntimeError(f"a {policy} job answered fewer rows than {args.rows}: {jobs}")
    return {"machine_cpu_s": round(machine_cpu_s() - cpu0, 1), "wall_s": round(time.time() - t0, 1), "jobs": jobs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--child", choices=POLICIES)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.rows, args.max_tokens, args.out)
        return 0

    scratch = bench_home("omp-wait-runs")
    rounds = []
    for r in range(args.rounds):
        order = POLICIES if r % 2 == 0 else POLICIES[::-1]
        entry: dict = {"order": list(order)}
        for policy in order:
            entry[policy] = {
                "pair": run_children(policy, 2, args, scratch),
                "alone": run_children(policy, 1, args, scratch),
            }
            print(f"round {r + 1} {policy}: {json.dumps(entry[policy])}", flush=True)
        rounds.append(entry)

    def series(policy: str, part: str, key: str) -> list[float]:
        return [entry[policy][part][key] for entry in rounds]

    def job_walls(policy: str, part: str) -> list[float]:
        return [job["job_s"] for entry in rounds for job in entry[policy][part]["jobs"]]

    summary = {
        policy: {
            "pair_machine_cpu_s": spread(series(policy, "pair", "machine_cpu_s")),
            "pair_wall_s": spread(series(policy, "pair", "wall_s")),
            "pair_job_s": spread(job_walls(policy, "pair")),
            "alone_job_s": spread(job_walls(policy, "alone")),
            "alone_machine_cpu_s": spread(series(policy, "alone", "machine_cpu_s")),
        }
        for policy in POLICIES
    }
    ratio = {
        key: round(summary["passive"][key]["median"] / summary["default"][key]["median"], 3)
        for key in summary["default"]
    }
    results = {
        "date": date.today().isoformat(),
        "what": "OMP_WAIT_POLICY=PASSIVE in the local cluster's environment against GNU OpenMP's default, CPU vLLM "
        "engine jobs at the product's defaults; 'pair' is two jobs at once on two local clusters, 'alone' one job. "
        "Machine CPU seconds from /proc/stat over the window; job_s is VLLMBatchOperator.execute, submission to "
        "manifest.",
        "machine": machine(),
        "versions": cpu_versions(),
        "settings": {"rounds": args.rounds, "rows": args.rows, "max_tokens": args.max_tokens},
        "passive_over_default": ratio,
        "summary": summary,
        "rounds": rounds,
    }
    path = write_results("omp-wait", results)
    print(json.dumps({"passive_over_default": ratio}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
