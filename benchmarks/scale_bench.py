"""Scale: 10^5, 10^6 and 4x10^6 rows through the HTTP path, with the Ray head's object store capped.

HttpLLMBatchOperator (not deferred, as a worker runs it) sends every row to a local chat endpoint that
answers at once, so the figures are the pipeline's own cost per row. The local Ray head has a 512 MiB
object store: a job that held its input (or its outputs) in the object store would spill to disk or
fail; a streaming one holds a bounded window of rows whatever the input's size.

For each size: rows/s from task start to manifest; peak resident memory of the Ray job's driver and of
this process (the Airflow worker running the task); the object store's peak use and the bytes spilled,
from Ray's own metrics (the head's Prometheus endpoint); and the seconds from the Ray job's start to the
first output file on disk (this process watches the output folder).

The operator runs with its own defaults (batch_size, max_in_flight, no object_store_window_mb) unless an option
sets one; such a run is a row of its own, written as <date>-scale-<settings>.json (e.g. ``--window-mb 16``:
<date>-scale-window16.json). The defaults' run writes benchmarks/results/<date>-scale.json, which
benchmarks/report.py turns into docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import sys
import threading
import time
import urllib.request
from datetime import date
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import LOG_DIR, bench_home  # noqa: E402

OBJECT_STORE_BYTES = 512 * 2**20
# A run with settings of its own is written beside the defaults' run: <date>-scale-window16.json and so on.
SHORT = {
    "batch_size": "batch",
    "max_in_flight": "inflight",
    "object_store_window_mb": "window",
    "prefix_window_rows": "prefix",
}
SERIES_POINTS = 200  # the object store's use over a job, kept as this many slices (each slice's highest sample)
PROGRESS_TICKS = 300  # one progress line a minute (the watch samples every 0.2 s)
# Ray's metrics every 5 s (25 ticks): the raylet reports them every 10 s, and one scrape of the head's endpoint
# is about 1.2 MB of text, 0.23 s of the metrics agent's CPU. Scraped every second, the watch took about a
# quarter of a core from the job it measures (seen in top: the agent at 14 % of the run's CPU time).
RAY_METRICS_TICKS = 25
_METRIC = re.compile(r"^(?P<name>[a-z_]+)\{(?P<labels>[^}]*)\} (?P<value>[0-9.e+-]+)")


def ray_metrics(port: int) -> dict[str, float]:
    """The few of Ray's Prometheus metrics this bench reads (summed over their label sets)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    wanted = {
        "ray_object_store_used_memory": None,
        "ray_spill_manager_objects_bytes": 'State="Spilled"',
        "ray_spill_manager_request_total": 'Type="Spilled"',
    }
    found: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if not m or m["name"] not in wanted:
            continue
        label = wanted[m["name"]]
        if label is None or label in m["labels"]:
            found[m["name"]] = found.get(m["name"], 0.0) + float(m["value"])
    return found


