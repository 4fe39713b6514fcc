"""VLLMBatchOperator against the baselines it is built from, on one local Ray cluster (CPU vLLM, SmolLM2).

Each round runs, in a rotated order:
- ours/large: VLLMBatchOperator (not deferred), task start to manifest, --rows prompts;
- plain/large: the guide's pipeline as a plain script (plain_pipeline.py) through `ray job submit`, same
  prompts and the engine settings our operator resolved;
- ours/small (deferred): the same job over a third of the prompts, waited for by its trigger; the
  difference to ours/large gives the engine's steady-state output tokens/s with start-up cancelled out,
  and the deferred run gives the Airflow worker's slot-seconds;
- offline: vLLM's own `LLM.chat` over the same prompts and settings (engine start and warm-up excluded).

Every row asks for exactly --max-tokens tokens (ignore_eos), so token counts are equal across methods.
Writes benchmarks/results/<date>-engine.json; benchmarks/report.py turns it into docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import asyncio
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

from benchmarks.common import bench_home  # noqa: E402
RESULTS = REPO / "benchmarks" / "results"


def prompts(n: int) -> list[dict]:
    topics = ["rivers", "bread", "comets", "violins", "glaciers", "owls", "bridges", "tea"]
    return [{"id": i, "prompt": f"Write two sentences about {topics[i % len(topics)]} (note {i})."} for i in range(n)]


_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}).*?rayllm: (.*)$")
_VLLM_STAMP = re.compile(r"(?:INFO|WARNING) (\d\d-\d\d \d\d:\d\d:\d\d) ")
_ENGINE_STATS = re.compile(r"Avg generation throughput: ([\d.]+) tokens/s, Running: (\d+) reqs")


def _when_rayllm_said(log: str, prefix: str) -> float | None:
    """Epoch seconds of the driver's first `rayllm:` line starting with prefix."""
    for line in log.splitlines():
        m = _STAMP.match(line)
        if m and m.group(3).startswith(prefix):
            stamp = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc)
            return stamp.timestamp() + int(m.group(2)) / 1000
    return None


def _when_engine_ready(log: str) -> float | None:
    """Epoch seconds (1 s resolution) of vLLM's "init engine ... took" line."""
    for line in log.splitlines():
        if "init engine" in line and "took" in line:
            m = _VLLM_STAMP.search(line)
            if m:
                stamp = datetime.strptime(f"{date.today().year}-{m.group(1)}", "%Y-%m-%d %H:%M:%S")
                return stamp.replace(tzinfo=timezone.utc).timestamp()
    return None


def engine_occupancy(log: str) -> dict:
    """Requests the engine ran at once, from vLLM's periodic stats lines while it generated."""
    running = [int(r) for tps, r in _ENGINE_STATS.findall(log) if float(tps) > 0]
    if not running:
        return {"mean_running": None, "max_running": None, "samples": 0}
    return {"mean_running": statistics.mean(running), "max_running": max(running), "samples": len(running)}


def job_timeline(log: str, start: float, end: float) -> dict:
    """Seconds from the job's start to each step its log shows (None where a step left no line)."""

    def since(t: float | None) -> float | None:
        return None if t is None else t - start

    return {
        "checks_done_s": since(_when_rayllm_said(log, "profile ")),
        "rows_prepared_s": since(_when_rayllm_said(log, "rows in:")),
        "engine_ready_s": since(_when_engine_ready(log)),
        "rows_done_s": since(_when_rayllm_said(log, "rows out:")),
        "job_s": end - start,
    }


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "samples": values}


