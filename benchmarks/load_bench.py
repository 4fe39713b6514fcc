"""Load: 50 deferred operators against one local Ray cluster (reliability scenario 12).

Each operator submits a small HttpLLMBatchOperator job (a few rows to a local echo endpoint) and defers.
Their 50 triggers then run in one asyncio event loop, as Airflow's triggerer runs them, while a
heartbeat coroutine measures how late the loop wakes up (the triggerer's responsiveness). Drivers
reserve a custom resource (`entrypoint_resources`), so the cluster queues the jobs instead of starting
50 driver processes at once. Afterwards: every job succeeded, each task instance has exactly one Ray
job, every output is complete.

Writes benchmarks/results/<date>-load.json; docs/RELIABILITY.md quotes it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import LOG_DIR, bench_home  # noqa: E402

DRIVER_RESOURCE = "rayllm_driver"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def _run_triggers(triggers: list, heartbeat_s: float = 0.1) -> tuple[list[dict], list[float]]:
    loop = asyncio.get_running_loop()
    lags: list[float] = []
    done = asyncio.Event()

    async def heartbeat() -> None:
        while not done.is_set():
            before = loop.time()
            await asyncio.sleep(heartbeat_s)
            lags.append(loop.time() - before - heartbeat_s)

    async def one(trigger) -> dict:
        started = time.time()
        events = [event async for event in trigger.run()]
        assert len(events) == 1, f"{trigger.submission_id}: {len(events)} events"
        return {**events[0].payload, "waited_s": time.time() - started}

    beat = asyncio.create_task(heartbeat())
    results = await asyncio.gather(*(one(t) for t in triggers))
    done.set()
    await beat
    return list(results), lags


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--operators", type=int, default=50)
    parser.add_argument("--rows", type=int, default=4, help="rows per job")
    parser.add_argument("--driver-slots", type=int, default=4, help="jobs the cluster runs at once")
    parser.add_argument("--poll-interval", type=float, default=2.0)
    args = parser.parse_args()

    home = bench_home("load")

    from airflow.sdk.exceptions import TaskDeferred

    from airflow_provider_rayllm.hooks.ray_job import RayJobHook
    from airflow_provider_rayllm.local.cluster import LocalRayCluster
    from airflow_provider_rayllm.operators.http_batch import HttpLLMBatchOperator
    from tests.integration.helpers import StandInTI, read_rows, write_jsonl
    from tests.integration.services import echo_server

    log_dir = LOG_DIR
    cluster = LocalRayCluster(state_dir=home / "ray", num_cpus=2, resources={DRIVER_RESOURCE: args.driver_slots})
    info = cluster.start()
    try:
        with echo_server(0.05, log_dir) as url:
            os.environ["AIRFLOW_CONN_RAY_LOAD"] = info.airflow_conn_uri()
            os.environ["AIRFLOW_CONN_LLM_LOAD"] = json.dumps({"conn_type": "http", "host": f"{url}/v1"})
            hook = RayJobHook(ray_conn_id="ray_load")
            ops, triggers, tis = [], [], []
            submit_started = time.time()
            for i in range(args.operators):
                data = [{"id": j, "prompt": f"job {i} row {j}"} for j in range(args.rows)]
                op = HttpLLMBatchOperator(
                    task_id=f"load_{i:02d}",
                    ray_conn_id="ray_load",
                    http_conn_id="llm_load",
                    model="echo",
                    input_uri=write_jsonl(home / "in" / f"{i}.jsonl", data),
                    output_uri=str(home / "out" / str(i)),
                    prompt_column="prompt",
                    deferrable=True,
                    poll_interval=args.poll_interval,
                    entrypoint_resources={DRIVER_RESOURCE: 1},
                )
                ti = StandInTI("load_bench", "manual__load", op.task_id)
                try:
                    op.execute({"ti": ti})
                    raise AssertionError(f"{op.task_id} did not defer")
                except TaskDeferred as deferral:
                    triggers.append(deferral.trigger)
                ops.append(op)
                tis.append(ti)
            submit_s = time.time() - submit_started
            print(f"{len(ops)} operators submitted and deferred in {submit_s:.1f} s", flush=True)

            started = time.time()
            events, lags = asyncio.run(_run_triggers(triggers))
            all_done_s = time.time() - started
            print(f"all {len(events)} triggers fired after {all_done_s:.1f} s", flush=True)

            manifests, failures = [], []
            for op, ti, event in zip(ops, tis, events):
                try:
                    manifests.append(op.execute_complete({"ti": ti}, event))
                except Exception as exc:  # reported below
                    failures.append(f"{op.task_id}: {exc}")
            jobs = [j for j in hook.client.list_jobs() if (j.submission_id or "").startswith("rayllm-load_bench")]
            ids = [j.submission_id for j in jobs]
            rows_ok = sum(
                1 for m in manifests if sorted(r["id"] for r in read_rows(m["output_files"])) == list(range(args.rows))
            )
    finally:
        cluster.stop()

    results = {
        "date": date.today().isoformat(),
        "operators": args.operators,
        "rows_per_job": args.rows,
        "driver_slots": args.driver_slots,
        "poll_interval_s": args.poll_interval,
        "submit_and_defer_s": round(submit_s, 1),
        "all_triggers_fired_s": round(all_done_s, 1),
        "jobs_succeeded": sum(1 for e in events if e["status"] == "SUCCEEDED"),
        "task_failures": failures,
        "ray_jobs": len(ids),
        "distinct_ray_jobs": len(set(ids)),
        "jobs_submitted_twice": len(ids) - len(set(ids)) + sum(1 for i in ids if not i.endswith("-g0")),
        "outputs_complete": rows_ok,
        "trigger_loop_lag_ms": {
            "median": round(statistics.median(lags) * 1000, 1),
            "p99": round(_percentile(lags, 0.99) * 1000, 1),
            "max": round(max(lags) * 1000, 1),
            "samples": len(lags),
        },
        "trigger_wait_s": {
            "min": round(min(e["waited_s"] for e in events), 1),
            "median": round(statistics.median(e["waited_s"] for e in events), 1),
            "max": round(max(e["waited_s"] for e in events), 1),
        },
    }
    out = REPO / "benchmarks" / "results" / f"{results['date']}-load.json"
    out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    ok = (
        results["jobs_succeeded"] == args.operators
        and not failures
        and results["jobs_submitted_twice"] == 0
        and results["outputs_complete"] == args.operators
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
