"""VLLMBatchOperator against the baselines it is built from, on one local Ray cluster (CPU vLLM, SmolLM2).

Each round runs, in a rotated order:
- ours: VLLMBatchOperator (not deferred), task start to manifest;
- plain: the guide's pipeline as a plain script (plain_pipeline.py) through the Jobs API, with the
  engine and processor settings our job resolved (read from our manifest) and its own write;
- offline: vLLM's own ``LLM.chat`` over the same prompts and engine settings (engine start and a warm-up
  excluded);
and, in the first ``--ab-rounds`` rounds, the A/B variants named by ``--ab``: ``ours_stages``, ours with
Ray's separate tokenize and detokenize stages turned on (the A/B of folding them into the engine), and
``ours_mp``, ours with vLLM's own process layout on the CPU (its worker a process of its own beside the engine
core, ``VLLM_ENABLE_V1_MULTIPROCESSING=1``; ours runs that worker inside the engine core).

Provider overhead: our Ray job's duration over the plain script's, both from the Jobs API's start and end
times (median of the rounds); the whole-operator figure (task start to manifest in hand) beside it.
Engine efficiency: our steady-state output tokens/s (from vLLM's "init engine" line in our job's log to the
last answer, as our job's manifest times it) over the offline path's.

Every row asks for exactly --max-tokens tokens (ignore_eos), so token counts are equal across methods.
Writes benchmarks/results/<date>-engine.json; benchmarks/report.py turns it into docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from datetime import date, datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import bench_home, machine, spread, write_results  # noqa: E402

AB_KINDS = ("ours_stages", "ours_mp")
_VLLM_STAMP = re.compile(r"(?:INFO|WARNING) (\d\d-\d\d \d\d:\d\d:\d\d) ")
_ENGINE_STATS = re.compile(r"Avg generation throughput: ([\d.]+) tokens/s, Running: (\d+) reqs")


def prompts(n: int) -> list[dict]:
    topics = ["rivers", "bread", "comets", "violins", "glaciers", "owls", "bridges", "tea"]
    return [{"id": i, "prompt": f"Write two sentences about {topics[i % len(topics)]} (note {i})."} for i in range(n)]


def engine_occupancy(log: str) -> dict:
    """Requests the engine ran at once, from vLLM's periodic stats lines while it generated."""
    running = [int(r) for tps, r in _ENGINE_STATS.findall(log) if float(tps) > 0]
    if not running:
        return {"mean_running": None, "max_running": None, "samples": 0}
    return {"mean_running": statistics.mean(running), "max_running": max(running), "samples": len(running)}


def engine_ready_at(log: str) -> float | None:
    """Epoch seconds (1 s resolution) of vLLM's "init engine ... took" line."""
    for line in log.splitlines():
        if "init engine" in line and "took" in line:
            m = _VLLM_STAMP.search(line)
            if m:
                stamp = datetime.strptime(f"{date.today().year}-{m.group(1)}", "%Y-%m-%d %H:%M:%S")
                return stamp.replace(tzinfo=timezone.utc).timestamp()
    return None


