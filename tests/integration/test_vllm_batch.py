"""VLLMBatchOperator on the real stack: a local Ray head with token auth, the CPU vLLM engine and
SmolLM2-135M-Instruct, driven by Airflow's own dag.test().

Engines take 20-40 s to start here, so the module runs two engine jobs in all (the deferred run with
error rows and the example DAG), and one whose engine refuses to start; every other case fails or is
stopped before an engine starts.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.integration.helpers import (
    StandInTI,
    assert_succeeded,
    delete_runs,
    jobs_of_run,
    jobs_with_prefix,
    load_dag,
    ray_driver_env,
    read_rows,
    task_state,
    utc,
    write_jsonl,
    xcom,
)

pytestmark = pytest.mark.integration

QUESTIONS = [
    "What is the capital of France?",
    "What is machine learning?",
    "Name a primary color.",
    "What is 2 + 2?",
    "What do bees make?",
    "What is the opposite of hot?",
]
LONG_PROMPT = "word " * 2200  # beyond the CPU profile's max_model_len of 2048
DEFERRED_DATE = utc(2026, 3, 1)


@pytest.fixture(scope="module")
def hook(ray_conn):
    from airflow_provider_rayllm.hooks.ray_job import RayJobHook

    return RayJobHook()


@pytest.fixture(scope="module")
def deferred_run(ray_conn, airflow_db, smollm2, test_home):
    """One deferred run: six good questions, one prompt too long for the engine, one empty prompt."""
    dag = load_dag("tests/dags", "rayllm_it", "rayllm_it_deferred")

    rows = [{"id": i, "prompt": q} for i, q in enumerate(QUESTIONS)]
    rows += [{"id": 100, "prompt": LONG_PROMPT}, {"id": 101, "prompt": None}]
    input_uri = write_jsonl(test_home / "inputs" / "deferred.jsonl", rows)
    output_uri = str(test_home / "out" / "deferred")
    # No engine_kwargs at all: every engine setting is the profile's, fitted to SmolLM2.
    conf = {"model_source": str(smollm2), "input_uri": input_uri, "output_uri": output_uri, "engine_kwargs": {}}
    started = time.time()
    dag_run = dag.test(logical_date=DEFERRED_DATE, run_after=DEFERRED_DATE, run_conf=conf)
    return {"dag": dag, "dag_run": dag_run, "conf": conf, "seconds": time.time() - started}


def test_deferred_run_answers_every_good_row_and_reports_bad_rows(deferred_run):
    dag_run = deferred_run["dag_run"]
    assert_succeeded(dag_run, "generate")
    manifest = xcom(dag_run.dag_id, dag_run.run_id, "generate", "return_value")
    assert manifest["rows_in"] == 8
    assert manifest["rows_out"] == 6
    assert manifest["rows_errored"] == 2

    outputs = read_rows(manifest["output_files"])
    assert sorted(r["id"] for r in outputs) == list(range(6))
    for row in outputs:
        assert isinstance(row["response"], str) and row["response"].strip()
        assert row["num_input_tokens"] > 0 and 0 < row["num_generated_tokens"] <= 16

    errors = {r["id"]: r["error"] for r in read_rows(manifest["error_files"])}
    assert set(errors) == {100, 101}
    assert "maximum context length" in errors[100]
    assert "column 'prompt' is empty" in errors[101]


def test_manifest_matches_the_files(deferred_run):
    dag_run = deferred_run["dag_run"]
    manifest = xcom(dag_run.dag_id, dag_run.run_id, "generate", "return_value")
    outputs = read_rows(manifest["output_files"])
    assert len(outputs) == manifest["rows_out"]
    assert sum(r["num_input_tokens"] for r in outputs) == manifest["input_tokens"]
    assert sum(r["num_generated_tokens"] for r in outputs) == manifest["output_tokens"]
    import os

    for f in manifest["output_files"] + manifest["error_files"]:
        assert os.path.getsize(f["uri"]) == f["bytes"]
    assert manifest["output_uri"] == deferred_run["conf"]["output_uri"]
    assert manifest["versions"]["ray"] == "2.60.0"
    assert manifest["model"] == deferred_run["conf"]["model_source"]
    assert manifest["run"]["dag_id"] == "rayllm_it_deferred"
    assert xcom(dag_run.dag_id, dag_run.run_id, "generate", "outputs_folder") == manifest["outputs_folder"]
    assert xcom(dag_run.dag_id, dag_run.run_id, "generate", "ray_job_url").endswith(manifest["submission_id"])


def test_engine_cost_comes_from_the_engine_actors_lifetime(deferred_run):
    """price_per_hour x the CPUs an engine replica reserves x how long its actor lived (Ray's actor table)."""
    dag_run = deferred_run["dag_run"]
    manifest = xcom(dag_run.dag_id, dag_run.run_id, "generate", "return_value")
    seconds = manifest["engine_actor_seconds"]
    assert 0 < seconds < deferred_run["seconds"], "the engine lived within the task's run"
    timeline = manifest["timeline"]
    # The engine's load counts too: it holds the CPUs (GPUs) from the moment the plan asks for it. Ray's actor
    # table alone starts the clock when the constructor returns, after the load, which on this machine is most
    # of the engine's life. The rows' last answer is counted a stage after the engine (which may end a moment
    # before it), hence the margin.
    assert seconds >= 0.8 * (timeline["last_answer_s"] - timeline["plan_started_s"])
    assert manifest["billed_unit"] == "CPU" and manifest["billed_units_per_replica"] > 0
    cost = seconds / 3600 * manifest["billed_units_per_replica"] * 0.25
    assert manifest["estimated_cost"] == pytest.approx(cost, abs=1e-6)
    per_million = manifest["estimated_cost"] / manifest["output_tokens"] * 1e6
    assert manifest["cost_per_million_output_tokens"] == pytest.approx(per_million, rel=1e-3)


def test_outlet_asset_event_carries_the_output_uri(deferred_run):
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    dag_run = deferred_run["dag_run"]
    manifest = xcom(dag_run.dag_id, dag_run.run_id, "generate", "return_value")
    with create_session() as session:
        events = session.scalars(
            select(AssetEvent)
            .join(AssetModel, AssetEvent.asset_id == AssetModel.id)
            .where(AssetModel.uri == "rayllm://tests/deferred-answers", AssetEvent.source_run_id == dag_run.run_id)
        ).all()
        extras = [dict(e.extra) for e in events]
    assert len(extras) == 1
    assert extras[0]["outputs_folder"] == manifest["outputs_folder"]
    assert extras[0]["rows_out"] == 6 and extras[0]["submission_id"] == manifest["submission_id"]


def test_same_task_instance_again_creates_no_second_job(deferred_run, hook):
    dag, conf = load_dag("tests/dags", "rayllm_it", "rayllm_it_deferred"), deferred_run["conf"]
    first = xcom(dag.dag_id, deferred_run["dag_run"].run_id, "generate", "return_value")
    base_id = first["submission_id"].rsplit("-g", 1)[0]
    delete_runs(dag.dag_id)
    started = time.time()
    again = dag.test(logical_date=DEFERRED_DATE, run_after=DEFERRED_DATE, run_conf=conf)
    assert time.time() - started < deferred_run["seconds"]
    assert_succeeded(again, "generate")
    assert again.run_id == deferred_run["dag_run"].run_id
    second = xcom(dag.dag_id, again.run_id, "generate", "return_value")
    assert second["submission_id"] == first["submission_id"]
    assert [j["submission_id"] for j in jobs_with_prefix(hook, base_id)] == [first["submission_id"]]


def test_example_dag_runs_the_guides_quickstart(quickstart_run, ray_conn):
    """dags_examples/example_vllm_batch.py as shipped; output under the connection's output_base."""
    assert_succeeded(quickstart_run["dag_run"], "answer")
    manifest = quickstart_run["manifest"]
    assert manifest["rows_in"] == manifest["rows_out"] == 16
    assert manifest["rows_errored"] == 0
    assert manifest["output_uri"].startswith(str(ray_conn["output_base"] / "example_vllm_batch"))
    answers = {r["prompt"]: r["response"] for r in quickstart_run["rows"]}
    assert "paris" in answers["What is the capital of France?"].lower()
    # The job log's progress lines (which the task log shows) end with every row and token counted.
    from airflow_provider_rayllm.contract.progress import last_progress
    from airflow_provider_rayllm.hooks.ray_job import RayJobHook

    last = last_progress(RayJobHook().get_job_logs(manifest["submission_id"]))
    assert last is not None, "no progress line in the job log"
    assert (last["rows_done"], last["rows_total"], last["tokens_out"]) == (16, 16, manifest["output_tokens"])


def _failed_job(hook, dag, conf, date):
    dag_run = dag.test(logical_date=date, run_conf=conf)
    assert task_state(dag_run, "generate") == "failed"
    jobs = jobs_of_run(hook, dag_run.run_id)
    assert len(jobs) == 1, "a bad configuration is submitted once and not retried into new jobs"
    job = jobs[0]
    assert str(job.status) in ("FAILED", "JobStatus.FAILED")
    logs = hook.get_job_logs(job.submission_id)
    assert "vLLMEngineStageUDF" not in logs, "the engine must not start for a bad configuration"
    # Refused before any engine started: the operator fails the task without a retry (AirflowFailException).
    assert "RAYLLM_REFUSED" in logs.splitlines(), "a refusal is marked so that no retry is spent on it"
    return [line for line in logs.splitlines() if line.startswith("RAYLLM_ERROR ")][-1]


def test_load_format_reaches_the_engine(quickstart_run, hook):
    """The guide's model-loading section: load_format reaches the engine as given (REPRODUCIBLE_ENGINE has it)."""
    assert_succeeded(quickstart_run["dag_run"], "answer")
    logs = hook.get_job_logs(quickstart_run["manifest"]["submission_id"])
    assert "load_format=safetensors" in logs, "vLLM's engine config line should show the load_format the task asked for"


# Bad settings the job refuses before any engine starts. The first goes the whole way (operator, Ray job, the
# task failed with the job's words); the others are judged by the same driver code in one preflight process,
# so that the suite starts one process for them rather than a Ray job each.
SUBMITTED = [
    (1, {"engine_kwargs": {"max_modle_len": 256}}, "unknown vLLM engine argument(s) ['max_modle_len']"),
]
PREFLIGHT = [
    (
        {"engine_kwargs": {"max_model_len": 256, "load_format": "runai_streamer"}},
        "engine_kwargs.load_format='runai_streamer' needs the 'vllm[runai]' extra on the cluster",
    ),
    (
        {"engine_kwargs": {"max_model_len": 256, "load_format": "tensorizer"}},
        "engine_kwargs.load_format='tensorizer' needs the 'vllm[tensorizer]' extra on the cluster",
    ),
    # The guide's cross-node settings: vLLM's CPU build would refuse them after its engine started.
    (
        {"engine_kwargs": {"max_model_len": 256, "pipeline_parallel_size": 2, "distributed_executor_backend": "ray"}},
        "engine_kwargs.distributed_executor_backend='ray': vLLM's CPU engine does not support the Ray executor",
    ),
    (
        {"engine_kwargs": {"max_model_len": 256, "pipeline_parallel_size": 2, "enforce_eager": True}},
        "engine_kwargs.enforce_eager=True with pipeline_parallel_size=2",
    ),
    # SmolLM2's config allows 8,192 positions; the engine would refuse 9,000 only after it started.
    ({"engine_kwargs": {"max_model_len": 9000}}, "engine_kwargs.max_model_len=9000 is above the model's limit of 8192"),
    # The input and the model, judged by the same driver code as the engine settings.
    ({"prompt_column": "question"}, "prompt needs column(s) ['question'] that the input lacks"),
    ({"input_uri": "/nonexistent/in.jsonl"}, "source.uris: '/nonexistent/in.jsonl' does not exist"),
    ({"model_source": "/nonexistent/model"}, "model_source '/nonexistent/model' is not a folder"),
    # The settings of the test DAG as they are: the preflight passes them, so each refusal above is its own.
    ({}, None),
]


@pytest.mark.parametrize("day, overrides, expected", SUBMITTED)
def test_bad_configuration_fails_before_any_engine_starts(
    day, overrides, expected, ray_conn, airflow_db, smollm2, test_home, hook
):
    dag = load_dag("tests/dags", "rayllm_it", "rayllm_it_sync")
    input_uri = write_jsonl(test_home / "inputs" / "small.jsonl", [{"id": 1, "prompt": "hi"}])
    output_uri = test_home / "out" / f"bad-{day}"
    conf = {"model_source": str(smollm2), "input_uri": input_uri, "output_uri": str(output_uri), **overrides}
    error = _failed_job(hook, dag, conf, utc(2026, 4, day))
    assert expected in error
    assert not (output_uri / "_manifest.json").exists()


def _preflight(ray_conn, smollm2, test_home, cases: list[dict], build: bool = False) -> list[dict]:
    """tests/integration/preflight.py over one job package per case (the test DAG's settings with the case's
    overrides), in one Ray driver process; its JSON line per case."""
    import json
    import subprocess
    import sys

    from airflow_provider_rayllm.contract.names import SPEC_FILE
    from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

    input_uri = write_jsonl(test_home / "inputs" / "small.jsonl", [{"id": 1, "prompt": "hi"}])
    folders = []
    for overrides in cases:
        i = len(list((test_home / "preflight").glob("*"))) if (test_home / "preflight").exists() else 0
        settings = dict(
            task_id="generate",
            model_source=str(smollm2),
            input_uri=input_uri,
            output_uri=str(test_home / "out" / f"preflight-{i}"),
            prompt_column="prompt",
            system_prompt="Answer briefly.",
            sampling_params={"temperature": 0, "max_tokens": 16},
            batch_size=8,
        )
        op = VLLMBatchOperator(**{**settings, **overrides})
        folder = test_home / "preflight" / str(i)
        folder.mkdir(parents=True, exist_ok=True)
        spec = op.build_spec({"ti": StandInTI("preflight", f"manual__{i}", "generate")}, folder)
        (folder / SPEC_FILE).write_text(spec.to_json())
        folders.append(str(folder))

    env = ray_driver_env(ray_conn, test_home)
    script = Path(__file__).with_name("preflight.py")
    args = ["--build", *folders] if build else folders
    done = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    lines = {}
    for text in done.stdout.splitlines():
        if text.startswith('{"folder"'):
            line = json.loads(text)
            lines[line["folder"]] = line
    return [lines[folder] for folder in folders]


def test_the_drivers_preflight_refuses_each_bad_engine_setting(ray_conn, smollm2, test_home):
    lines = _preflight(ray_conn, smollm2, test_home, [overrides for overrides, _ in PREFLIGHT])
    for line, (overrides, expected) in zip(lines, PREFLIGHT):
        if expected is None:
            assert line["error"] is None, f"the plain settings should pass the preflight: {line['error']}"
        else:
            assert line["error"] is not None and expected in line["error"], (overrides, line["error"])


def test_the_drivers_checks_import_neither_vllm_nor_torch(ray_conn, smollm2, test_home):
    """The driver's checks read the model's config files and vLLM's source: importing vLLM (and torch with
    it) cost every job tens of seconds before a bad setting was refused. Judged in a fresh driver process
    with the settings a test DAG gives, and with sampling and length settings it must still refuse. Building
    Ray's processor next imports none of them either: not torch (Ray's stage and download modules name it for
    what the engine actors do), nor transformers, which Ray's builder imports only to read the model's
    architecture for its telemetry."""
    (plain,) = _preflight(ray_conn, smollm2, test_home, [{}], build=True)
    assert plain["error"] is None, plain["error"]
    assert plain["heavy"] == [], f"the driver imported {plain['heavy']} for the plain settings"
    assert plain["built"] == [], f"building Ray's processor imported {plain['built']}"
    bad = [{"sampling_params": {"temperature": -1}}, {"engine_kwargs": {"max_model_len": 9000}}]
    refused = _preflight(ray_conn, smollm2, test_home, bad)
    assert "temperature must be non-negative" in refused[0]["error"], refused[0]["error"]
    assert "max_model_len=9000 is above the model's limit" in refused[1]["error"], refused[1]["error"]
    assert refused[-1]["heavy"] == [], f"the driver imported {refused[-1]['heavy']} to refuse them"


def test_killing_the_task_stops_the_ray_job(ray_conn, smollm2, test_home, hook):
    from airflow_provider_rayllm.exceptions import RayJobFailed
    from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

    input_uri = write_jsonl(test_home / "inputs" / "kill.jsonl", [{"prompt": q} for q in QUESTIONS])
    op = VLLMBatchOperator(
        task_id="generate",
        input_uri=input_uri,
        model_source=str(smollm2),
        prompt_column="prompt",
        output_uri=str(test_home / "out" / "kill"),
        deferrable=False,
        poll_interval=0.5,
    )
    ti = StandInTI("kill_dag", "manual__kill", "generate")
    outcome: dict = {}

    def run():
        try:
            op.execute({"ti": ti})
        except Exception as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.time() + 60
    while "submission_id" not in ti.xcom and time.time() < deadline:
        time.sleep(0.2)
    sid = ti.xcom["submission_id"]
    while hook.get_job_info(sid)["status"] != "RUNNING" and time.time() < deadline:
        time.sleep(0.2)
    killed = time.time()
    op.on_kill()
    while hook.get_job_info(sid)["status"] != "STOPPED" and time.time() - killed < 30:
        time.sleep(0.2)
    seconds_to_stop = time.time() - killed
    worker.join(timeout=60)
    assert hook.get_job_info(sid)["status"] == "STOPPED"
    assert seconds_to_stop < 10
    assert isinstance(outcome.get("error"), RayJobFailed) and "ended STOPPED" in str(outcome["error"])


def test_an_engine_that_cannot_start_fails_the_task_with_the_engines_own_reason(ray_conn, smollm2, test_home):
    """vLLM's CPU engine refuses to start when its share of RAM is not free. Ray reports the engine actor's
    death, and vLLM says "See root cause above"; the task's error must carry that root cause itself."""
    from airflow_provider_rayllm.exceptions import RayJobFailed
    from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

    op = VLLMBatchOperator(
        task_id="generate",
        input_uri=write_jsonl(test_home / "inputs" / "no-room.jsonl", [{"prompt": q} for q in QUESTIONS[:2]]),
        model_source=str(smollm2),
        prompt_column="prompt",
        engine_kwargs={"gpu_memory_utilization": 0.99},  # more than any machine running the tests has free
        output_uri=str(test_home / "out" / "no-room"),
        deferrable=False,
        poll_interval=0.5,
    )
    with pytest.raises(RayJobFailed) as failure:
        op.execute({"ti": StandInTI("no_room", "manual__no_room", "generate")})
    message = str(failure.value)
    assert "ended FAILED: ActorDiedError" in message
    assert "(caused by ValueError: Available memory on node" in message, message
    assert "less than desired CPU memory utilization (0.99," in message, message
    assert "\x1b[" not in message, "no terminal colors in the task's error"
