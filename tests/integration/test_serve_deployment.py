"""The guide's "batch inference with a Serve deployment": an LLM application on the test cluster's Ray
Serve (SmolLM2 on the CPU engine), then dags_examples/example_serve_deployment.py's two chained tasks
call it. Neither job starts an engine; the second reads the first's output through XCom.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.integration.helpers import (
    assert_succeeded,
    jobs_of_run,
    load_dag,
    ray_driver_env,
    read_rows,
    task_state,
    utc,
    xcom,
)

pytestmark = pytest.mark.integration

# The guide's names: its app and deployment, and the model id its requests name (SmolLM2's weights here).
APP, DEPLOYMENT, MODEL = "demo_app", "demo_deployment", "facebook/opt-1.3b"
CONF = {"model": MODEL, "serve_app": APP, "serve_deployment": DEPLOYMENT}
SERVE_ACTORS = ("ServeController", "ProxyActor")


def _serve_app(ray_conn, test_home, *args: str) -> subprocess.CompletedProcess:
    env = ray_driver_env(ray_conn, test_home)
    return subprocess.run(
        [sys.executable, "-m", "airflow_provider_rayllm.local.serve_app", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.fixture(scope="module")
def serve_app(ray_conn, test_home, smollm2):
    deployed = _serve_app(
        ray_conn,
        test_home,
        "deploy",
        "--model-id",
        MODEL,
        "--model-source",
        str(smollm2),
        "--app",
        APP,
        "--deployment",
        DEPLOYMENT,
        "--cpu",
    )
    assert deployed.returncode == 0, deployed.stdout[-2000:] + deployed.stderr[-4000:]
    yield APP
    # The replica holds a CPU of the 2-core cluster: the other tests need it back. With no application left,
    # the command shuts Serve down: its controller and proxy would otherwise tick on for the rest of the session.
    removed = _serve_app(ray_conn, test_home, "delete", "--app", APP)
    assert removed.returncode == 0, removed.stderr[-3000:]
    assert "Serve shut down" in removed.stdout, removed.stdout
    from airflow_provider_rayllm.local.cluster import LocalRayCluster

    def alive() -> list[str]:
        actors = LocalRayCluster.state_list(ray_conn["info"], "actors")
        assert any(a.get("class_name") == "ServeController" for a in actors), "the state API listed Serve's actors"
        return [a["class_name"] for a in actors if a.get("class_name") in SERVE_ACTORS and a.get("state") != "DEAD"]

    deadline = time.time() + 30  # the state API learns of an actor's death a moment after it
    left = alive()
    while left and time.time() < deadline:
        time.sleep(1)
        left = alive()
    assert left == [], f"Serve's actors still alive after its last application was deleted: {left}"


def _job_log(manifest) -> str:
    from airflow_provider_rayllm.hooks.ray_job import RayJobHook

    return RayJobHook().get_job_logs(manifest["submission_id"])


def test_two_chained_tasks_share_the_serve_deployment(serve_app, airflow_db, test_home):
    from airflow_provider_rayllm.local.defaults import DEMO_INPUT
    from tests.integration.helpers import write_jsonl

    # The demo's first six questions (each answer is generated on the 2-core cluster's one replica).
    questions = [json.loads(line) for line in DEMO_INPUT.read_text().splitlines() if line.strip()][:6]
    input_uri = write_jsonl(test_home / "inputs" / "serve-chain.jsonl", questions)
    dag = load_dag("dags_examples", "example_serve_deployment", "example_serve_deployment")
    dag_run = dag.test(
        logical_date=utc(2026, 8, 20), run_after=utc(2026, 8, 20), run_conf={**CONF, "input_uri": input_uri}
    )
    assert_succeeded(dag_run, "first_turn", "second_turn")
    first = xcom(dag.dag_id, dag_run.run_id, "first_turn", "return_value")
    second = xcom(dag.dag_id, dag_run.run_id, "second_turn", "return_value")
    assert first["kind"] == second["kind"] == "serve"
    assert first["rows_in"] == first["rows_out"] == len(questions) and first["rows_errored"] == 0
    assert second["rows_in"] == second["rows_out"] == len(questions) and second["rows_errored"] == 0
    answers = {r["id"]: r for r in read_rows(first["output_files"])}
    assert all(r["response"].strip() for r in answers.values())
    assert first["output_tokens"] == sum(r["num_generated_tokens"] for r in answers.values()) > 0
    verdicts = read_rows(second["output_files"])
    # The second step saw the first step's answers (kept beside its own output) and answered about them.
    assert sorted(r["id"] for r in verdicts) == sorted(answers)
    assert all(r["response"] == answers[r["id"]]["response"] and r["verdict"].strip() for r in verdicts)
    # No engine started in either job: the deployment's engine answered.
    for manifest in (first, second):
        log = _job_log(manifest)
        assert "vLLMEngineStageUDF" not in log and "ServeDeploymentStageUDF" in log


def test_an_unknown_deployment_is_named_before_any_row_is_sent(serve_app, airflow_db):
    dag = load_dag("dags_examples", "example_serve_deployment", "example_serve_deployment")
    dag_run = dag.test(
        logical_date=utc(2026, 8, 21), run_after=utc(2026, 8, 21), run_conf={**CONF, "serve_deployment": "no_such_llm"}
    )
    assert task_state(dag_run, "first_turn") == "failed"
    from airflow_provider_rayllm.hooks.ray_job import RayJobHook

    hook = RayJobHook()
    jobs = jobs_of_run(hook, dag_run.run_id)
    assert len(jobs) == 1
    errors = [
        line for line in hook.get_job_logs(jobs[0].submission_id).splitlines() if line.startswith("RAYLLM_ERROR ")
    ]
    assert errors and "serve_deployment 'no_such_llm'" in errors[-1] and f"'{DEPLOYMENT}'" in errors[-1]


def test_the_guides_chained_processors_as_written(serve_app, airflow_db):
    """tests/dags/guide_blocks.py's guide_serve_chain: the guide's two processors, their preprocess and
    postprocess unchanged (completions requests with dtype CompletionRequest), on ray.data.range(10)'s rows."""
    dag = load_dag("tests/dags", "guide_blocks", "guide_serve_chain")
    dag_run = dag.test(logical_date=utc(2026, 8, 22), run_after=utc(2026, 8, 22), run_conf={})
    assert_succeeded(dag_run, "processor1", "processor2")
    first = xcom(dag.dag_id, dag_run.run_id, "processor1", "return_value")
    second = xcom(dag.dag_id, dag_run.run_id, "processor2", "return_value")
    assert first["rows_in"] == first["rows_out"] == 10 and first["rows_errored"] == 0
    assert second["rows_in"] == second["rows_out"] == 10 and second["rows_errored"] == 0
    prompts = read_rows(first["output_files"])
    assert all(set(r) == {"prompt"} for r in prompts), "processor1's postprocess gives the output row, exactly"
    # Sampled completions: a model may end one at once (EOS first), which is an answer, not a failure.
    assert all(isinstance(r["prompt"], str) for r in prompts) and sum(bool(r["prompt"].strip()) for r in prompts) > 5
    continued = read_rows(second["output_files"])
    # processor2's postprocess returns the whole row: the deployment's completion body is in it.
    assert sorted(r["prompt"] for r in continued) == sorted(r["prompt"] for r in prompts)
    texts = [r["choices"][0]["text"] for r in continued]
    assert all(isinstance(t, str) for t in texts) and sum(bool(t.strip()) for t in texts) > 5, texts
    for manifest in (first, second):
        log = _job_log(manifest)
        assert "vLLMEngineStageUDF" not in log and "ServeDeploymentStageUDF" in log