class Bench:
    def __init__(self, args: argparse.Namespace, home: Path, info: object):
        from airflow_provider_rayllm.hooks.ray_job import RayJobHook
        from airflow_provider_rayllm.local.models import smollm2_path
        from tests.integration.helpers import write_jsonl

        self.args, self.home, self.info = args, home, info
        self.model = str(smollm2_path())
        self.sampling = {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True}
        self.input = write_jsonl(home / "in" / "prompts.jsonl", prompts(args.rows))
        self.hook = RayJobHook(ray_conn_id="ray_bench")
        self.plain_dir = home / "plain"
        self.plain_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / "benchmarks" / "plain_pipeline.py", self.plain_dir / "plain_pipeline.py")
        self.resolved: dict | None = None  # our job's engine settings, given to the plain script and offline

    def _job_times(self, sid: str) -> tuple[float, float]:
        info = self.hook.get_job_info(sid) or {}
        return float(info["start_time"]) / 1000, float(info["end_time"]) / 1000

    def ours(self, name: str, **overrides: object) -> dict:
        from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator
        from tests.integration.helpers import StandInTI

        op = VLLMBatchOperator(
            task_id="bench",
            ray_conn_id="ray_bench",
            model_source=self.model,
            input_uri=self.input,
            output_uri=str(self.home / "out" / name),
            prompt_column="prompt",
            sampling_params=self.sampling,
            deferrable=False,
            poll_interval=0.5,
            **overrides,
        )
        started = time.time()
        manifest = op.execute({"ti": StandInTI("engine_bench", name, "bench")})
        ended = time.time()
        job_start, job_end = self._job_times(manifest["submission_id"])
        log = self.hook.get_job_logs(manifest["submission_id"])
        timeline = manifest["timeline"]
        # The engine's readiness from vLLM's own "init engine" line, as for the plain script: the driver's
        # progress log sees the engine's actor only at its next look, after the first answers at times.
        origin = datetime.fromisoformat(manifest["started_at"]).timestamp()
        init = engine_ready_at(log)
        ready = None if init is None else init - origin
        last = timeline.get("last_answer_s")
        timeline = {**timeline, "engine_init_s": ready}
        steady = (
            manifest["output_tokens"] / (last - ready)
            if ready is not None and last is not None and last > ready
            else None
        )
        if not overrides:
            self.resolved = {"engine_kwargs": manifest["engine_kwargs"], "feed": manifest["feed"]}
        return {
            "operator_s": ended - started,
            "job_s": job_end - job_start,
            "driver_s": manifest["wall_time_s"],
            "timeline": timeline,
            "steady_tokens_per_s": steady,
            "engine": engine_occupancy(log),
            "rows": manifest["rows_out"],
            "output_tokens": manifest["output_tokens"],
        }

    def plain(self, name: str) -> dict:
        from ray.job_submission import JobSubmissionClient

        assert self.resolved is not None, "ours runs before plain in every round's first place"
        settings = {"model_source": self.model, "sampling_params": self.sampling, **self.resolved}
        out = self.home / "out" / name
        client = JobSubmissionClient(self.info.dashboard_url, headers={"Authorization": f"Bearer {self.info.token}"})
        started = time.time()
        sid = client.submit_job(
            entrypoint=f"python plain_pipeline.py {self.input} {out} '{json.dumps(settings)}'",
            runtime_env={"working_dir": str(self.plain_dir)},
        )
        while client.get_job_status(sid).is_terminal() is False:
            time.sleep(0.5)
        ended = time.time()
        log = client.get_job_logs(sid)
        if str(client.get_job_status(sid)) != "SUCCEEDED" or "PLAIN_DONE" not in log:
            raise RuntimeError(f"plain/{name} failed: {log[-3000:]}")
        import pyarrow.parquet as pq

        table = pq.read_table(out)
        job_start, job_end = self._job_times(sid)
        ready = engine_ready_at(log)
        return {
            "submit_to_end_s": ended - started,
            "job_s": job_end - job_start,
            "engine_ready_s": None if ready is None else ready - job_start,
            "engine": engine_occupancy(log),
            "rows": table.num_rows,
            "output_tokens": int(sum(table.column("tokens").to_pylist())),
        }

    def offline(self, env: dict) -> dict:
        assert self.resolved is not None
        settings = {
            "model_source": self.model,
            "engine_kwargs": self.resolved["engine_kwargs"],
            "sampling_params": self.sampling,
        }
        script = REPO / "benchmarks" / "offline_generate.py"
        env = {**env, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        proc = subprocess.run(
            [sys.executable, str(script), json.dumps(settings), self.input], env=env, capture_output=True, text=True
        )
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("OFFLINE ")), None)
        if proc.returncode != 0 or line is None:
            raise RuntimeError(f"offline failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-3000:]}")
        result = json.loads(line[len("OFFLINE ") :])
        result["tokens_per_s"] = result["output_tokens"] / result["seconds"]
        return result


