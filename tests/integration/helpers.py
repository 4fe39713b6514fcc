"""Helpers for tests on the real local stack."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

# The CPU engine's kernels are not batch-invariant: at temperature 0 an answer can change with the
# requests it shares a step with, or with a prefix read from the cache. One request at a time and no
# prefix cache make greedy answers reproducible, which the tests that compare two runs rely on.
# The same runs also carry the guide's memory FAQ levers, which test_the_memory_faq_levers_reach_the_engine
# reads back from the quickstart run's job log (one engine start serves both).
REPRODUCIBLE_ENGINE = {
    "max_model_len": 1024,
    "max_num_seqs": 1,
    "enable_prefix_caching": False,
    "max_num_batched_tokens": 2048,
    "gpu_memory_utilization": 0.15,
    "block_size": 32,
    # The guide's model-loading section: load_format reaches the engine as given.
    "load_format": "safetensors",
}


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def read_rows(files: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for f in files:
        rows.extend(pq.read_table(f["uri"]).to_pylist())
    return rows


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=timezone.utc)


def xcom(dag_id: str, run_id: str, task_id: str, key: str) -> Any:
    """A value the task pushed, read from the metadata database as Airflow stores it."""
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        row = session.scalars(
            select(XComModel).where(
                XComModel.dag_id == dag_id,
                XComModel.run_id == run_id,
                XComModel.task_id == task_id,
                XComModel.key == key,
            )
        ).first()
        if row is None:
            return None
        return row.value


def delete_runs(dag_id: str) -> None:
    """Forget a DAG's runs, as clearing them in the UI would, so dag.test() runs the same run id again."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import delete

    with create_session() as session:
        session.execute(delete(DagRun).where(DagRun.dag_id == dag_id))


def task_state(dag_run: Any, task_id: str) -> str:
    return str(dag_run.get_task_instance(task_id).state)


def assert_succeeded(dag_run: Any, *task_ids: str, context: str = "") -> None:
    """Each task succeeded; if one did not, the failure names why: the state of every task asked for and,
    for each Ray job of the run, its status, message and the end of its log (a CI summary keeps only the
    assertion, not the task's captured log)."""
    states = {task_id: task_state(dag_run, task_id) for task_id in task_ids}
    if all(state == "success" for state in states.values()):
        return
    raise AssertionError(f"{context} tasks {states}\n" + ray_jobs_report(dag_run.run_id))


def ray_jobs_report(run_id: str, tail: int = 25) -> str:
    from airflow_provider_rayllm.hooks.ray_job import RayJobHook

    try:
        hook = RayJobHook()
        jobs = jobs_of_run(hook, run_id)
    except Exception as exc:  # the report must not hide the assertion it explains
        return f"(the Ray jobs could not be listed: {exc!r})"
    parts = [f"{len(jobs)} Ray job(s) for run {run_id}"]
    for job in jobs:
        message = (job.message or "").splitlines()[:1]  # Ray's message repeats the log's end after its line
        parts.append(f"--- {job.submission_id}: {job.status} {' '.join(message)}".rstrip())
        try:
            lines = hook.get_job_logs(job.submission_id).splitlines()
        except Exception as exc:
            lines = [f"(no log: {exc!r})"]
        # The first distinct error lines: a root cause (an engine core's) comes before the errors it causes,
        # and those repeat to the end of the log.
        errors = [line for line in lines[:-tail] if line.startswith("RAYLLM_ERROR") or "Error" in line]
        parts.extend(list(dict.fromkeys(errors))[:10] + lines[-tail:])
    return "\n".join(parts)


def jobs_with_prefix(hook: Any, prefix: str) -> list[dict[str, Any]]:
    return [
        j.dict() if hasattr(j, "dict") else j
        for j in hook.client.list_jobs()
        if (j.submission_id or "").startswith(prefix)
    ]


def ray_driver_env(ray_conn: dict[str, Any], test_home: Path) -> dict[str, str]:
    """The environment for a process of ours that connects to the session's Ray cluster as a driver."""
    from airflow_provider_rayllm.local.cluster import LocalRayCluster

    env = LocalRayCluster(state_dir=test_home / "ray").env()
    env["RAY_ADDRESS"] = ray_conn["info"].gcs_address
    return env