class Bench:
    def __init__(self, args: argparse.Namespace, home: Path):
        from airflow_provider_rayllm.hooks.ray_job import RayJobHook
        from airflow_provider_rayllm.job.vllm_pipeline import CPU_ENGINE_DEFAULTS
        from airflow_provider_rayllm.local.models import smollm2_path
        from tests.integration.helpers import write_jsonl

        self.args, self.home = args, home
        self.model = str(smollm2_path())
        self.sampling = {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True}
        self.engine_kwargs = dict(CPU_ENGINE_DEFAULTS)
        from airflow_provider_rayllm.spec import VLLMProcessorSpec

        # The operator's own defaults, given to the plain script as well.
        fields = VLLMProcessorSpec.model_fields
        self.batch_size = fields["batch_size"].default
        self.max_concurrent_batches = fields["max_concurrent_batches"].default
        self.large = write_jsonl(home / "in" / "large.jsonl", prompts(args.rows))
        self.small = write_jsonl(home / "in" / "small.jsonl", prompts(args.rows // 3))
        self.hook = RayJobHook(ray_conn_id="ray_bench")
        self.plain_dir = home / "plain"
        self.plain_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / "benchmarks" / "plain_pipeline.py", self.plain_dir / "plain_pipeline.py")

    def _operator(self, name: str, input_uri: str, deferrable: bool):
        from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

        return VLLMBatchOperator(
            task_id="bench", ray_conn_id="ray_bench", model_source=self.model, input_uri=input_uri,
            output_uri=str(self.home / "out" / name), prompt_column="prompt", sampling_params=self.sampling,
            engine_kwargs=self.engine_kwargs, deferrable=deferrable, poll_interval=0.5,
        )

    def _job_times(self, sid: str) -> tuple[float, float]:
        info = self.hook.get_job_info(sid) or {}
        return float(info["start_time"]) / 1000, float(info["end_time"]) / 1000

    def ours(self, name: str) -> dict:
        from tests.integration.helpers import StandInTI, run_in_thread, wait_for

        ti = StandInTI("engine_bench", name, "bench")
        started = time.time()
        thread, outcome = run_in_thread(self._operator(name, self.large, deferrable=False), ti)
        wait_for(lambda: "submission_id" in ti.xcom or not thread.is_alive(), 300, "the submission")
        submitted = time.time()
        thread.join()
        ended = time.time()
        if "error" in outcome:
            raise RuntimeError(f"ours/{name}: {outcome['error']}")
        manifest = outcome["result"]
        job_start, job_end = self._job_times(manifest["submission_id"])
        log = self.hook.get_job_logs(manifest["submission_id"])
        return {
            "timeline": job_timeline(log, job_start, job_end),
            "engine": engine_occupancy(log),
            "total_s": ended - started,
            "submit_s": submitted - started,
            "until_driver_started_s": job_start - submitted,
            "driver_s": manifest["wall_time_s"],
            "job_s": job_end - job_start,
            "end_noticed_s": ended - job_end,
            "rows": manifest["rows_out"],
            "output_tokens": manifest["output_tokens"],
            "worker_slot_s": ended - started,
        }

    def ours_deferred(self, name: str) -> dict:
        from airflow.sdk.exceptions import TaskDeferred

        from tests.integration.helpers import StandInTI

        ti = StandInTI("engine_bench", name, "bench")
        op = self._operator(name, self.small, deferrable=True)
        started = time.time()
        try:
            op.execute({"ti": ti})
            raise RuntimeError("the deferrable operator did not defer")
        except TaskDeferred as deferral:
            trigger = deferral.trigger
        deferred = time.time()

        async def wait() -> dict:
            async for event in trigger.run():
                return event.payload
            raise RuntimeError("the trigger ended without an event")

        event = asyncio.run(wait())
        resumed = time.time()
        manifest = op.execute_complete({"ti": ti}, event)
        ended = time.time()
        return {
            "total_s": ended - started,
            "driver_s": manifest["wall_time_s"],
            "rows": manifest["rows_out"],
            "output_tokens": manifest["output_tokens"],
            "worker_slot_s": (deferred - started) + (ended - resumed),
        }

    def plain(self, name: str, env: dict, address: str) -> dict:
        settings = {
            "model_source": self.model, "engine_kwargs": self.engine_kwargs, "batch_size": self.batch_size,
            "max_concurrent_batches": self.max_concurrent_batches, "sampling_params": self.sampling,
        }
        out = self.home / "out" / name
        cmd = [
            str(Path(sys.executable).with_name("ray")), "job", "submit", "--address", address,
            "--working-dir", str(self.plain_dir), "--", "python", "plain_pipeline.py", self.large, str(out),
            json.dumps(settings),
        ]
        started = time.time()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        seconds = time.time() - started
        if proc.returncode != 0 or "PLAIN_DONE" not in proc.stdout:
            raise RuntimeError(f"plain/{name} failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-3000:]}")
        import pyarrow.parquet as pq

        table = pq.read_table(out)
        result = {"total_s": seconds, "rows": table.num_rows, "output_tokens": int(sum(table.column("tokens").to_pylist()))}
        job_id = re.search(r"Job '([^']+)' submitted successfully", proc.stdout + proc.stderr)
        if job_id:
            job_start, job_end = self._job_times(job_id.group(1))
            log = self.hook.get_job_logs(job_id.group(1))
            result.update(timeline=job_timeline(log, job_start, job_end), engine=engine_occupancy(log))
        return result

    def offline(self, env: dict) -> dict:
        settings = {"model_source": self.model, "engine_kwargs": self.engine_kwargs, "sampling_params": self.sampling}
        script = REPO / "benchmarks" / "offline_generate.py"
        env = {**env, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        proc = subprocess.run([sys.executable, str(script), json.dumps(settings), self.large], env=env, capture_output=True, text=True)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("OFFLINE ")), None)
        if proc.returncode != 0 or line is None:
            raise RuntimeError(f"offline failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-3000:]}")
        return json.loads(line[len("OFFLINE ") :])


def _median_timeline(runs: list[dict]) -> dict:
    steps = ("checks_done_s", "rows_prepared_s", "engine_ready_s", "rows_done_s", "job_s")
    out = {}
    for step in steps:
        values = [r["timeline"][step] for r in runs if r.get("timeline") and r["timeline"].get(step) is not None]
        out[step] = statistics.median(values) if values else None
    return out


