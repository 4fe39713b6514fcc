"""The Airflow UI in a real browser: Airflow's API server on loopback, headless Chromium driven by Playwright.

A finished run comes first (the shipped quickstart DAG under dag.test() in the test database, shared
with the other tests); then `make ui`'s command (`python -m airflow_provider_rayllm.local ui`, here over the
test database) puts every DAG of both bundles in the database and becomes the API server that serves the UI
over it. The REST API answers for the run; the browser checks that the example DAGs are listed, that
"Trigger" shows the example's Params as a form, and that the finished task shows the "Ray job" link (Details
tab) to the job's page in the Ray dashboard. Screenshots go to tests/artifacts/browser/.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.integration.helpers import assert_succeeded, xcom

pytestmark = pytest.mark.integration

SHOTS = Path(__file__).resolve().parents[1] / "artifacts" / "browser"
EXAMPLES = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "dags_examples").glob("example_*.py"))


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail("Chromium is missing in CI: scripts/setup.sh installs Debian's chromium package")
    pytest.skip("no Chromium on this machine (Debian: apt-get install chromium)")


def _airflow(*args: str, env: dict) -> subprocess.CompletedProcess:
    airflow = str(Path(sys.executable).with_name("airflow"))
    return subprocess.run([airflow, *args], env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def finished_run(quickstart_run):
    """The shipped quickstart DAG's finished run (shared with the other tests), with its Ray job link."""
    assert_succeeded(quickstart_run["dag_run"], "answer")
    dag_run = quickstart_run["dag_run"]
    return {
        "dag_id": dag_run.dag_id,
        "run_id": dag_run.run_id,
        "task_id": "answer",
        "job_url": xcom(dag_run.dag_id, dag_run.run_id, "answer", "ray_job_url"),
    }


@pytest.fixture(scope="module")
def api_server(finished_run, test_home, service_logs):
    from airflow_provider_rayllm.local.cluster import free_port

    env = dict(os.environ)
    env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS"] = "True"
    port = free_port()
    log = open(service_logs / "api-server.log", "w")
    # `make ui` as a user runs it, over the test database instead of the demo's.
    proc = subprocess.Popen(
        [sys.executable, "-m", "airflow_provider_rayllm.local", "ui", "--use-environment", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        try:
            with urllib.request.urlopen(f"{url}/api/v2/monitor/health", timeout=5) as resp:
                if resp.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise AssertionError(f"the API server did not come up; log: {service_logs / 'api-server.log'}")
        time.sleep(1)
    # `ui` serialized the DAGs before it became the server: none may fail to import.
    errors = _airflow("dags", "list-import-errors", "-o", "json", env=env)
    listed = json.loads(errors.stdout.strip() or "[]") if errors.stdout.strip().startswith("[") else []
    if errors.returncode != 0 or listed:
        proc.kill()
        raise AssertionError(f"DAG import errors: {listed or errors.stderr[-3000:]}")
    yield url
    # Stopping `make ui` (Ctrl-C or SIGTERM) stops the server: the port is free again.
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("`ui` did not stop within 30 s of SIGTERM") from None
    finally:
        log.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{url}/api/v2/monitor/health", timeout=5)


@pytest.fixture(scope="module")
def page(api_server):
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = _chromium()
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        page = context.new_page()
        page.set_default_timeout(60_000)
        yield page
        browser.close()


def test_example_dags_are_listed_without_import_errors(page, api_server):
    page.goto(f"{api_server}/dags")
    for dag_id in EXAMPLES:
        page.get_by_text(dag_id, exact=True).first.wait_for()
    page.screenshot(path=str(SHOTS / "dags.png"), full_page=True)


def test_trigger_form_shows_the_params(page, api_server):
    page.goto(f"{api_server}/dags/example_vllm_batch")
    page.get_by_role("button", name="Trigger").first.click()
    dialog = page.get_by_role("dialog")
    dialog.wait_for()
    for name in ("model_source", "input_uri", "max_tokens", "temperature", "engine_kwargs"):
        dialog.get_by_text(name).first.wait_for()
    dialog.get_by_text("Tokens to generate per row").first.wait_for()
    page.screenshot(path=str(SHOTS / "trigger-form.png"), full_page=True)


def test_finished_task_shows_the_ray_job_link(page, api_server, finished_run):
    run = finished_run
    # Airflow 3's task page lists a task's extra links on its Details tab.
    page.goto(f"{api_server}/dags/{run['dag_id']}/runs/{run['run_id']}/tasks/{run['task_id']}/details")
    link = page.get_by_role("link", name="Ray job")
    try:
        link.first.wait_for()
    except Exception:
        page.screenshot(path=str(SHOTS / "task-ray-job-link-FAILED.png"), full_page=True)
        (SHOTS / "task-ray-job-link-FAILED.html").write_text(page.content())
        raise
    assert run["job_url"] and link.first.get_attribute("href") == run["job_url"]
    page.screenshot(path=str(SHOTS / "task-ray-job-link.png"), full_page=True)


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        assert resp.status == 200, url
        return json.loads(resp.read())


def test_ui_serves_its_health_and_the_run_through_the_rest_api(api_server, finished_run):
    run = finished_run
    health = _get_json(f"{api_server}/api/v2/monitor/health")
    assert health["metadatabase"]["status"] == "healthy", health
    dag_run = _get_json(f"{api_server}/api/v2/dags/{run['dag_id']}/dagRuns/{quote(run['run_id'], safe='')}")
    assert (dag_run["dag_run_id"], dag_run["state"]) == (run["run_id"], "success")
    task = _get_json(
        f"{api_server}/api/v2/dags/{run['dag_id']}/dagRuns/{quote(run['run_id'], safe='')}/taskInstances/{run['task_id']}"
    )
    assert task["state"] == "success"
