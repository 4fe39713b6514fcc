"""Scale: 10^4, 10^5, 10^6 rows through the HTTP path against a fast local endpoint.

HttpLLMBatchOperator (not deferred, as a worker runs it) sends every row to a local chat endpoint that
answers at once, so the figures are the pipeline's own cost per row. For each size: rows/s from task start
to manifest, and the peak resident memory of the Ray job's driver process and of this process (the
Airflow worker running the task), sampled every 0.2 s.

Writes benchmarks/results/<date>-scale.json; benchmarks/report.py turns it into docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import LOG_DIR, bench_home  # noqa: E402


class PeakRss:
    """Peak RSS (MB) of this process and of the job driver while a job runs."""

    def __init__(self) -> None:
        self.worker_mb = 0.0
        self.driver_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.is_set():
            self.worker_mb = max(self.worker_mb, me.memory_info().rss / 2**20)
            for proc in psutil.process_iter(["cmdline"]):
                cmdline = " ".join(proc.info.get("cmdline") or [])
                if "airflow_provider_rayllm.job" in cmdline and "spec.json" in cmdline:
                    try:
                        self.driver_mb = max(self.driver_mb, proc.memory_info().rss / 2**20)
                    except psutil.Error:
                        pass
            time.sleep(0.2)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def write_rows(path: Path, n: int) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": pa.array(range(n), pa.int64()), "prompt": [f"row {i}: say ok" for i in range(n)]})
    pq.write_table(table, path, row_group_size=50_000)
    return str(path)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--actors", type=int, default=1)
    parser.add_argument("--in-flight", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=2000)
    parser.add_argument(
        "--merge", action="store_true",
        help="keep the other sizes of today's results file (same settings) and replace only the sizes run now",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    home = bench_home("scale")

    import ray

    from airflow_provider_rayllm.local.cluster import LocalRayCluster
    from airflow_provider_rayllm.operators.http_batch import HttpLLMBatchOperator
    from tests.integration.helpers import StandInTI
    from tests.integration.services import echo_server

    log_dir = LOG_DIR
    cluster = LocalRayCluster(state_dir=home / "ray", num_cpus=2)
    info = cluster.start()
    points = []
    try:
        with echo_server(0.0, log_dir) as url:
            os.environ["AIRFLOW_CONN_RAY_SCALE"] = info.airflow_conn_uri()
            os.environ["AIRFLOW_CONN_LLM_SCALE"] = json.dumps({"conn_type": "http", "host": f"{url}/v1"})
            for n in sizes:
                input_uri = write_rows(home / "in" / f"{n}.parquet", n)
                op = HttpLLMBatchOperator(
                    task_id=f"scale_{n}", ray_conn_id="ray_scale", http_conn_id="llm_scale", model="echo",
                    input_uri=input_uri, output_uri=str(home / "out" / str(n)), prompt_column="prompt",
                    keep_columns=["id"], concurrency=args.actors, batch_size=args.batch_size,
                    max_in_flight=args.in_flight, deferrable=False, poll_interval=1.0,
                )
                with PeakRss() as rss:
                    started = time.time()
                    manifest = op.execute({"ti": StandInTI("scale_bench", f"manual__{n}", op.task_id)})
                    seconds = time.time() - started
                assert manifest["rows_out"] == n and manifest["rows_errored"] == 0, manifest
                point = {
                    "rows": n, "seconds": seconds, "rows_per_s": n / seconds, "driver_s": manifest["wall_time_s"],
                    "driver_peak_mb": rss.driver_mb, "worker_peak_mb": rss.worker_mb,
                }
                points.append(point)
                print(json.dumps(point), flush=True)
    finally:
        cluster.stop()

    out = REPO / "benchmarks" / "results" / f"{date.today().isoformat()}-scale.json"
    settings = {"actors": args.actors, "in_flight": args.in_flight, "batch_size": args.batch_size}
    if args.merge and out.exists():
        earlier = json.loads(out.read_text())
        if earlier.get("settings") != settings:
            raise SystemExit(f"--merge: {out} was measured with {earlier.get('settings')}, not {settings}")
        kept = [p for p in earlier["scale"] if p["rows"] not in sizes]
        points = sorted(kept + points, key=lambda p: p["rows"])
    rates = [p["rows_per_s"] for p in points]
    results = {
        "date": date.today().isoformat(),
        "description": (
            f"HttpLLMBatchOperator, {args.actors} actor(s) x {args.in_flight} requests in flight, batch_size "
            f"{args.batch_size}, against a local chat endpoint that answers at once (client and server share the "
            "2 cores); rows/s from task start to manifest, engine-free, so the figures are the pipeline's own cost."
        ),
        "settings": settings,
        "scale": points,
        "rows_per_s_spread": (max(rates) - min(rates)) / statistics.median(rates),
        "versions": {"ray": ray.__version__},
    }
    out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