def summarize(args: argparse.Namespace, bench: Bench, runs: dict[str, list[dict]]) -> dict:
    import ray
    import vllm

    pairs = list(zip(runs["ours"], runs["plain"]))
    overhead = [o["job_s"] / p["job_s"] for o, p in pairs]
    operator = [o["operator_s"] / p["job_s"] for o, p in pairs]
    efficiency = [
        o["steady_tokens_per_s"] / off["tokens_per_s"]
        for o, off in zip(runs["ours"], runs["offline"])
        if o["steady_tokens_per_s"]
    ]

    def steady(kind: str) -> dict | None:
        values = [r["steady_tokens_per_s"] for r in runs[kind] if r.get("steady_tokens_per_s")]
        return spread(values) if values else None

    results = {
        "date": date.today().isoformat(),
        "command": " ".join([".venv/bin/python benchmarks/engine_bench.py", *sys.argv[1:]]),
        "rows": args.rows,
        "max_tokens": args.max_tokens,
        "rounds": len(runs["ours"]),
        "model": "SmolLM2-135M-Instruct (CPU vLLM)",
        "resolved": bench.resolved,
        "provider_overhead_ratio": statistics.median(overhead) if overhead else None,
        "provider_overhead": spread(overhead) if overhead else None,
        "operator_overhead": spread(operator) if operator else None,
        "ours_job_s": spread([r["job_s"] for r in runs["ours"]]),
        "plain_job_s": spread([r["job_s"] for r in runs["plain"]]) if runs["plain"] else None,
        "engine_efficiency_ratio": statistics.median(efficiency) if efficiency else None,
        "engine_efficiency": spread(efficiency) if efficiency else None,
        "steady_tokens_per_s": {kind: steady(kind) for kind in ("ours", *AB_KINDS)},
        "offline_tokens_per_s": spread([r["tokens_per_s"] for r in runs["offline"]]) if runs["offline"] else None,
        **{f"{kind}_job_s": spread([r["job_s"] for r in runs[kind]]) if runs[kind] else None for kind in AB_KINDS},
        "engine_occupancy": {
            kind: {
                "mean_running": statistics.median(v)
                if (v := [r["engine"]["mean_running"] for r in runs[kind] if r["engine"]["mean_running"]])
                else None,
                "max_running": max((r["engine"]["max_running"] or 0) for r in runs[kind]) if runs[kind] else None,
            }
            for kind in ("ours", "plain", *AB_KINDS)
        },
        "timeline_median_s": {
            step: statistics.median(v)
            if (v := [r["timeline"][step] for r in runs["ours"] if r["timeline"].get(step) is not None])
            else None
            for step in (
                "plan_started_s",
                "engine_init_s",
                "engine_ready_s",
                "first_answer_s",
                "first_output_file_s",
                "last_answer_s",
            )
        },
        "plain_engine_ready_s": statistics.median(v)
        if (v := [r["engine_ready_s"] for r in runs["plain"] if r["engine_ready_s"] is not None])
        else None,
        "runs": runs,
        "versions": {"ray": ray.__version__, "vllm": vllm.__version__, "python": platform.python_version()},
        "machine": machine(),
    }
    write_results("engine", results)
    return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ab-rounds", type=int, default=3, help="rounds that also run the A/B variants of ours (--ab)")
    parser.add_argument("--ab", default="stages,mp", help="A/B variants: stages (Ray's tokenize/detokenize), mp")
    args = parser.parse_args()

    home = bench_home("engine-bench")

    from airflow_provider_rayllm.local.cluster import LocalRayCluster

    cluster = LocalRayCluster(state_dir=home / "ray", num_cpus=2)
    info = cluster.start()
    os.environ["AIRFLOW_CONN_RAY_BENCH"] = info.airflow_conn_uri()
    bench = Bench(args, home, info)
    runs: dict[str, list[dict]] = {"ours": [], "plain": [], "offline": [], **{kind: [] for kind in AB_KINDS}}
    ab = [f"ours_{name}" for name in args.ab.split(",") if name]
    results: dict = {}
    try:
        for round_no in range(args.rounds):
            # ours first in the first round (its manifest gives the others their settings), then rotated.
            order = ["ours", "plain", "offline"] + (ab if round_no < args.ab_rounds else [])
            if round_no:
                shift = round_no % len(order)
                order = order[shift:] + order[:shift]
            for kind in order:
                name = f"r{round_no}-{kind}"
                if kind == "ours":
                    result = bench.ours(name)
                elif kind == "ours_mp":
                    from airflow_provider_rayllm.job.engines.vllm.settings import ONE_PROCESS_ENV

                    result = bench.ours(name, runtime_env={"env_vars": {ONE_PROCESS_ENV: "1"}})
                elif kind == "ours_stages":
                    result = bench.ours(name, tokenize_stage=True, detokenize_stage=True)
                elif kind == "plain":
                    result = bench.plain(name)
                else:
                    result = bench.offline(cluster.env())
                runs[kind].append(result)
                shown = {
                    k: round(v, 2) if isinstance(v, float) else v
                    for k, v in result.items()
                    if k not in ("timeline", "engine")
                }
                print(f"round {round_no + 1} {kind}: {shown}", flush=True)
            results = summarize(args, bench, runs)  # a stopped run still leaves its finished rounds
    finally:
        cluster.stop()

    print(json.dumps({k: results.get(k) for k in ("provider_overhead_ratio", "engine_efficiency_ratio")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
