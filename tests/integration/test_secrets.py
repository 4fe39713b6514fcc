"""No secret stays on the cluster after a job ends, whichever way it ends.

Canaries in every kind of secret the HTTP operator sends (the endpoint's API key from the connection, a
secret-looking variable of the job's runtime_env, which is moved into the job's secrets) go through a job
that succeeds, one that fails its error gate after every worker loaded them, and one stopped mid-job. After
each, every file under every node's Ray temp dir (zip members opened) and every package in the cluster's
store are read for them, and so are the job's record, its log, the task's XCom and its log.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from airflow_provider_rayllm.contract.progress import last_progress
from tests.integration.helpers import (
    StandInTI,
    canaries_in,
    driver_env,
    echo_connection,
    echo_operator,
    files_holding,
    record_figure,
    run_in_thread,
    store_holding,
    wait_for,
    write_jsonl,
)

pytestmark = pytest.mark.integration

API_KEY = f"sk-canary-{uuid.uuid4().hex}"
ENV_TOKEN = f"tok-canary-{uuid.uuid4().hex}"
CANARIES = {"http api key": API_KEY, "runtime_env token": ENV_TOKEN}


@pytest.fixture()
def endpoint(service_logs):
    """A chat endpoint answering after 0.2 s, as the `llm_secret` connection with the canary API key."""
    with echo_connection("llm_secret", 0.2, service_logs, password=API_KEY) as url:
        yield url


def _op(name: str, input_uri: str, test_home: Path, **kw):
    settings = dict(job_runtime_env={"env_vars": {"VENDOR_API_TOKEN": ENV_TOKEN}}, max_in_flight=2)
    settings.update(kw)
    return echo_operator("llm_secret", name, input_uri, str(test_home / "out" / "secrets" / name), **settings)


def _check_nothing_left(info, hook, ti, op_logs: str, case: str) -> dict:
    sid = ti.xcom["submission_id"]
    assert canaries_in(json.dumps(hook.get_job_info(sid)).encode(), CANARIES) == [], "the Jobs API record"
    assert canaries_in(hook.get_job_logs(sid).encode(), CANARIES) == [], "the job log"
    assert canaries_in(json.dumps(ti.xcom, default=str).encode(), CANARIES) == [], "the task's XCom"
    assert canaries_in(op_logs.encode(), CANARIES) == [], "the task log"
    files = files_holding(info, CANARIES)
    store = store_holding(info, CANARIES)
    record_figure(f"secrets: job {case}", secrets_left=len(files) + len(store["found"]))
    assert files == [], "files on the cluster's nodes"
    assert store["found"] == [], f"packages in the cluster's store after the {case} job"
    return store


def test_no_secret_survives_a_job_that_succeeds_fails_or_is_stopped(ray_conn, endpoint, test_home, caplog):
    from airflow_provider_rayllm.hooks.ray_job import RayJobHook

    info, hook = ray_conn["info"], RayJobHook()
    caplog.set_level(logging.INFO)
    rows = [{"id": i, "prompt": f"secret row {i}"} for i in range(12)]

    # 1. success
    ok_ti = StandInTI("secrets", "manual__secrets", "ok")
    manifest = _op("ok", write_jsonl(test_home / "inputs" / "secrets-ok.jsonl", rows), test_home).execute({"ti": ok_ti})
    assert manifest["rows_out"] == len(rows)
    _check_nothing_left(info, hook, ok_ti, caplog.text, "succeeded")

    # 2. failure after every worker loaded the secrets: a row with no prompt fails a gate of zero errors
    bad_rows = rows + [{"id": 99, "prompt": None}]
    failed_ti = StandInTI("secrets", "manual__secrets", "failed")
    failing = _op(
        "failed", write_jsonl(test_home / "inputs" / "secrets-failed.jsonl", bad_rows), test_home, max_error_fraction=0
    )
    with pytest.raises(Exception, match="ended FAILED"):
        failing.execute({"ti": failed_ti})
    _check_nothing_left(info, hook, failed_ti, caplog.text, "failed")

    # 3. stopped mid-job (Ray sends SIGTERM to the driver, which cleans up before it goes)
    many = [{"id": i, "prompt": f"slow row {i}"} for i in range(200)]
    stop_ti = StandInTI("secrets", "manual__secrets", "stopped")
    stopping = _op("stopped", write_jsonl(test_home / "inputs" / "secrets-stopped.jsonl", many), test_home)
    thread, outcome = run_in_thread(stopping, stop_ti)
    wait_for(lambda: "submission_id" in stop_ti.xcom, 60, "the job to be submitted")
    sid = stop_ti.xcom["submission_id"]
    wait_for(lambda: "RAYLLM_PROGRESS" in hook.get_job_logs(sid), 180, "the job to report progress")
    stopping.on_kill()
    thread.join(timeout=120)
    assert "ended STOPPED" in str(outcome.get("error"))
    store = _check_nothing_left(info, hook, stop_ti, caplog.text, "stopped")
    assert store["packages"] >= 1, "the scan reached the cluster's package store"


_STOPPED_DRIVER = """
import sys, time
import ray
from airflow_provider_rayllm.job import driver, entrypoint, secrets
# A driver whose package (spec and secrets) Ray uploaded to the cluster's store, as for a submitted job.
ray.init(address=sys.argv[2], runtime_env={"working_dir": "."}, log_to_driver=False)
# It runs until stopped; its cleanup is then slow (a busy cluster): Ray's SIGKILL would come first.
driver.run = lambda *args: (print("running", flush=True), time.sleep(300))
secrets.cleanup = lambda *args, **kwargs: time.sleep(300)
sys.exit(entrypoint.main([sys.argv[1]]))
"""


def test_a_stopped_driver_deletes_its_package_from_the_store_at_once(ray_conn, tmp_path):
    """Ray kills a stopped job's driver a while after its SIGTERM (3 s unless told otherwise): the package that
    holds the secrets must leave the cluster's store at the SIGTERM, not at the end of a cleanup that a busy
    cluster makes slow."""
    import signal

    from tests.unit.test_credentials import write_job_package

    info = ray_conn["info"]
    canary = {"stopped driver's key": f"sk-canary-{uuid.uuid4().hex}"}
    write_job_package(tmp_path, {"API_KEY": next(iter(canary.values()))})
    driver = subprocess.Popen(
        [sys.executable, "-c", _STOPPED_DRIVER, "spec.json", info.gcs_address],
        cwd=tmp_path,
        env=driver_env(info),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        lines = [driver.stdout.readline()]
        while lines[-1] and lines[-1].strip() != "running":
            lines.append(driver.stdout.readline())
        assert lines[-1].strip() == "running", lines
        assert [f for f in store_holding(info, canary)["found"] if "stopped driver's key" in f], (
            "the driver's package is in the store while it runs"
        )
        driver.send_signal(signal.SIGTERM)
        wait_for(lambda: not (tmp_path / "secrets.json").exists(), 30, "the SIGTERM handler")
        assert store_holding(info, canary)["found"] == [], "the package is left in the store"
        assert driver.poll() is None, "the driver is still in its (slow) cleanup"
    finally:
        driver.kill()
        driver.wait()


def test_secrets_a_killed_driver_left_are_removed_by_the_next_job(ray_conn, endpoint, test_home):
    """SIGKILL (as the OOM killer or os._exit would) skips every cleanup of the driver: its node keeps the
    job's secrets file and the store keeps its package and its stream's counts. The next job of this package
    removes them all, from every node, because their job has ended."""
    import signal

    from airflow_provider_rayllm.hooks.ray_job import RayJobHook

    info, hook = ray_conn["info"], RayJobHook()
    many = [{"id": i, "prompt": f"killed row {i}"} for i in range(200)]
    killed_ti = StandInTI("secrets", "manual__killed", "killed")
    killed = _op("killed", write_jsonl(test_home / "inputs" / "secrets-killed.jsonl", many), test_home)
    thread, outcome = run_in_thread(killed, killed_ti)
    wait_for(lambda: "submission_id" in killed_ti.xcom, 60, "the job to be submitted")
    sid = killed_ti.xcom["submission_id"]
    wait_for(lambda: "RAYLLM_PROGRESS" in hook.get_job_logs(sid), 180, "the job to report progress")
    os.kill(int(hook.get_job_info(sid)["driver_info"]["pid"]), signal.SIGKILL)
    thread.join(timeout=120)
    assert "ended FAILED" in str(outcome.get("error")), outcome
    left = files_holding(info, CANARIES)
    assert left, "the killed driver left its secrets on the node (the case this test is about)"
    store = store_holding(info, CANARIES)
    assert store["found"], "and its package in the store"
    killed_job = hook.get_job_info(sid)["job_id"]
    # The stream's counts are in the store once a stage has reported answered rows; the kill comes at the first
    # progress line, which can come before any answer (then there are no counts to leave).
    last = last_progress(hook.get_job_logs(sid))
    if last is not None and last["rows_done"] > 0:
        assert killed_job in store["counted_jobs"], "and its stream's counts"

    next_ti = StandInTI("secrets", "manual__after_kill", "next")
    rows = [{"id": i, "prompt": f"next row {i}"} for i in range(4)]
    manifest = _op("next", write_jsonl(test_home / "inputs" / "secrets-next.jsonl", rows), test_home).execute(
        {"ti": next_ti}
    )
    assert manifest["rows_out"] == len(rows)
    said = [line for line in hook.get_job_logs(next_ti.xcom["submission_id"]).splitlines() if "secrets" in line]
    after = files_holding(info, CANARIES)
    store = store_holding(info, CANARIES)
    in_store = store["found"]
    assert store["counted_jobs"] == [], "the killed job's counts were removed, and the next job removed its own"
    record_figure(
        "secrets: driver SIGKILLed, then the next job",
        left_by_the_kill=len(left),
        secrets_left=len(after) + len(in_store),
    )
    assert after == [], f"left on the nodes after the next job: {left}; its log: {said}"
    assert in_store == [], "left in the store after the next job"


def test_a_job_stopped_while_pending_leaves_no_secret_once_on_kills_sweep_ran(ray_conn, endpoint, test_home):
    """A job stopped before its driver started never runs the cleanup that would remove its package (which
    holds the secrets) from the cluster's store. The operator's ``on_kill`` submits a sweep job after the stop;
    when it has run, the store and the nodes hold no canary."""
    from airflow_provider_rayllm.hooks.ray_job import RayJobHook

    info, hook = ray_conn["info"], RayJobHook()
    rows = [{"id": i, "prompt": f"pending row {i}"} for i in range(4)]
    ti = StandInTI("secrets", "manual__pending", "pending")
    # A resource no node has: the job waits in PENDING for as long as it is let.
    input_uri = write_jsonl(test_home / "inputs" / "secrets-pending.jsonl", rows)
    op = _op("pending", input_uri, test_home, entrypoint_resources={"rayllm_no_such_node": 1.0})
    thread, outcome = run_in_thread(op, ti)
    wait_for(lambda: "submission_id" in ti.xcom, 60, "the job to be submitted")
    sid = ti.xcom["submission_id"]
    assert hook.get_job_status(sid) == "PENDING"
    assert store_holding(info, CANARIES)["found"], "the pending job's package, with its secrets, is in the store"
    killed_at = time.monotonic()
    op.on_kill()
    # The Jobs API's stop never reaches a job whose supervisor is not scheduled; the sweep job ends it.
    wait_for(lambda: hook.get_job_status(f"{sid}-sweep") in ("SUCCEEDED", "FAILED"), 180, "the sweep job to end")
    thread.join(timeout=60)
    assert "ended FAILED" in str(outcome.get("error")) or "ended STOPPED" in str(outcome.get("error")), outcome
    assert not (hook.get_job_info(sid) or {}).get("driver_info"), "the stopped job never started a driver"
    assert hook.get_job_status(f"{sid}-sweep") == "SUCCEEDED", hook.get_job_logs(f"{sid}-sweep")
    swept_after = time.monotonic() - killed_at
    assert "RAYLLM_SWEPT" in hook.get_job_logs(f"{sid}-sweep")
    left = store_holding(info, CANARIES)["found"] + files_holding(info, CANARIES)
    assert left == [], "the stopped job's package or secrets file is left on the cluster"
    record_figure("secrets: stopped while pending", seconds_to_swept=round(swept_after, 1), secrets_left=len(left))
