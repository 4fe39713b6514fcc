"""Fault injection on the local stack: a worker killed mid-job, the Ray head restarted mid-job, the Jobs
API unreachable for 20 s while a deferred task waits. The batch calls a slow local chat endpoint (the
HTTP operator), so each scenario runs a real Ray job for tens of seconds without starting an engine.

Each test keeps its figures in build/reliability-figures.json; docs/RELIABILITY.md quotes them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.parse
import urllib.request
import uuid

import psutil
import pyarrow.parquet as pq
import pytest

from tests.integration.helpers import (
    RECORDED,
    ClearedRun,
    StandInTI,
    assert_succeeded,
    echo_connection,
    echo_operator,
    files_holding,
    load_dag,
    read_rows,
    record_figure,
    run_in_thread,
    store_holding,
    utc,
    wait_for,
    write_jsonl,
    xcom,
)

pytestmark = pytest.mark.integration


def _stats(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/stats", timeout=10) as resp:
        return json.loads(resp.read())


# The endpoint's API key: a canary every job of these tests carries as a secret, looked for on the cluster
# after each test (docs/RELIABILITY.md's "secrets left" column).
API_KEY = f"sk-canary-{uuid.uuid4().hex}"
CANARY = {"endpoint api key": API_KEY}
CLEAN_WAIT_S = 20.0


@pytest.fixture()
def echo(service_logs):
    """A chat endpoint answering each request after 0.5 s, reachable as the `llm_rel` connection (with the
    canary API key)."""
    with echo_connection("llm_rel", 0.5, service_logs, password=API_KEY) as url:
        yield url


@pytest.fixture(autouse=True)
def no_secret_left(request):
    """After each test whose jobs carried the canary key on the session's cluster: every file under the
    nodes' Ray temp dirs and every package in the cluster's store is read for it (allowing a stopped
    driver up to CLEAN_WAIT_S to finish its clean-up); the count is added to the figures the test recorded."""
    first = len(RECORDED)
    yield
    if "echo" not in request.fixturenames or "ray_conn" not in request.fixturenames:
        return
    info = request.getfixturevalue("ray_conn")["info"]
    started = time.monotonic()
    while True:
        left = files_holding(info, CANARY) + store_holding(info, CANARY)["found"]
        if not left or time.monotonic() - started > CLEAN_WAIT_S:
            break
        time.sleep(2)
    for scenario in dict.fromkeys(RECORDED[first:]):
        record_figure(scenario, merge=True, secrets_left=len(left))
    assert not left, f"the endpoint's key is left on the cluster after the test's jobs ended: {left}"


def _http_op(task_id: str, input_uri: str, output_uri: str, **kw):
    settings = dict(sampling_params={"max_tokens": 8}, batch_size=8, max_in_flight=4)
    settings.update(kw)
    return echo_operator("llm_rel", task_id, input_uri, output_uri, **settings)


def _rows(test_home, name: str, n: int) -> str:
    return write_jsonl(
        test_home / "inputs" / f"{name}.jsonl", [{"id": i, "prompt": f"{name} row {i}"} for i in range(n)]
    )


def _cluster_processes(info, title: str) -> list[psutil.Process]:
    """The processes of this session's Ray cluster whose title holds ``title``. The other pytest worker's
    cluster runs the same kinds of processes on this machine, and a test that kills one of those fails that
    worker's test instead."""
    found = []
    for proc in info.processes():
        try:
            if title in f"{proc.name()} {' '.join(proc.cmdline())}":
                found.append(proc)
        except psutil.Error:  # gone meanwhile
            pass
    return found


def _pipeline_workers(info) -> list[psutil.Process]:
    """The Ray worker processes of the HTTP stage (Ray Data names its map actors after the callable)."""
    return _cluster_processes(info, "HttpCaller")


