"""`airflow backfill create` on a real Airflow: `airflow standalone` (scheduler, DAG processor, triggerer,
API server, LocalExecutor) in its own home and PostgreSQL database, running tests/dags_backfill/rayllm_backfill.py against the
local Ray cluster and the echo endpoint.

A backfill over two dates gives two outputs, each in its own run's prefix with only its own date's
rows; a second backfill over the same dates (reprocessing completed runs) replaces each output with a
new generation instead of adding rows. The real task logs show the job's progress lines.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tests.integration.helpers import read_rows, write_jsonl
from tests.integration.services import echo_server

pytestmark = pytest.mark.integration

DAG_ID = "rayllm_backfill"
DATES = ["2026-07-01", "2026-07-02"]
DAG_FILE = Path(__file__).resolve().parents[1] / "dags_backfill" / "rayllm_backfill.py"


def _rows_for(day: str) -> list[dict]:
    return [{"id": f"{day}-{i}", "prompt": f"{day} question {i}"} for i in range(5)]


class Stack:
    """One `airflow standalone` and the CLI against its database. The waits read the metadata database itself:
    polling with the CLI every 3 s started an Airflow process each time (about 4 CPU-seconds apiece, some 30
    of them a run, on the 2 cores the standalone's scheduler and tasks need)."""

    def __init__(self, home: Path, env: dict[str, str], log: Path):
        self.home, self.env, self.log = home, env, log
        self.proc: subprocess.Popen | None = None
        self._conn: Any = None
        self.dsn = env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].replace("postgresql+psycopg2://", "postgresql://", 1)

    def query(self, sql: str, *params: str) -> list[tuple]:
        """Rows of one statement, on a connection kept open between polls (each statement its own
        transaction, so every poll sees what the scheduler committed since)."""
        import psycopg2

        if self._conn is None or self._conn.closed:
            self._conn = psycopg2.connect(self.dsn)
            self._conn.autocommit = True
        with self._conn.cursor() as cur:
            cur.execute(sql, params)
            return list(cur.fetchall())

    def cli(self, *args: str, timeout: float = 300) -> str:
        airflow = str(Path(sys.executable).with_name("airflow"))
        done = subprocess.run([airflow, *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise AssertionError(
                f"airflow {' '.join(args)} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
            )
        return done.stdout

    def start(self, port: int, timeout: float = 300) -> None:
        import urllib.request

        airflow = str(Path(sys.executable).with_name("airflow"))
        out = open(self.log, "w")
        self.proc = subprocess.Popen(
            [airflow, "standalone"], env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.time() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v2/monitor/health", timeout=5) as resp:
                    health = json.loads(resp.read())
                if all(
                    (health.get(k) or {}).get("status") == "healthy"
                    for k in ("metadatabase", "scheduler", "triggerer", "dag_processor")
                ):
                    return
            except (OSError, ValueError):
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                raise AssertionError(
                    f"airflow standalone did not become healthy; log: {self.log}\n{self.log.read_text()[-3000:]}"
                )
            time.sleep(2)

    def stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self.proc is None:
            return
        import signal

        # standalone's components share its process group; some outlive a SIGTERM to standalone itself,
        # so whatever is left of the group after a grace period is killed.
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(5)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def runs(self) -> list[dict]:
        out = self.cli("dags", "list-runs", DAG_ID, "-o", "json")
        # (warnings may be printed before the JSON; the runs are the line that parses as a list)
        for line in reversed(out.splitlines()):
            if line.startswith("[{") or line.strip() == "[]":
                return json.loads(line)
        return []

    def wait_for_runs(self, count: int, timeout: float = 600) -> list[dict]:
        """The backfill's runs once ``count`` of them have ended (waited for in the database), as the CLI lists them."""
        deadline = time.time() + timeout
        while True:
            found = self.query("SELECT run_id, state FROM dag_run WHERE dag_id = %s", DAG_ID)
            ended = [(r, s) for r, s in found if r.startswith("backfill__")]
            if len(ended) >= count and all(s in ("success", "failed") for _, s in ended):
                break
            if time.time() > deadline:
                raise AssertionError(f"backfill runs not finished within {timeout:.0f} s: {ended}; log: {self.log}")
            time.sleep(3)
        return [r for r in self.runs() if r["run_id"].startswith("backfill__")]


@pytest.fixture(scope="module")
def airflow_database(postgres_dsn):
    """A database of its own on the machine's PostgreSQL for the standalone Airflow's metadata. SQLite, with
    the scheduler and the CLI writing at once, failed in CI with "database is locked" even when told to wait
    a minute: two writers that both hold a read lock cannot wait for each other."""
    import uuid

    import psycopg2

    name = f"airflow_backfill_{uuid.uuid4().hex[:8]}"
    admin = psycopg2.connect(postgres_dsn)
    admin.autocommit = True
    admin.cursor().execute(f"CREATE DATABASE {name}")
    try:
        yield postgres_dsn.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg2://", 1) + f"/{name}"
    finally:
        admin.cursor().execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()


@pytest.fixture(scope="module")
def stack(ray_conn, test_home, service_logs, airflow_database):
    from airflow_provider_rayllm.local.cluster import free_port

    home = test_home / "standalone"
    shutil.rmtree(home, ignore_errors=True)
    dags = home / "dags"
    dags.mkdir(parents=True)
    shutil.copy(DAG_FILE, dags / DAG_FILE.name)
    inputs = test_home / "inputs" / "backfill"
    for day in DATES:
        write_jsonl(inputs / f"{day}.jsonl", _rows_for(day))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__")}
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": airflow_database,
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "4",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(port),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
            # A task's first call to the API server (marking it running) took 39 s in CI, with both cores busy;
            # at Airflow's default of 5 s the task timed out, its retry was refused (already running) and the
            # task failed before it started. Airflow's advice for high load: a longer timeout.
            "AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT": "120",
            "RAYLLM_BACKFILL_INPUTS": str(inputs),
            # standalone starts its components as `airflow ...` subprocesses found on PATH
            "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        }
    )
    with echo_server(0.2, service_logs) as echo:
        env["AIRFLOW_CONN_LLM_ECHO"] = json.dumps({"conn_type": "http", "host": f"{echo}/v1"})
        s = Stack(home, env, service_logs / "airflow-standalone.log")
        s.echo = echo
        try:
            s.start(port)
            deadline = time.time() + 180
            while not s.query("SELECT 1 FROM serialized_dag WHERE dag_id = %s", DAG_ID):
                if time.time() > deadline:
                    raise AssertionError(f"{DAG_ID} was never parsed; log: {s.log}")
                time.sleep(3)
            assert DAG_ID in s.cli("dags", "list", "-o", "plain"), "the CLI lists the DAG the processor parsed"
            yield s
        finally:
            s.stop()


def _manifests(output_base: Path) -> dict[str, dict]:
    """Each published manifest under the DAG's prefix, by logical date (from the run id)."""
    found = {}
    for path in sorted((output_base / DAG_ID).glob("*/answer/_manifest.json")):
        manifest = json.loads(path.read_text())
        run = path.parent.parent.name
        day = next(d for d in DATES if d in run)
        found[day] = manifest
    return found


def _task_log(home: Path, run_id: str) -> str:
    logs = list((home / "logs").rglob("*.log"))
    return "\n".join(p.read_text(errors="replace") for p in logs if "rayllm_backfill" in str(p) and run_id in str(p))


@pytest.fixture(scope="module")
def first_backfill(stack, ray_conn):
    stack.cli("backfill", "create", "--dag-id", DAG_ID, "--from-date", DATES[0], "--to-date", DATES[-1])
    runs = stack.wait_for_runs(len(DATES))
    return {"runs": runs, "manifests": _manifests(ray_conn["output_base"])}


def test_backfill_gives_one_output_per_date_in_its_own_prefix(first_backfill, ray_conn):
    runs, manifests = first_backfill["runs"], first_backfill["manifests"]
    assert sorted(r["state"] for r in runs) == ["success"] * len(DATES), runs
    assert sorted(manifests) == DATES
    prefixes = {m["output_uri"] for m in manifests.values()}
    assert len(prefixes) == len(DATES), "each logical date has its own prefix"
    for day, manifest in manifests.items():
        assert manifest["rows_in"] == manifest["rows_out"] == 5 and manifest["rows_errored"] == 0
        rows = read_rows(manifest["output_files"])
        assert sorted(r["id"] for r in rows) == [f"{day}-{i}" for i in range(5)], "only this date's rows"
        assert all(r["response"] == f"echo: {r['prompt']}" for r in rows)


def test_the_task_log_shows_the_jobs_progress(first_backfill, stack):
    run_id = first_backfill["runs"][0]["run_id"]
    log = _task_log(stack.home, run_id)
    assert "Submitted Ray job" in log, f"no task log found for {run_id}"
    assert "Progress: 5/5 rows done (100% of the rows read so far)" in log


def test_a_second_backfill_over_the_same_dates_replaces_never_duplicates(first_backfill, stack, ray_conn):
    before = first_backfill["manifests"]
    # The scheduler marks the first backfill complete a moment after its runs end; until then Airflow
    # refuses a second one for the DAG ("Another backfill is running").
    deadline = time.time() + 120
    while stack.query("SELECT 1 FROM backfill WHERE dag_id = %s AND completed_at IS NULL", DAG_ID):
        if time.time() > deadline:
            break  # the create below says why
        time.sleep(2)
    while True:
        try:
            stack.cli(
                "backfill",
                "create",
                "--dag-id",
                DAG_ID,
                "--from-date",
                DATES[0],
                "--to-date",
                DATES[-1],
                "--reprocess-behavior",
                "completed",
            )
            break
        except AssertionError as exc:
            if "Another backfill is running" not in str(exc) or time.time() > deadline:
                raise
            time.sleep(3)
    deadline = time.time() + 600
    while True:
        after = _manifests(ray_conn["output_base"])
        changed = [d for d in DATES if after.get(d, {}).get("submission_id") != before[d]["submission_id"]]
        if len(changed) == len(DATES):
            break
        if time.time() > deadline:
            raise AssertionError(f"the second backfill did not republish every date (changed: {changed})")
        time.sleep(3)
    stack.wait_for_runs(len(DATES))
    runs = [r for r in stack.runs() if r["run_id"].startswith("backfill__")]
    assert len(runs) == len(DATES), "the second backfill reran the same runs, it did not add runs"
    for day in DATES:
        manifest = after[day]
        assert manifest["output_uri"] == before[day]["output_uri"], "same prefix as the first backfill"
        rows = read_rows(manifest["output_files"])
        assert sorted(r["id"] for r in rows) == [f"{day}-{i}" for i in range(5)], "replaced, not appended"
        generations = Path(manifest["output_uri"]) / "_generations"
        assert not list(generations.iterdir()), "the published generation's files moved to the prefix"
        assert pq.read_table(manifest["output_uri"]).num_rows == 5, "the prefix reads as this date's rows once"
    # A finished run run again computes its rows again (its input may have changed): the id column
    # resumes only attempts that never published.
    import urllib.request

    with urllib.request.urlopen(f"{stack.echo}/stats") as resp:
        stats = json.loads(resp.read())
    requests = stats["requests"]
    for day in DATES:
        for row in _rows_for(day):
            assert requests.get(row["prompt"], 0) >= 2, f"{row['prompt']!r} was not sent again"