def _median_occupancy(runs: list[dict]) -> dict:
    means = [r["engine"]["mean_running"] for r in runs if (r.get("engine") or {}).get("mean_running") is not None]
    peaks = [r["engine"]["max_running"] for r in runs if (r.get("engine") or {}).get("max_running") is not None]
    return {
        "mean_running": statistics.median(means) if means else None,
        "max_running": max(peaks) if peaks else None,
    }


def _engine_phase_tokens_per_s(runs: list[dict], end_step: str) -> dict | None:
    """Output tokens over the time from a ready engine to end_step: the rows' own throughput."""
    values = []
    for r in runs:
        t = r.get("timeline") or {}
        if t.get("engine_ready_s") is not None and t.get(end_step) is not None and t[end_step] > t["engine_ready_s"]:
            values.append(r["output_tokens"] / (t[end_step] - t["engine_ready_s"]))
    return _spread(values) if values else None


def summarize(args: argparse.Namespace, bench: Bench, runs: dict[str, list[dict]]) -> dict:
    import ray
    import vllm

    overhead = [o["total_s"] / p["total_s"] for o, p in zip(runs["ours"], runs["plain"])]
    steady = [
        (big["output_tokens"] - small["output_tokens"]) / (big["driver_s"] - small["driver_s"])
        for big, small in zip(runs["ours"], runs["ours_small_deferred"])
    ]
    offline = [o["output_tokens"] / o["seconds"] for o in runs["offline"]]
    efficiency = [s / o for s, o in zip(steady, offline)]
    breakdown = {
        key: statistics.median(r[key] for r in runs["ours"])
        for key in ("submit_s", "until_driver_started_s", "driver_s", "end_noticed_s", "total_s")
    }
    results = {
        "date": date.today().isoformat(),
        "rows": args.rows,
        "small_rows": args.rows // 3,
        "max_tokens": args.max_tokens,
        "rounds": len(runs["ours"]),
        "model": "SmolLM2-135M-Instruct (CPU vLLM)",
        "engine_kwargs": bench.engine_kwargs,
        "batch_size": bench.batch_size,
        "max_concurrent_batches": bench.max_concurrent_batches,
        "timeline_median_s": {kind: _median_timeline(runs[kind]) for kind in ("ours", "plain")},
        "engine_occupancy": {kind: _median_occupancy(runs[kind]) for kind in ("ours", "plain")},
        # ours: engine ready -> all rows answered; plain: engine ready -> job end (its write included).
        "engine_phase_tokens_per_s": {
            "ours": _engine_phase_tokens_per_s(runs["ours"], "rows_done_s"),
            "plain": _engine_phase_tokens_per_s(runs["plain"], "job_s"),
        },
        "provider_overhead_ratio": statistics.median(overhead),
        "provider_overhead": _spread(overhead),
        "ours_breakdown_median_s": breakdown,
        "plain_total_s": _spread([p["total_s"] for p in runs["plain"]]),
        "engine_efficiency_ratio": statistics.median(efficiency),
        "engine_efficiency": _spread(efficiency),
        "ours_steady_tokens_per_s": _spread(steady),
        "offline_tokens_per_s": _spread(offline),
        "airflow_worker_slot_s": {
            "not_deferred": _spread([r["worker_slot_s"] for r in runs["ours"]]),
            "deferred": _spread([r["worker_slot_s"] for r in runs["ours_small_deferred"]]),
            "not_deferred_job_s": statistics.median(r["total_s"] for r in runs["ours"]),
            "deferred_job_s": statistics.median(r["total_s"] for r in runs["ours_small_deferred"]),
        },
        "runs": runs,
        "versions": {"ray": ray.__version__, "vllm": vllm.__version__, "python": platform.python_version()},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{results['date']}-engine.json"
    out.write_text(json.dumps(results, indent=2))
    return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    home = bench_home("engine-bench")

    import ray
    import vllm

    from airflow_provider_rayllm.local.cluster import LocalRayCluster

    cluster = LocalRayCluster(state_dir=home / "ray", num_cpus=2)
    info = cluster.start()
    os.environ["AIRFLOW_CONN_RAY_BENCH"] = info.airflow_conn_uri()
    bench = Bench(args, home)
    runs: dict[str, list[dict]] = {"ours": [], "plain": [], "ours_small_deferred": [], "offline": []}
    try:
        for round_no in range(args.rounds):
            order = ["ours", "plain", "ours_small_deferred", "offline"]
            order = order[round_no % 4 :] + order[: round_no % 4]
            for kind in order:
                name = f"r{round_no}-{kind}"
                if kind == "ours":
                    result = bench.ours(name)
                elif kind == "plain":
                    result = bench.plain(name, cluster.env(), info.dashboard_url)
                elif kind == "ours_small_deferred":
                    result = bench.ours_deferred(name)
                else:
                    result = bench.offline(cluster.env())
                runs[kind].append(result)
                shown = {k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}
                print(f"round {round_no + 1} {kind}: {shown}", flush=True)
            results = summarize(args, bench, runs)  # a stopped run still leaves its finished rounds
    finally:
        cluster.stop()

    print(json.dumps({k: results[k] for k in ("provider_overhead_ratio", "engine_efficiency_ratio")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