def jobs_of_run(hook: Any, run_id: str) -> list[Any]:
    """The Ray jobs submitted for one Airflow run (the operator tags each with its run id)."""
    return [j for j in hook.client.list_jobs() if (j.metadata or {}).get("airflow_run_id") == run_id]


class StandInTI:
    """The parts of a task instance the operator uses, for driving execute() from a thread."""

    def __init__(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1, try_number: int = 1):
        self.dag_id, self.run_id, self.task_id, self.map_index, self.try_number = (
            dag_id,
            run_id,
            task_id,
            map_index,
            try_number,
        )
        self.xcom: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcom[key] = value

    def xcom_pull(self, task_ids: str | None = None, key: str = "return_value", **_: Any) -> Any:
        return self.xcom.get(key)


class ClearedRun:
    """The ``dag_run`` of a task's context after a user cleared the run ``clear_number`` times."""

    def __init__(self, clear_number: int):
        self.clear_number = clear_number


def load_dag(folder: str, file_name: str, dag_id: str) -> Any:
    """A fresh DAG object from its file, as a worker parses it for each task run.

    dag.test() runs tasks in this process and renders templates onto the task objects, so reusing one
    DAG object across runs would carry the previous run's rendered values into the next.
    """
    import importlib.util

    path = Path(__file__).resolve().parents[2] / folder / f"{file_name}.py"
    spec = importlib.util.spec_from_file_location(f"_rayllm_dag_{file_name}_{time.monotonic_ns()}", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return next(v for v in vars(module).values() if getattr(v, "dag_id", None) == dag_id and hasattr(v, "test"))


FIGURES_FILE = Path(__file__).resolve().parents[2] / "build" / "reliability-figures.json"


# The scenarios recorded in this process, in order (a fixture merges its figures into those of the test it wraps).
RECORDED: list[str] = []


def record_figure(scenario: str, *, merge: bool = False, **figures: Any) -> None:
    """Keep what a fault-injection test measured (docs/RELIABILITY.md quotes these) in build/; ``merge`` adds
    the figures to those already kept for the scenario."""
    import fcntl

    FIGURES_FILE.parent.mkdir(parents=True, exist_ok=True)
    # Both pytest-xdist workers record: one writer at a time, or a figure written beside another is lost.
    with open(FIGURES_FILE.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        current = json.loads(FIGURES_FILE.read_text()) if FIGURES_FILE.exists() else {}
        kept = current.get(scenario, {}) if merge else {}
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        current[scenario] = {**kept, **figures, "measured_at": now}
        temporary = FIGURES_FILE.with_suffix(".tmp")
        temporary.write_text(json.dumps(current, indent=2, sort_keys=True))
        temporary.replace(FIGURES_FILE)
    if not merge:
        RECORDED.append(scenario)


def canaries_in(data: bytes, canaries: dict[str, str]) -> list[str]:
    """The names of the canaries found in ``data`` (a zip's members opened: Ray's packages are compressed)."""
    import io
    import zipfile

    found = [name for name, secret in canaries.items() if secret.encode() in data]
    if data[:4] == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                for member in archive.namelist():
                    found += [f"{member} in zip: {n}" for n in canaries_in(archive.read(member), canaries)]
        except zipfile.BadZipFile:
            pass
    return found


def files_holding(info: Any, canaries: dict[str, str]) -> list[str]:
    """Every file under every node's Ray temp dir that holds a canary."""
    roots = [Path(info.temp_dir)] + [Path(n["temp_dir"]) for n in info.worker_nodes or []]
    found = []
    for root in roots:
        for path in root.rglob("*"):
            try:
                if not path.is_file() or path.is_symlink() or path.stat().st_size > 200_000_000:
                    continue
                data = path.read_bytes()
            except OSError:  # a socket, or a file removed while we walk
                continue
            found += [f"{path}: {name}" for name in canaries_in(data, canaries)]
    return found


_STORE_SCAN = """
import json, sys
import ray
from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list
sys.path.insert(0, sys.argv[3])
from tests.integration.helpers import canaries_in
ray.init(address=sys.argv[1], log_to_driver=False)
canaries = json.loads(sys.argv[2])
found, keys = [], _internal_kv_list("gcs://")
for key in keys:
    found += [f"{key.decode()}: {name}" for name in canaries_in(_internal_kv_get(key) or b"", canaries)]
counted = sorted({k.decode().split("/", 1)[0] for k in _internal_kv_list("", namespace="rayllm_counts")})
print(json.dumps({"packages": len(keys), "found": found, "counted_jobs": counted}))
"""


def driver_env(info: Any) -> dict[str, str]:
    """The environment of a Ray driver on this machine that connects to the cluster ``info`` describes."""
    import os

    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=info.token_file)
    env.pop("RAY_AUTH_TOKEN", None)
    return env


def store_holding(info: Any, canaries: dict[str, str]) -> dict[str, Any]:
    """The packages in the cluster's store (Ray's internal KV) that hold a canary: ``{"packages", "found"}``, and
    the Ray job ids that have stream counts there (``counted_jobs``)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _STORE_SCAN, info.gcs_address, json.dumps(canaries), str(Path(__file__).parents[2])],
        capture_output=True,
        text=True,
        env=driver_env(info),
        timeout=120,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_in_thread(op: Any, ti: Any) -> tuple[Any, dict[str, Any]]:
    """Start op.execute() as a worker would (non-deferred); the dict gets 'result' or 'error'."""
    import threading

    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = op.execute({"ti": ti})
        except BaseException as exc:  # noqa: BLE001 - the test inspects whatever ended the task
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def tasks_named(info: Any, submission_id: str, name: str) -> list[dict[str, Any]]:
    """The job's task records (one per attempt) whose name holds ``name``, from the cluster's state API."""
    import urllib.request

    from airflow_provider_rayllm.hooks.ray_job import RayJobHook

    job_id = RayJobHook().client.get_job_info(submission_id).job_id
    query = f"detail=1&limit=10000&filter_keys=job_id&filter_predicates=%3D&filter_values={job_id}"
    request = urllib.request.Request(
        f"{info.dashboard_url}/api/v0/tasks?{query}", headers={"Authorization": f"Bearer {info.token}"}
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        tasks = json.loads(resp.read())["data"]["result"]["result"]
    return [t for t in tasks if name in (t.get("name") or "")]


def most_at_once(info: Any, submission_id: str, name: str, timeout: float = 30.0) -> tuple[int, int]:
    """How many of the job's tasks named ``name`` ran at the same moment at most, and how many ran, from their
    start and end times, once every record has come in (workers report their tasks every second or so)."""
    deadline = time.time() + timeout
    while True:
        tasks = tasks_named(info, submission_id, name)
        if tasks and all(t.get("state") in ("FINISHED", "FAILED") for t in tasks):
            tasks = [t for t in tasks if t.get("start_time_ms") and t.get("end_time_ms")]
            break
        if time.time() > deadline:
            states = sorted((t.get("state"), bool(t.get("start_time_ms")), bool(t.get("end_time_ms"))) for t in tasks)
            raise AssertionError(f"{name!r} tasks of {submission_id} not all ended after {timeout:.0f} s: {states}")
        time.sleep(1.5)
    edges = sorted([(t["start_time_ms"], 1) for t in tasks] + [(t["end_time_ms"], -1) for t in tasks])
    running = most = 0
    for _, step in edges:  # an end before a start at the same millisecond: touching spans do not overlap
        running += step
        most = max(most, running)
    return most, len(tasks)


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.2) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def cpus_in_use(info: Any) -> tuple[float, float]:
    """(CPUs in use, CPUs in all) on the cluster, as its autoscaler report counts them."""
    import urllib.request

    request = urllib.request.Request(
        f"{info.dashboard_url}/api/cluster_status", headers={"Authorization": f"Bearer {info.token}"}
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        usage = json.loads(resp.read())["data"]["clusterStatus"]["loadMetricsReport"]["usage"]
    used, total = usage["CPU"]
    return float(used), float(total)


def check_demo_embeddings(manifest: dict[str, Any], errored: int = 0) -> None:
    """example_embeddings' sample sentences: 384-float unit vectors, each paraphrase pair closer than unrelated
    ones; ``errored`` rows failed (the test's own, not the samples)."""
    import numpy as np

    from airflow_provider_rayllm.local.defaults import DEMO_SENTENCES

    assert manifest["task_type"] == "embed"
    assert manifest["rows_in"] == manifest["rows_out"] + errored and manifest["rows_errored"] == errored
    assert manifest["output_tokens"] == 0 and manifest["input_tokens"] > 0
    by_text = {r["text"]: np.asarray(r["embedding"], dtype=np.float64) for r in read_rows(manifest["output_files"])}
    samples = [json.loads(line)["text"] for line in DEMO_SENTENCES.read_text().splitlines() if line.strip()]
    rows = {i: by_text[text] for i, text in enumerate(samples)}
    for vector in rows.values():
        assert vector.shape == (384,)
        assert abs(np.linalg.norm(vector) - 1.0) < 1e-3

    def cos(a: int, b: int) -> float:
        return float(rows[a] @ rows[b])

    for first, second in ((0, 1), (2, 3), (4, 5)):
        for unrelated in (6, 7):
            assert cos(first, second) > cos(first, unrelated) + 0.1, (first, second, unrelated)


def leaked_into_ray_logs(temp_dir: str, secrets: dict[str, str]) -> list[str]:
    """Ray's log files of a local cluster that contain any of the named secrets, as 'path: name'."""
    leaked = []
    for path in Path(temp_dir).rglob("*"):
        if path.is_file() and "logs" in path.parts and path.stat().st_size < 50_000_000:
            content = path.read_bytes()
            leaked += [f"{path}: {name}" for name, secret in secrets.items() if secret.encode() in content]
    return leaked


@contextlib.contextmanager
def echo_connection(conn_id: str, delay_s: float, log_dir: Path, **conn: Any) -> Iterator[str]:
    """A local chat endpoint echoing each prompt after ``delay_s``, as the Airflow connection ``conn_id``
    (extra connection fields, e.g. ``password``, go in ``conn``); yields its URL."""
    from tests.integration.services import echo_server

    with echo_server(delay_s, log_dir) as url, pytest.MonkeyPatch.context() as patch:
        patch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({"conn_type": "http", "host": f"{url}/v1", **conn}))
        yield url


def echo_operator(conn_id: str, task_id: str, input_uri: str, output_uri: str, **kw: Any) -> Any:
    """HttpLLMBatchOperator on a prompt column against an echo connection, polled in this process."""
    from airflow_provider_rayllm.operators.http_batch import HttpLLMBatchOperator

    settings: dict[str, Any] = dict(
        task_id=task_id,
        http_conn_id=conn_id,
        model="echo",
        input_uri=input_uri,
        output_uri=output_uri,
        prompt_column="prompt",
        deferrable=False,
        poll_interval=0.5,
    )
    settings.update(kw)
    return HttpLLMBatchOperator(**settings)


def png(color: tuple[int, int, int], size: tuple[int, int] = (64, 64)) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


LMMS_SPLIT = "coco2017_cap_val"


def lmms_eval_lite_repo(repo_dir: Path, images: list[bytes], files: int = 1) -> Path:
    """A dataset repo folder shaped like lmms-lab/LMMs-Eval-Lite, the guide's VLM dataset: a README and, under
    its split's folder, Parquet files of rows with an image struct ({bytes, path}), a question and a list of
    answer choices; one row per image, spread over ``files`` files."""
    import pyarrow as pa

    split = repo_dir / LMMS_SPLIT
    split.mkdir(parents=True, exist_ok=True)
    (repo_dir / "README.md").write_text("Rows shaped like LMMs-Eval-Lite's, for tests.\n")
    per_file = -(-len(images) // files)
    for n in range(files):
        ids = range(n * per_file, min(len(images), (n + 1) * per_file))
        table = pa.table(
            {
                "question_id": list(ids),
                "question": [f"What color is picture {i}?" for i in ids],
                "answer": [["red", "blue", "green"] for _ in ids],
                "image": [{"bytes": images[i], "path": f"{i}.png"} for i in ids],
            }
        )
        pq.write_table(table, split / f"part-{n:04d}.parquet")
    return repo_dir