class Watch:
    """While a job runs: peak RSS of this process and of the job driver, the object store's peak use and
    the spilled bytes (Ray's metrics), and when the first output file appeared."""

    def __init__(self, metrics_port: int, output_uri: Path) -> None:
        self.metrics_port, self.output_uri = metrics_port, output_uri
        self.worker_mb = self.driver_mb = self.object_store_mb = self.spilled_mb = 0.0
        self.spill_requests_at_start: float | None = None
        self.spill_requests = 0.0
        self.first_output_at: float | None = None
        # (seconds since the watch began, object store in use MB), one sample per scrape: the plot's line.
        self.series: list[tuple[float, float]] = []
        # (seconds since the watch began, output files on disk), at the same scrapes: the job's pace over time.
        self.files: list[tuple[float, int]] = []
        # (seconds since the watch began, driver RSS MB, of it anonymous MB), at every memory sample: what the
        # driver allocated itself (its heaps: Python's, Ray core's C++, Arrow's pool) apart from the shared
        # libraries and files it maps (psutil's `shared`).
        self.driver_memory: list[tuple[float, float, float]] = []
        self._began = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample_memory(self, me: object) -> None:
        import psutil

        self.worker_mb = max(self.worker_mb, me.memory_info().rss / 2**20)
        driver = None  # the largest process whose command line is the driver's (the shell that starts it matches too)
        for proc in psutil.process_iter(["cmdline"]):
            cmdline = " ".join(proc.info.get("cmdline") or [])
            if "airflow_provider_rayllm.job" in cmdline and "spec.json" in cmdline:
                try:
                    memory = proc.memory_info()
                except psutil.Error:
                    continue
                if driver is None or memory.rss > driver.rss:
                    driver = memory
        if driver is not None:
            self.driver_mb = max(self.driver_mb, driver.rss / 2**20)
            at = time.time() - self._began
            self.driver_memory.append((at, driver.rss / 2**20, (driver.rss - driver.shared) / 2**20))

    def _sample_ray(self) -> None:
        try:
            m = ray_metrics(self.metrics_port)
        except OSError:
            return
        used = m.get("ray_object_store_used_memory", 0.0) / 2**20
        self.object_store_mb = max(self.object_store_mb, used)
        at = time.time() - self._began
        self.series.append((at, used))
        self.files.append((at, self._output_files()))
        self.spilled_mb = max(self.spilled_mb, m.get("ray_spill_manager_objects_bytes", 0.0) / 2**20)
        requests = m.get("ray_spill_manager_request_total", 0.0)
        if self.spill_requests_at_start is None:
            self.spill_requests_at_start = requests
        self.spill_requests = requests - self.spill_requests_at_start

    def _output_files(self) -> int:
        # Written into the generation's folder while the job runs, moved to the top level when it publishes.
        return sum(1 for _ in self.output_uri.glob("_generations/*/outputs/part-*")) + sum(
            1 for _ in self.output_uri.glob("part-*")
        )

    def _sample_outputs(self) -> None:
        if self.first_output_at is None and any(self.output_uri.glob("_generations/*/outputs/part-*")):
            self.first_output_at = time.time()

    def peaks(self) -> dict[str, float | None]:
        return {
            "driver_peak_mb": round(self.driver_mb, 1),
            "worker_peak_mb": round(self.worker_mb, 1),
            "object_store_peak_mb": round(self.object_store_mb, 1),
            "spilled_mb": round(self.spilled_mb, 1),
            "output_files": self._output_files(),
        }

    def object_store_series(self, job_start: float, points: int = SERIES_POINTS) -> list[list[float]]:
        """The object store's use over the job, as at most `points` (seconds after the job's start, MB) pairs:
        the highest sample of each equal slice of the job, so no peak is smoothed away."""
        samples = [(self._began + t - job_start, mb) for t, mb in self.series]
        if not samples:
            return []
        span = max(samples[-1][0] - samples[0][0], 1e-9)
        slices: dict[int, tuple[float, float]] = {}
        for t, mb in samples:
            k = min(int((t - samples[0][0]) / span * points), points - 1)
            if k not in slices or mb > slices[k][1]:
                slices[k] = (t, mb)
        return [[round(t, 1), round(mb, 2)] for t, mb in (slices[k] for k in sorted(slices))]

    def output_files_series(self, job_start: float, points: int = SERIES_POINTS) -> list[list[float]]:
        """Output files on disk over the job, at most `points` evenly spaced (seconds after the job's start,
        files) pairs: a pace that fell as the job went on shows as a bending line."""
        step = max(1, len(self.files) // points)
        return [[round(self._began + t - job_start, 1), n] for t, n in self.files[::step]]

    def driver_memory_series(self, job_start: float, points: int = SERIES_POINTS) -> list[list[float]]:
        """The driver's (seconds after the job's start, RSS MB, anonymous MB) over the job, at most `points`
        evenly spaced samples."""
        step = max(1, len(self.driver_memory) // points)
        return [
            [round(self._began + t - job_start, 1), round(rss, 1), round(anon, 1)]
            for t, rss, anon in self.driver_memory[::step]
        ]

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        tick = 0
        started = time.time()
        while not self._stop.is_set():
            self._sample_memory(me)
            self._sample_outputs()
            if tick % RAY_METRICS_TICKS == 0:
                self._sample_ray()
            if tick and tick % PROGRESS_TICKS == 0:  # a long size leaves its peaks so far in the log
                print(
                    f"scale progress {json.dumps({'elapsed_s': round(time.time() - started), **self.peaks()})}",
                    flush=True,
                )
            tick += 1
            time.sleep(0.2)
        self._sample_ray()

    def __enter__(self) -> Watch:
        self._sample_ray()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def worker_processes(info: Any, start_ms: float, end_ms: float) -> int:
    """How many worker processes Ray started while the job ran (alive or gone), from Ray's state API; the
    bench's cluster runs one job at a time. A raylet that kills idle workers and starts new ones for the next
    tasks shows here as a count that grows with the job's length."""
    from airflow_provider_rayllm.local.cluster import LocalRayCluster

    return sum(
        1
        for w in LocalRayCluster.state_list(info, "workers", timeout=30)
        if w.get("worker_type") == "WORKER" and start_ms <= (w.get("worker_launch_time_ms") or 0) <= end_ms
    )


def git_commit() -> str | None:
    import subprocess

    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or None


def write_rows(path: Path, n: int) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    with pq.ParquetWriter(path, pa.schema([("id", pa.int64()), ("prompt", pa.string())])) as writer:
        for start in range(0, n, 100_000):
            ids = range(start, min(n, start + 100_000))
            writer.write_table(
                pa.table({"id": pa.array(ids, pa.int64()), "prompt": [f"row {i}: say ok" for i in ids]}),
                row_group_size=50_000,
            )
    return str(path)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="100000,1000000,4000000")
    parser.add_argument("--actors", type=int, default=1)
    parser.add_argument("--in-flight", type=int, help="max_in_flight (default: the operator's)")
    parser.add_argument("--batch-size", type=int, help="batch_size (default: the operator's)")
    parser.add_argument(
        "--window-mb",
        type=int,
        help="object_store_window_mb, the rows in flight's share of the store (default: unset, Ray Data's own share)",
    )
    parser.add_argument(
        "--add-to",
        type=Path,
        help="an earlier result of the same settings: its sizes are kept beside this run's (each point says its run)",
    )
    parser.add_argument("--prefix-window-rows", type=int, help="prefix_window_rows (default: the operator's; 0 = off)")
    parser.add_argument(
        "--out",
        type=Path,
        help="write the result here instead of benchmarks/results/<date>-scale<settings>.json (an experiment's run)",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    window = args.window_mb or None  # unset or 0: Ray Data's own share of the store
    chosen = {
        "batch_size": args.batch_size,
        "max_in_flight": args.in_flight,
        "object_store_window_mb": window,
        "prefix_window_rows": args.prefix_window_rows,
    }
    chosen = {k: v for k, v in chosen.items() if v is not None}
    run = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": git_commit()}
    earlier = json.loads(args.add_to.read_text()) if args.add_to else None

    home = bench_home("scale")

    import ray

    from airflow_provider_rayllm.hooks.ray_job import RayJobHook
    from airflow_provider_rayllm.local.cluster import LocalRayCluster
    from airflow_provider_rayllm.operators.http_batch import HttpLLMBatchOperator
    from tests.integration.helpers import StandInTI
    from tests.integration.services import echo_server

    defaults = {k: p.default for k, p in inspect.signature(HttpLLMBatchOperator.__init__).parameters.items()}
    batch_size = chosen.get("batch_size", defaults["batch_size"])
    in_flight = chosen.get("max_in_flight", defaults["max_in_flight"])

    cluster = LocalRayCluster(state_dir=home / "ray", num_cpus=2, object_store_memory=OBJECT_STORE_BYTES)
    info = cluster.start()
    metrics_port = info.ports[5]
    points = []
    try:
        os.environ["AIRFLOW_CONN_RAY_SCALE"] = info.airflow_conn_uri()
        hook = RayJobHook(ray_conn_id="ray_scale")
        for n in sizes:
            # A fresh endpoint for each size, keeping no count per prompt: the server carries nothing from one
            # size to the next, nor grows with the rows it answered.
            with echo_server(0.0, LOG_DIR, count=False) as url:
                os.environ["AIRFLOW_CONN_LLM_SCALE"] = json.dumps({"conn_type": "http", "host": f"{url}/v1"})
                input_uri = write_rows(home / "in" / f"{n}.parquet", n)
                output_uri = home / "out" / str(n)
                op = HttpLLMBatchOperator(
                    task_id=f"scale_{n}",
                    ray_conn_id="ray_scale",
                    http_conn_id="llm_scale",
                    model="echo",
                    input_uri=input_uri,
                    output_uri=str(output_uri),
                    prompt_column="prompt",
                    keep_columns=["id"],
                    concurrency=args.actors,
                    **chosen,
                    deferrable=False,
                    poll_interval=1.0,
                )
                with Watch(metrics_port, output_uri) as watch:
                    started = time.time()
                    manifest = op.execute({"ti": StandInTI("scale_bench", f"manual__{n}", op.task_id)})
                    seconds = time.time() - started
                assert manifest["rows_out"] == n and manifest["rows_errored"] == 0, {
                    k: manifest[k] for k in ("rows_in", "rows_out", "rows_errored")
                }
                job = hook.get_job_info(manifest["submission_id"]) or {}
                job_start, job_end = float(job["start_time"]) / 1000, float(job["end_time"]) / 1000
                point = {
                    "rows": n,
                    "seconds": seconds,
                    "rows_per_s": n / seconds,
                    "job_s": job_end - job_start,
                    "driver_s": manifest["wall_time_s"],
                    "driver_peak_mb": watch.driver_mb,
                    "worker_peak_mb": watch.worker_mb,
                    "object_store_peak_mb": watch.object_store_mb,
                    "spilled_mb": watch.spilled_mb,
                    "spill_requests": watch.spill_requests,
                    "first_output_s": None if watch.first_output_at is None else watch.first_output_at - job_start,
                    "first_output_s_manifest": manifest.get("first_output_s"),
                    "output_files": len(manifest["output_files"]),
                    "worker_processes": worker_processes(info, float(job["start_time"]), float(job["end_time"])),
                    "object_store_series": watch.object_store_series(job_start),
                    "output_files_series": watch.output_files_series(job_start),
                    # [seconds after the job's start, RSS MB, anonymous MB]
                    "driver_memory_series": watch.driver_memory_series(job_start),
                    "run": run,
                }
                points.append(point)
                print(json.dumps({k: v for k, v in point.items() if not k.endswith("_series")}), flush=True)
    finally:
        cluster.stop()

    settings = {
        "actors": args.actors,
        "in_flight": in_flight,
        "batch_size": batch_size,
        "object_store_mb": OBJECT_STORE_BYTES // 2**20,
        "object_store_window_mb": window,
        "prefix_window_rows": chosen.get("prefix_window_rows"),
    }
    if earlier is not None:
        # A result written before --prefix-window-rows existed ran with the operator's default.
        if {"prefix_window_rows": None, **earlier["settings"]} != settings:
            raise SystemExit(f"--add-to: {args.add_to} ran with {earlier['settings']}, this run with {settings}")
        mine = {p["rows"] for p in points}
        points = sorted([p for p in earlier["scale"] if p["rows"] not in mine] + points, key=lambda p: p["rows"])
    marginal = []
    for a, b in zip(points, points[1:]):
        marginal.append(
            {"from": a["rows"], "to": b["rows"], "rows_per_s": (b["rows"] - a["rows"]) / (b["seconds"] - a["seconds"])}
        )
    tag = "".join(f"-{SHORT[k]}{v}" for k, v in chosen.items())
    out = args.out or REPO / "benchmarks" / "results" / f"{date.today().isoformat()}-scale{tag}.json"
    results = {
        "date": date.today().isoformat(),
        "description": (
            f"HttpLLMBatchOperator, {args.actors} actor(s) x {in_flight} requests in flight, batch_size "
            f"{batch_size}, object_store_window_mb {window or 'unset'}, against a local chat endpoint that answers at once "
            f"(client and server share the 2 cores), Ray head object store capped at {OBJECT_STORE_BYTES // 2**20} MiB; rows/s from task start to "
            "manifest, engine-free, so the figures are the pipeline's own cost."
        ),
        "settings": settings,
        "runs": [dict(r) for r in sorted({tuple(sorted(p["run"].items())) for p in points if p.get("run")})],
        "scale": points,
        "marginal": marginal,
        "versions": {"ray": ray.__version__},
    }
    if len(points) >= 2:
        small, large = points[0], points[-1]
        results["checks"] = {
            "spilled_mb_max": max(p["spilled_mb"] for p in points),
            "object_store_peak_ratio": large["object_store_peak_mb"] / max(small["object_store_peak_mb"], 1e-9),
            "driver_peak_ratio": large["driver_peak_mb"] / max(small["driver_peak_mb"], 1e-9),
            "first_output_share_at_largest": (large["first_output_s"] or large["job_s"]) / large["job_s"],
        }
        if len(marginal) >= 2:
            results["checks"]["marginal_rate_change"] = marginal[-1]["rows_per_s"] / marginal[0]["rows_per_s"] - 1
    if earlier is not None and earlier.get("notes"):
        results["notes"] = earlier["notes"]  # the earlier run's hand-written notes stay with its points
    out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results.get("checks")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