def test_a_killed_pipeline_worker_costs_time_not_rows(ray_conn, echo, test_home):
    n = 96
    op = _http_op("worker_death", _rows(test_home, "death", n), str(test_home / "out" / "death"))
    ti = StandInTI("reliability", "manual__worker_death", "worker_death")
    started = time.time()
    thread, outcome = run_in_thread(op, ti)
    wait_for(lambda: _stats(echo)["total"] >= n // 4 or not thread.is_alive(), 180, "a quarter of the rows to be sent")
    victims = _pipeline_workers(ray_conn["info"])
    assert victims, "no HttpCaller worker process found while the job was sending requests"
    for proc in victims:
        os.kill(proc.pid, signal.SIGKILL)
    killed_at = _stats(echo)["total"]
    thread.join(timeout=300)
    assert "error" not in outcome, f"the job did not survive the worker's death: {outcome.get('error')}"
    manifest = outcome["result"]
    out = read_rows(manifest["output_files"])
    ids = [r["id"] for r in out]
    sent = _stats(echo)
    assert sorted(ids) == list(range(n)), "output ids must be complete and unique"
    assert all(r["response"] == f"echo: death row {r['id']}" for r in out)
    assert manifest["rows_out"] == n and manifest["rows_errored"] == 0
    record_figure(
        "worker_death",
        rows=n,
        workers_killed=len(victims),
        requests_sent_before_kill=killed_at,
        requests_total=sent["total"],
        rows_lost=n - len(set(ids)),
        duplicate_rows=len(ids) - len(set(ids)),
        seconds=round(time.time() - started, 1),
    )


@pytest.fixture()
def restartable_cluster(test_home, monkeypatch):
    """A second local head of our own, so restarting it leaves the session's cluster alone."""
    from airflow_provider_rayllm.local.cluster import LocalRayCluster

    cluster = LocalRayCluster(state_dir=test_home / "ray-restart", num_cpus=2)
    info = cluster.start()
    monkeypatch.setenv("AIRFLOW_CONN_RAY_RESTART", info.airflow_conn_uri())
    yield cluster
    cluster.stop()


def test_a_restarted_head_is_job_lost_and_the_retry_runs_a_new_job(restartable_cluster, echo, test_home):
    from airflow_provider_rayllm.exceptions import RayJobFailed, RayJobLost

    n = 80
    output_uri = str(test_home / "out" / "lost")
    input_uri = _rows(test_home, "lost", n)
    op = _http_op("lost", input_uri, output_uri, ray_conn_id="ray_restart")
    ti = StandInTI("reliability", "manual__lost", "lost")
    thread, outcome = run_in_thread(op, ti)
    wait_for(lambda: _stats(echo)["total"] >= 8 or not thread.is_alive(), 180, "the job to start sending")
    first_sid = ti.xcom["submission_id"]
    restarted = time.time()
    restartable_cluster.restart()
    back_after = time.time() - restarted
    thread.join(timeout=120)
    seconds_to_fail = time.time() - restarted
    error = outcome.get("error")
    assert isinstance(error, RayJobLost) and "job lost" in str(error), f"expected a lost job, got {outcome}"
    assert not (test_home / "out" / "lost" / "_manifest.json").exists()

    # Airflow's retry: the same task instance, next try. The cluster forgot the old job, so it is submitted anew.
    retry_ti = StandInTI("reliability", "manual__lost", "lost", try_number=2)
    manifest = _http_op("lost", input_uri, output_uri, ray_conn_id="ray_restart").execute({"ti": retry_ti})
    ids = sorted(r["id"] for r in read_rows(manifest["output_files"]))
    assert ids == list(range(n)) and manifest["rows_out"] == n

    # The head restarts again: the cluster no longer knows the job that published. The same try again (a
    # worker that died after the job ended) returns the published manifest from storage, with no new job.
    restartable_cluster.restart()
    again_ti = StandInTI("reliability", "manual__lost", "lost", try_number=2)
    again_op = _http_op("lost", input_uri, output_uri, ray_conn_id="ray_restart")
    again = again_op.execute({"ti": again_ti})
    assert again["submission_id"] == manifest["submission_id"]
    jobs_after_second_restart = len(again_op.hook.client.list_jobs())
    assert jobs_after_second_restart == 0, "no job was submitted to return what storage already holds"

    # A rerun of the cleared run on this fresh cluster, on an input whose rows all fail: its job starts (Ray's
    # job ids start again at -g0), writes its own generation and fails its error gate. The published output
    # stays as it was, readable, and the manifest still names a folder that exists.
    bad_input = write_jsonl(test_home / "inputs" / "lost-bad.jsonl", [{"id": i, "prompt": None} for i in range(8)])
    rerun_ti = StandInTI("reliability", "manual__lost", "lost", try_number=3)
    rerun = _http_op("lost", bad_input, output_uri, ray_conn_id="ray_restart", max_error_fraction=0.0)
    with pytest.raises(RayJobFailed, match="above max_error_fraction=0.0; nothing was published"):
        rerun.execute({"ti": rerun_ti, "dag_run": ClearedRun(1)})
    assert rerun_ti.xcom["submission_id"].endswith("-g0"), "the fresh cluster numbers its jobs from 0 again"
    published = json.loads((test_home / "out" / "lost" / "_manifest.json").read_text())
    assert published["submission_id"] == manifest["submission_id"]
    kept = sorted(r["id"] for r in read_rows(published["output_files"]))
    assert kept == list(range(n)), "the published output is whole after the failed rerun"
    record_figure(
        "lost_cluster",
        head_restart_seconds=round(back_after, 1),
        seconds_from_restart_to_task_failure=round(seconds_to_fail, 1),
        error=str(error)[:160],
        retry_submission_id=retry_ti.xcom["submission_id"],
        first_submission_id=first_sid,
        retry_rows_out=manifest["rows_out"],
        rows_lost=n - len(set(ids)),
        duplicate_rows=len(ids) - len(set(ids)),
        jobs_submitted_for_a_published_retry_on_a_fresh_cluster=jobs_after_second_restart,
        rows_readable_after_a_failed_rerun_on_a_fresh_cluster=len(kept),
    )


class _Warehouse:
    """The output table's database as a reader sees it: the rows of a run key, the ledger's entries."""

    def __init__(self, dialect: str, uri: str, table: str):
        self.dialect, self.uri, self.table = dialect, uri, table

    def _connect(self):
        import urllib.parse

        if self.dialect == "postgresql":
            import psycopg2

            return psycopg2.connect(self.uri)
        import pymysql

        parts = urllib.parse.urlsplit(self.uri)
        return pymysql.connect(
            host=parts.hostname, port=parts.port or 3306, user=parts.username or "", database=parts.path.lstrip("/")
        )

    def query(self, sql: str, params: tuple = ()) -> list[tuple]:
        conn = self._connect()
        try:
            cur = conn.cursor()
            cur.execute(sql, params)
            found = list(cur.fetchall()) if cur.description else []
            conn.commit()
            return found
        finally:
            conn.close()

    def rows(self, run_key: str) -> list[tuple]:
        return self.query(
            f"SELECT id, response, rayllm_generation FROM {self.table} WHERE rayllm_run_key = %s", (run_key,)
        )

    def ledger(self) -> dict[str, str]:
        from airflow_provider_rayllm.job.sinks.table import LEDGER

        found = self.query(f"SELECT generation, state FROM {LEDGER} WHERE table_name = %s", (self.table,))
        return {generation: state for generation, state in found}

    def staged_exists(self, generation: str) -> bool:
        from airflow_provider_rayllm.job.sinks.table import staged_table

        name = staged_table(self.table, generation)
        found = self.query(
            "SELECT COUNT(*) FROM information_schema.tables WHERE table_name = %s AND table_schema = "
            + ("current_schema()" if self.dialect == "postgresql" else "DATABASE()"),
            (name,),
        )
        return found[0][0] > 0

    def drop(self) -> None:
        from airflow_provider_rayllm.job.sinks.table import LEDGER

        self.query(f"DROP TABLE IF EXISTS {self.table}")
        try:
            self.query(f"DELETE FROM {LEDGER} WHERE table_name = %s", (self.table,))
        except Exception:  # no ledger yet on this database: nothing of this table in it
            pass


@pytest.mark.parametrize("dialect", ["postgresql", "mysql"])
def test_a_crash_between_the_table_and_the_manifest_leaves_them_agreeing_and_the_next_run_both_new(
    ray_conn, echo, test_home, monkeypatch, request, dialect
):
    """A task instance publishes (table and manifest name its generation); then two reruns of it die, one at
    each failpoint (RAYLLM_FAILPOINT ends the driver, as a crash), and a last one succeeds.
    ``after_table_stage``: the rows are staged and the manifest not yet written: the table and the manifest
    both still give the first run's answer. ``after_manifest``: the manifest is written and the table's switch
    not committed (the one window left): the ledger still lists that generation as staged, and the first
    crash's staged generation is gone (no manifest names it). The retry leaves both on its own generation."""
    from airflow_provider_rayllm.exceptions import RayJobFailed
    from airflow_provider_rayllm.hooks.ray_job import RayJobHook
    from airflow_provider_rayllm.job.driver import FAILPOINT_ENV

    uri = request.getfixturevalue("postgres_dsn" if dialect == "postgresql" else "mysql_uri")
    parts = urllib.parse.urlsplit(uri)
    conn_type = "postgres" if dialect == "postgresql" else "mysql"
    monkeypatch.setenv(
        "AIRFLOW_CONN_TABLE_CRASH",
        json.dumps(
            {
                "conn_type": conn_type,
                "host": parts.hostname,
                "port": parts.port,
                "login": parts.username,
                "schema": parts.path.lstrip("/"),
            }
        ),
    )
    n = 24
    table = f"answers_{dialect}_crash_{os.getpid()}"
    warehouse = _Warehouse(dialect, uri, table)
    warehouse.drop()
    output_uri = test_home / "out" / f"table-crash-{dialect}"
    run_id = f"manual__table_crash_{dialect}"
    run_key = f"reliability/{run_id}/table_crash/-1"

    def op(word: str, **kw):
        input_uri = write_jsonl(
            test_home / "inputs" / f"tablecrash-{dialect}.jsonl",
            [{"id": i, "prompt": f"{word} row {i}"} for i in range(n)],
        )
        return _http_op(
            "table_crash", input_uri, str(output_uri), output_table=table, output_table_conn_id="table_crash", **kw
        )

    def manifest() -> dict:
        return json.loads((output_uri / "_manifest.json").read_text())

    def context(try_number: int, cleared: int) -> dict:
        return {
            "ti": StandInTI("reliability", run_id, "table_crash", try_number=try_number),
            "dag_run": ClearedRun(cleared),
        }

    try:
        first = op("first").execute(context(1, 0))
        assert {g for _, _, g in warehouse.rows(run_key)} == {first["generation"]} == {manifest()["generation"]}

        seen: dict[str, dict] = {}
        crashes = []
        for try_number, crash_at in enumerate(("after_table_stage", "after_manifest"), start=2):
            crash = context(try_number, 1)
            with pytest.raises(RayJobFailed):
                op("second", job_runtime_env={"env_vars": {FAILPOINT_ENV: crash_at}}).execute(crash)
            crashed_log = RayJobHook().get_job_logs(crash["ti"].xcom["submission_id"])
            assert f"failpoint {crash_at}" in crashed_log
            after_crash = warehouse.rows(run_key)
            table_says = {g for _, _, g in after_crash}
            manifest_says = manifest()["generation"]
            (crashed,) = [g for g, state in warehouse.ledger().items() if state == "staged"]
            assert crashed not in crashes, "the earlier crash's staged generation was dropped"
            crashes.append(crashed)
            assert sorted(i for i, _, _ in after_crash) == list(range(n)), "the first run's rows, each once"
            if crash_at == "after_table_stage":
                assert table_says == {manifest_says} == {first["generation"]}, "both still give the first answer"
                assert all(r.startswith("echo: first ") for _, r, _ in after_crash)
            else:
                assert manifest_says == crashed != first["generation"], "the manifest names the crashed generation"
                assert table_says == {first["generation"]}, "its switch was rolled back with the driver's connection"
            seen[crash_at] = {
                "table_generation_after_crash": "first" if table_says == {first["generation"]} else "crashed",
                "manifest_generation_after_crash": "first" if manifest_says == first["generation"] else "crashed",
                "table_rows_after_crash": len(after_crash),
            }

        retry = op("second").execute(context(4, 1))
        after = warehouse.rows(run_key)
        assert sorted(i for i, _, _ in after) == list(range(n)), "one row per input row, none twice"
        assert {g for _, _, g in after} == {retry["generation"]} == {manifest()["generation"]}
        assert all(r.startswith("echo: second ") for _, r, _ in after)
        assert warehouse.ledger() == {retry["generation"]: "published"}, "one entry: the generation both name"
        for crashed in crashes:
            assert not warehouse.staged_exists(crashed), "a crashed generation's staging table was dropped"
        assert not warehouse.staged_exists(retry["generation"]), "the published generation's staging table was dropped"
        retry_log = RayJobHook().get_job_logs(retry["submission_id"])
        switched = {at: f"switched in generation {g}" in retry_log for at, g in zip(seen, crashes)}
        assert switched == {"after_table_stage": False, "after_manifest": True}, "only a crash after the manifest"
        for crash_at, figures in seen.items():
            record_figure(
                f"table_manifest_crash_{dialect}_{crash_at}",
                rows=n,
                **figures,
                table_rows_after_retry=len(after),
                rows_from_the_published_generation=sum(g == retry["generation"] for _, _, g in after),
                retry_switched_in_the_crashed_generation_first=switched[crash_at],
            )
    finally:
        warehouse.drop()


def test_two_runs_into_one_prefix_at_once_both_publish_and_the_prefix_reads_as_the_published_one(
    ray_conn, echo, test_home
):
    """Two task instances (run ids that an ASCII mapping would merge) write one fixed output_uri at the same
    time: both finish (neither publish removes the other's generation while its lease is fresh), and the
    prefix reads as the manifest left published, whole."""
    n = 24
    prefix = test_home / "out" / "shared-prefix"
    runs = {}
    for run_id, word in (("manual__résumé", "first"), ("manual__rösümé", "second")):
        op = _http_op("shared", _rows(test_home, word, n), str(prefix))
        ti = StandInTI("reliability", run_id, "shared")
        runs[word] = run_in_thread(op, ti)
    for thread, _ in runs.values():
        thread.join(timeout=300)
    published = json.loads((prefix / "_manifest.json").read_text())
    for word, (_, outcome) in runs.items():
        assert "error" not in outcome, f"{word}: {outcome.get('error')}"
        assert outcome["result"]["rows_out"] == n and outcome["result"]["rows_errored"] == 0
    assert runs["first"][1]["result"]["generation"] != runs["second"][1]["result"]["generation"]
    (winner,) = [w for w, (_, o) in runs.items() if o["result"]["submission_id"] == published["submission_id"]]
    rows = read_rows(published["output_files"])
    assert sorted(r["id"] for r in rows) == list(range(n)), "the published manifest's files are there, whole"
    assert all(r["response"] == f"echo: {winner} row {r['id']}" for r in rows)
    table = pq.read_table(str(prefix)).to_pylist()
    assert sorted(r["id"] for r in table if r["response"].startswith(f"echo: {winner} ")) == list(range(n))
    # Exactly the published rows, unless the two publishes overlapped to the millisecond: then each kept the
    # other's files (never a manifest naming a deleted file) until the next publish.
    assert len(table) in (n, 2 * n)
    assert (prefix / "_SUCCESS").exists()
    record_figure(
        "shared_prefix",
        runs=2,
        rows_each=n,
        generations_left=len(list((prefix / "_generations").iterdir())),
        published_rows=len(rows),
        rows_read_from_the_prefix=len(table),
    )


def test_three_runs_of_one_date_under_new_run_ids_read_as_one_answer(ray_conn, echo, test_home):
    """The new user's sequence: a DAG whose output_uri is ``.../{{ ds }}`` run three times for one date under
    new run ids (``dag.test()``, a manual trigger, a second backfill), each with a changed prompt. A plain
    folder reader of the prefix reads the third run's 10 rows, not 30."""
    n = 10
    prefix = test_home / "out" / "reviews" / "2026-12-01"
    input_uri = _rows(test_home, "reviews", n)
    run_ids = ("manual__2026-12-01T10:00:00", "manual__2026-12-01T11:00:00", "backfill__2026-12-01T00:00:00")
    manifests = []
    for take, run_id in enumerate(run_ids, 1):
        op = _http_op("answer", input_uri, str(prefix), prompt_column=None, prompt_template=f"take {take}: {{prompt}}")
        manifests.append(op.execute({"ti": StandInTI("reviews", run_id, "answer")}))
        assert manifests[-1]["rows_out"] == n
    table = pq.read_table(str(prefix))
    assert table.num_rows == n, f"{table.num_rows} rows read from the prefix for {n} input rows"
    assert sorted(table.column("response").to_pylist()) == sorted(f"echo: take 3: reviews row {i}" for i in range(n))
    assert (prefix / "_SUCCESS").exists()
    published = json.loads((prefix / "_manifest.json").read_text())
    assert published["submission_id"] == manifests[-1]["submission_id"]
    visible = {str(p) for p in prefix.iterdir() if not p.name.startswith(("_", "."))}
    assert visible == {f["uri"] for f in published["output_files"]}, "nothing visible but the published files"
    record_figure(
        "three_runs_one_prefix",
        runs=len(run_ids),
        input_rows=n,
        rows_read_from_the_prefix=table.num_rows,
        success_marker=(prefix / "_SUCCESS").exists(),
    )


def test_a_20_second_dashboard_outage_is_waited_out_by_the_deferred_task(
    ray_conn, airflow_db, echo, test_home, monkeypatch
):
    import threading

    from tests.integration.services import TcpProxy

    info = ray_conn["info"]
    host, port = info.dashboard_url.rsplit("//", 1)[1].split(":")
    proxy = TcpProxy(host, int(port))
    monkeypatch.setenv(
        "AIRFLOW_CONN_RAY_PROXY", json.dumps({"conn_type": "ray", "host": proxy.url, "password": info.token})
    )
    n = 72
    conf = {"input_uri": _rows(test_home, "outage", n), "output_uri": str(test_home / "out" / "outage")}
    outage: dict = {}

    def cut_when_busy() -> None:
        try:
            wait_for(lambda: _stats(echo)["total"] >= 4, 180, "the job to start sending")
            proxy.down()
            outage["start"] = time.time()
            time.sleep(20)
            proxy.up()
            outage["seconds"] = time.time() - outage["start"]
        except Exception as exc:  # reported by the assertions below
            outage["error"] = exc

    cutter = threading.Thread(target=cut_when_busy, daemon=True)
    cutter.start()
    try:
        dag = load_dag("tests/dags", "rayllm_it", "rayllm_it_http_proxy")
        dag_run = dag.test(logical_date=utc(2026, 9, 3), run_after=utc(2026, 9, 3), run_conf=conf)
    finally:
        cutter.join(timeout=60)
        proxy.close()
    assert "error" not in outage and outage.get("seconds", 0) >= 20, outage
    assert_succeeded(dag_run, "call")
    manifest = xcom(dag.dag_id, dag_run.run_id, "call", "return_value")
    assert manifest["rows_out"] == n and manifest["rows_errored"] == 0
    # The job finished while the dashboard was out of reach only if it ended after the outage began.
    record_figure(
        "dashboard_outage",
        outage_seconds=round(outage["seconds"], 1),
        task_state="success",
        rows_out=manifest["rows_out"],
        job_wall_time_s=round(manifest["wall_time_s"], 1),
    )


@pytest.mark.parametrize("how", ["killed while deferred", "execution_timeout while deferred", "killed while polling"])
def test_stopping_the_task_stops_the_job_and_frees_the_cluster(how, ray_conn, echo, test_home):
    """Mark-failed on a deferred task reaches the trigger's on_kill; an execution_timeout while deferred
    resumes the task only to fail it (the triggerer calls no on_kill then); a worker-side kill calls the
    operator's on_kill. Each must leave the job STOPPED and the cluster's CPUs free."""
    import asyncio

    from airflow.sdk.bases.operator import TriggerFailureReason
    from airflow.sdk.exceptions import TaskDeferralTimeout, TaskDeferred

    from airflow_provider_rayllm.hooks.ray_job import RayJobHook
    from tests.integration.helpers import cpus_in_use

    hook = RayJobHook()
    tag = how.split()[0] + ("_timeout" if "timeout" in how else "")
    deferred = "deferred" in how
    op = _http_op(
        f"stop_{tag}", _rows(test_home, f"stop_{tag}", 200), str(test_home / "out" / f"stop_{tag}"), deferrable=deferred
    )
    ti = StandInTI("reliability", f"manual__stop_{tag}", f"stop_{tag}")
    if deferred:
        with pytest.raises(TaskDeferred) as deferral:
            op.execute({"ti": ti})
        trigger = deferral.value.trigger
    else:
        thread, outcome = run_in_thread(op, ti)
        wait_for(lambda: "submission_id" in ti.xcom, 60, "the submission")
    sid = ti.xcom["submission_id"]
    wait_for(lambda: _stats(echo)["total"] >= 8, 180, "the job to start sending")

    stopped_at = time.time()
    if how == "killed while deferred":
        asyncio.run(_kill_as_the_triggerer_does(trigger))
    elif how == "execution_timeout while deferred":
        with pytest.raises(TaskDeferralTimeout):
            op.resume_execution("__fail__", {"error": TriggerFailureReason.TRIGGER_TIMEOUT}, {"ti": ti})
    else:
        op.on_kill()
    wait_for(lambda: hook.get_job_info(sid)["status"] == "STOPPED", 30, "the job to be STOPPED")
    seconds_to_stopped = time.time() - stopped_at
    wait_for(lambda: cpus_in_use(ray_conn["info"])[0] == 0, 60, "the cluster's CPUs to be free", interval=0.5)
    seconds_to_free = time.time() - stopped_at
    if not deferred:
        thread.join(timeout=60)
        assert "ended STOPPED" in str(outcome.get("error"))
    assert seconds_to_stopped < 10
    sent = _stats(echo)["total"]
    time.sleep(2)
    assert _stats(echo)["total"] == sent, "a stopped job must not go on calling the endpoint"
    record_figure(
        f"stop: {how}",
        seconds_to_stopped=round(seconds_to_stopped, 1),
        seconds_until_cpus_free=round(seconds_to_free, 1),
        cpus_in_use_after=cpus_in_use(ray_conn["info"])[0],
    )


async def _kill_as_the_triggerer_does(trigger) -> None:
    """A user marks the deferred task failed: Airflow's triggerer cancels the running trigger with its
    user-action message, and its own run_trigger() then calls the trigger's on_kill()."""
    from airflow.jobs import triggerer_job_runner as triggerer

    os.environ["AIRFLOW_DISABLE_GREENBACK_PORTAL"] = "true"
    trigger.task_instance = None
    runner = triggerer.TriggerRunner()
    task = asyncio.create_task(runner.run_trigger(1, trigger))
    runner.triggers[1] = {"task": task, "is_watcher": False, "name": "ray_job", "events": 0}
    await asyncio.sleep(1.5)  # the trigger is polling the job
    assert not task.done(), "the trigger should still be waiting for the job"
    task.cancel(triggerer._USER_ACTION_CANCEL_MSG)
    try:
        await task
    except asyncio.CancelledError:
        pass


def test_a_retry_after_a_crash_reattaches_and_after_a_failure_runs_a_new_generation(ray_conn, echo, test_home):
    from airflow.sdk.exceptions import TaskDeferred

    from airflow_provider_rayllm.exceptions import RayJobFailed
    from airflow_provider_rayllm.hooks.ray_job import RayJobHook
    from tests.integration.helpers import jobs_with_prefix

    hook = RayJobHook()
    n = 24
    input_uri, output_uri = _rows(test_home, "retry", n), test_home / "out" / "retry"

    # Try 1 submits, defers, and its worker dies before the trigger runs: nobody waits for the job.
    with pytest.raises(TaskDeferred):
        _http_op("retry", input_uri, str(output_uri), deferrable=True).execute(
            {"ti": StandInTI("reliability", "manual__retry", "retry")}
        )
    # Try 2 (same task instance, next try) finds the job still running and waits for it instead of submitting.
    ti2 = StandInTI("reliability", "manual__retry", "retry", try_number=2)
    first = _http_op("retry", input_uri, str(output_uri)).execute({"ti": ti2})
    base_id = first["submission_id"].rsplit("-g", 1)[0]
    assert first["submission_id"].endswith("-g0")
    crashed_then_retried = [j["submission_id"] for j in jobs_with_prefix(hook, base_id)]
    assert crashed_then_retried == [first["submission_id"]]
    reattached_ids = [r["id"] for r in read_rows(first["output_files"])]
    assert sorted(reattached_ids) == list(range(n)), "the re-attached job's output is whole, each row once"

    # A different run of the same task: the endpoint fails every row, so try 1's job fails after writing
    # its error rows into its generation folder; try 2 (endpoint healthy again) is a new generation.
    failing = dict(max_error_fraction=0.0, max_retries=0)
    post = urllib.request.Request(
        f"{echo}/fail", data=json.dumps({"status": 400}).encode(), headers={"Content-Type": "application/json"}
    )
    urllib.request.urlopen(post, timeout=10).read()
    with pytest.raises(RayJobFailed, match=r"above max_error_fraction=0(\.0)?; nothing was published"):
        _http_op("retry", input_uri, str(output_uri / "second"), **failing).execute(
            {"ti": StandInTI("reliability", "manual__retry2", "retry")}
        )
    failed_generation = output_uri / "second" / "_generations"
    partial = sorted(p.name for p in failed_generation.iterdir()) if failed_generation.exists() else []
    assert not (output_uri / "second" / "_manifest.json").exists(), "a failed generation must not be published"
    post = urllib.request.Request(
        f"{echo}/fail", data=json.dumps({"status": 0}).encode(), headers={"Content-Type": "application/json"}
    )
    urllib.request.urlopen(post, timeout=10).read()
    retried = _http_op("retry", input_uri, str(output_uri / "second"), **failing).execute(
        {"ti": StandInTI("reliability", "manual__retry2", "retry", try_number=2)}
    )
    assert retried["submission_id"].endswith("-g1") and retried["rows_out"] == n and retried["rows_errored"] == 0
    published = json.loads((output_uri / "second" / "_manifest.json").read_text())
    assert published["submission_id"] == retried["submission_id"]
    # Published: the failed attempt's folder and the retry's own (its files moved to the prefix) are gone.
    assert not list(failed_generation.iterdir())
    ids = [r["id"] for r in read_rows(retried["output_files"])]
    assert sorted(ids) == list(range(n))
    record_figure(
        "retry_and_reattach",
        jobs_for_crashed_then_retried_try=len(crashed_then_retried),
        reattached_rows_lost=n - len(set(reattached_ids)),
        reattached_duplicate_rows=len(reattached_ids) - len(set(reattached_ids)),
        failed_generation_partial_folders=partial,
        published_generation=retried["submission_id"],
        rows_lost=n - len(set(ids)),
        duplicate_rows=len(ids) - len(set(ids)),
    )


def test_a_stopped_job_run_again_does_not_recompute_finished_rows(ray_conn, echo, test_home):
    """With id_column a retry resumes from the rows the stopped attempt saved, and reuses a saved row only
    while its request is the same: rows whose input changed between the attempts are asked again."""
    from airflow_provider_rayllm.hooks.ray_job import RayJobHook

    hook = RayJobHook()
    n = 96
    input_uri, output_uri = _rows(test_home, "resume", n), test_home / "out" / "resume"
    op = _http_op("resume", input_uri, str(output_uri), id_column="id")
    ti = StandInTI("reliability", "manual__resume", "resume")
    thread, outcome = run_in_thread(op, ti)
    # Stopped once the attempt has saved some finished rows (the save trails the sending by a block or two, and
    # on a busy machine by seconds: stopping at a count of requests sent could find none saved yet).
    wait_for(
        lambda: any(output_uri.glob("_generations/*/outputs/*.parquet")) or not thread.is_alive(),
        180,
        "the first finished rows to be saved",
    )
    op.on_kill()
    sid = ti.xcom["submission_id"]
    wait_for(lambda: hook.get_job_info(sid)["status"] == "STOPPED", 30, "the job to be STOPPED")
    thread.join(timeout=60)
    assert "ended STOPPED" in str(outcome.get("error"))
    assert not (output_uri / "_manifest.json").exists(), "a stopped job publishes nothing"
    sent_by_first = _stats(echo)["requests"]
    (stopped_generation,) = (output_uri / "_generations").iterdir()
    saved = [r["id"] for r in read_rows([{"uri": str(p)} for p in (stopped_generation / "outputs").glob("*.parquet")])]
    assert saved, "the stopped job wrote no finished rows"
    assert len(saved) == len(set(saved)) and len(saved) < n

    # Between the attempts the input changes for every fourth saved row and two rows not answered yet.
    changed_saved = sorted(saved)[::4]
    changed_unsaved = sorted(set(range(n)) - set(saved))[:2]
    prompts = {i: f"resume row {i}" for i in range(n)}
    prompts.update({i: f"resume row {i}, changed" for i in changed_saved + changed_unsaved})
    write_jsonl(test_home / "inputs" / "resume.jsonl", [{"id": i, "prompt": prompts[i]} for i in range(n)])

    # The retry (same task instance, next try) is a new generation that sends only the other rows.
    retry_ti = StandInTI("reliability", "manual__resume", "resume", try_number=2)
    started = time.time()
    manifest = _http_op("resume", input_uri, str(output_uri), id_column="id").execute({"ti": retry_ti})
    seconds = time.time() - started
    assert manifest["submission_id"].endswith("-g1")
    out = read_rows(manifest["output_files"])
    ids = [r["id"] for r in out]
    assert sorted(ids) == list(range(n)), "output ids must be complete and unique"
    stale = [r["id"] for r in out if r["response"] != f"echo: {prompts[r['id']]}"]
    assert not stale, f"rows answered for an earlier input were published: {stale}"
    reused = len(saved) - len(changed_saved)
    assert (manifest["rows_resumed"], manifest["rows_resume_stale"]) == (reused, len(changed_saved))
    assert manifest["rows_out"] == n
    requests = _stats(echo)["requests"]
    recomputed = [i for i in saved if i not in changed_saved and requests[prompts[i]] != 1]
    assert not recomputed, f"rows finished before the stop were sent again: {recomputed}"
    assert all(requests[prompts[i]] == 1 for i in changed_saved), "each changed row is asked once, as it is now"
    never_sent = [i for i in range(n) if prompts[i] not in sent_by_first]
    assert all(requests[prompts[i]] == 1 for i in never_sent)
    assert not list((output_uri / "_generations").iterdir()), "the stopped attempt's folder went with the publish"
    assert pq.read_table(str(output_uri)).num_rows == n, "the prefix reads as the published rows, resumed ones once"
    record_figure(
        "resume",
        rows=n,
        rows_finished_before_stop=len(saved),
        rows_changed_between_attempts=len(changed_saved) + len(changed_unsaved),
        saved_rows_changed=len(changed_saved),
        rows_resumed=manifest["rows_resumed"],
        rows_resume_stale=manifest["rows_resume_stale"],
        requests_before_stop=sum(sent_by_first.values()),
        requests_after_resume=sum(requests.values()) - sum(sent_by_first.values()),
        finished_rows_sent_again=len(recomputed),
        stale_rows_published=len(stale),
        rows_lost=n - len(set(ids)),
        duplicate_rows=len(ids) - len(set(ids)),
        resumed_job_seconds=round(seconds, 1),
    )


@pytest.mark.parametrize("token", ["wrong-token", None], ids=["wrong token", "no token"])
def test_a_bad_ray_token_fails_fast_without_a_retry_loop(token, ray_conn, test_home, monkeypatch):
    from airflow_provider_rayllm.hooks.ray_job import RayAuthError

    info = ray_conn["info"]
    conn = {"conn_type": "ray", "host": info.dashboard_url}
    if token:
        conn["password"] = token
    monkeypatch.setenv("AIRFLOW_CONN_RAY_BADTOKEN", json.dumps(conn))
    monkeypatch.setenv("AIRFLOW_CONN_LLM_REL", json.dumps({"conn_type": "http", "host": "http://127.0.0.1:9/v1"}))
    op = _http_op("auth", _rows(test_home, "auth", 2), str(test_home / "out" / "auth"), ray_conn_id="ray_badtoken")
    started = time.time()
    with pytest.raises(RayAuthError) as failure:
        op.execute({"ti": StandInTI("reliability", f"manual__auth_{token}", "auth")})
    seconds = time.time() - started
    message = str(failure.value)
    assert ("401" in message or "403" in message) and info.dashboard_url in message
    assert token is None or token not in message
    assert seconds < 10
    record_figure(f"auth: {'wrong' if token else 'no'} token", seconds_to_fail=round(seconds, 2), error=message[:200])


def test_shell_metacharacters_in_templates_and_data_execute_nothing(ray_conn, echo, test_home):
    marks = [test_home / f"injected-{i}" for i in range(3)]
    # Where each payload goes: two in the template, one in the data, one in the system prompt, one in the run id.
    payloads = {
        "template $()": f"$(touch {marks[0]})",
        "template backticks": f"`touch {marks[1]}`",
        "data": f"$(touch {marks[2]})",
        "system prompt": "$(id)",
        "run id": "; rm -rf /",
    }
    rows = [{"id": 0, "prompt": payloads["data"]}]
    input_uri = write_jsonl(test_home / "inputs" / "inject.jsonl", rows)
    template = f"{{prompt}} {payloads['template $()']}; {payloads['template backticks']}; echo 'x' \"y\" | cat"
    op = _http_op(
        "inject",
        input_uri,
        str(test_home / "out" / "inject"),
        prompt_column=None,
        prompt_template=template,
        system_prompt=payloads["system prompt"],
    )
    manifest = op.execute({"ti": StandInTI("reliability", f"manual__inject{payloads['run id']}", "inject")})
    sent = list(_stats(echo)["requests"])
    expected = template.replace("{prompt}", rows[0]["prompt"])
    assert expected in sent, "the endpoint must receive the text as written"
    assert not any(m.exists() for m in marks), "a shell ran something from a template, the data or the run id"
    assert manifest["rows_out"] == 1
    record_figure("injection", shell_payloads_tried=len(payloads), executed=sum(m.exists() for m in marks))


def _engine_cores(info) -> list[psutil.Process]:
    """vLLM's engine processes of this session's cluster (vLLM titles them ``VLLM::EngineCore``)."""
    return _cluster_processes(info, "EngineCore")


def test_a_killed_vllm_engine_is_resumed_without_recomputing_finished_rows(ray_conn, smollm2, test_home):
    """The vLLM engine process itself (not a Ray worker) dies mid-job. With id_column, what the engine had
    answered is kept: either the job survives it, or the retry resumes from the saved files."""
    from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

    # The engine answers 8 rows at a time (max_num_seqs), so files appear batch by batch while most rows wait
    # (eight batches: after the first file, seven wait for the engine that is killed).
    n = 64
    input_uri, output_uri = _rows(test_home, "engine_death", n), test_home / "out" / "engine_death"

    def operator():
        return VLLMBatchOperator(
            task_id="engine_death",
            input_uri=input_uri,
            output_uri=str(output_uri),
            model_source=str(smollm2),
            prompt_column="prompt",
            id_column="id",
            sampling_params={"max_tokens": 32, "temperature": 0},
            engine_kwargs={"max_num_seqs": 8},
            batch_size=8,
            deferrable=False,
            poll_interval=0.5,
        )

    def saved_ids() -> list[int]:
        files = [{"uri": str(p)} for p in output_uri.glob("_generations/*/outputs/*.parquet")]
        return [r["id"] for r in read_rows(files)] if files else []

    ti = StandInTI("reliability", "manual__engine_death", "engine_death")
    thread, outcome = run_in_thread(operator(), ti)
    wait_for(lambda: saved_ids() or not thread.is_alive(), 600, "the first answered rows to be written")
    assert thread.is_alive() and len(saved_ids()) < n, "the job ended before the engine could be killed"
    cores = _engine_cores(ray_conn["info"])
    assert cores, "no vLLM EngineCore process found while the job ran"
    for proc in cores:
        proc.kill()
    killed_after = len(saved_ids())
    thread.join(timeout=600)
    assert not thread.is_alive()

    if "error" in outcome:  # the engine's death failed the job: the next try resumes from its files
        first = saved_ids()
        assert first and len(first) == len(set(first)) and len(first) < n
        manifest = operator().execute(
            {"ti": StandInTI("reliability", "manual__engine_death", "engine_death", try_number=2)}
        )
        assert manifest["rows_resumed"] == len(first), "the retry must keep every row the dead engine finished"
    else:
        manifest = outcome["result"]
    out = read_rows(manifest["output_files"])
    ids = [r["id"] for r in out]
    assert sorted(ids) == list(range(n)), "every row exactly once"
    assert all(r["response"] for r in out)
    assert manifest["rows_out"] == n and manifest["rows_errored"] == 0
    record_figure(
        "engine_death",
        rows=n,
        rows_written_when_killed=killed_after,
        engine_processes_killed=len(cores),
        job_failed_by_the_kill="error" in outcome,
        rows_resumed=manifest.get("rows_resumed", 0),
        rows_lost=n - len(set(ids)),
        duplicate_rows=len(ids) - len(set(ids)),
    )


def test_an_actor_that_dies_on_every_start_ends_the_job_in_bounded_time(ray_conn, echo, test_home):
    """Ray Data restarts a dead map actor without end by default; the job's actors get a few restarts, so an
    HTTP caller that dies in its constructor every time (RAYLLM_FAILPOINT=caller_start) fails the task with
    the actor's death, in bounded time, instead of holding it."""
    from airflow_provider_rayllm.exceptions import RayJobFailed
    from airflow_provider_rayllm.hooks.ray_job import RayJobHook
    from airflow_provider_rayllm.job.failpoints import FAILPOINT_ENV

    ti = StandInTI("reliability", "manual__dying_actor", "dying_actor")
    op = _http_op(
        "dying_actor",
        _rows(test_home, "dying", 8),
        str(test_home / "out" / "dying"),
        job_runtime_env={"env_vars": {FAILPOINT_ENV: "caller_start"}},
    )
    started = time.monotonic()
    with pytest.raises(RayJobFailed) as failure:
        op.execute({"ti": ti})
    seconds = time.monotonic() - started
    logs = RayJobHook().get_job_logs(ti.xcom["submission_id"])
    assert logs.count("failpoint caller_start") >= 2, "the actor was started again after it died"
    assert "Actor" in str(failure.value) or "actor" in str(failure.value), str(failure.value)
    assert seconds < 240, f"{seconds:.0f} s"  # measured 2026-12-04: see docs/RELIABILITY.md
    record_figure("actor_dies_on_every_start", seconds_to_fail=round(seconds, 1), error=str(failure.value)[:200])


def test_an_endpoint_that_never_answers_ends_the_job_at_its_stall_timeout(ray_conn, echo, test_home):
    """Every request hangs (the echo sleeps 600 s) and the request deadline is longer still: without a stall
    limit the job would hold the cluster for ten minutes. With ``stall_timeout_s=6`` it ends a few seconds after
    six silent seconds, saying so in one line; nothing is published."""
    from airflow_provider_rayllm.exceptions import RayJobFailed

    out = test_home / "out" / "stalled"
    rows = [{"id": i, "prompt": f"[sleep 600] stalled row {i}"} for i in range(4)]
    ti = StandInTI("reliability", "manual__stalled", "stalled")
    op = _http_op(
        "stalled", write_jsonl(test_home / "inputs" / "stalled.jsonl", rows), str(out), timeout_s=900, stall_timeout_s=6
    )
    started = time.monotonic()
    with pytest.raises(RayJobFailed) as failure:
        op.execute({"ti": ti})
    seconds = time.monotonic() - started
    message = str(failure.value)
    assert "no row answered for" in message and "stall_timeout_s=6" in message, message
    assert "\n" not in message, "the cause is one line"
    assert not (out / "manifest.json").exists(), "nothing was published"
    assert seconds < 120, f"{seconds:.0f} s"
    record_figure("endpoint_never_answers", rows=len(rows), stall_timeout_s=6, seconds_to_fail=round(seconds, 1))
