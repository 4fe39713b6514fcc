"""The Airflow UI in a real browser: Airflow's API server on loopback, headless Chromium driven by Playwright.

A finished run comes first (the shipped quickstart DAG under dag.test() in the test database, shared
with the other tests); then `airflow dags reserialize` puts every DAG of both bundles in the database, and the
API server serves the UI over it. The browser checks that the example DAGs are listed, that "Trigger"
shows the example's Params as a form, and that the finished task shows the "Ray job" link (Details tab) to
the job's page in the Ray dashboard. Screenshots go to tests/artifacts/browser/.
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
    serialized = _airflow("dags", "reserialize", env=env)
    assert serialized.returncode == 0, serialized.stderr[-3000:]
    errors = _airflow("dags", "list-import-errors", "-o", "json", env=env)
    assert errors.returncode == 0, errors.stderr[-3000:]
    listed = json.loads(errors.stdout.strip() or "[]") if errors.stdout.strip().startswith("[") else []
    assert listed == [], f"DAG import errors: {listed}"

    port = free_port()
    log = open(service_logs / "api-server.log", "w")
    airflow = str(Path(sys.executable).with_name("airflow"))
    proc = subprocess.Popen(
        [airflow, "api-server", "-H", "127.0.0.1", "-p", str(port), "-w", "1"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
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
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


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
