"""Bucket input and output over the real protocols: GCS in (the GCS emulator), S3 out (moto's server).

One engine run reads Parquet from gs://, answers, and writes Parquet to s3://, with credentials from
Airflow connections. The AWS secret is a canary: it must not show in the Jobs API record, the job's
log, Ray's log files, or XCom.
"""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.integration.helpers import (
    assert_succeeded,
    echo_connection,
    echo_operator,
    leaked_into_ray_logs,
    load_dag,
    utc,
    xcom,
)

pytestmark = pytest.mark.integration

CANARY = "canary-aws-secret-5f1e9c"
QUESTIONS = ["What is the capital of Italy?", "Name a fruit.", "What is 3 + 4?", "What color is grass?"]


@pytest.fixture(scope="module")
def endpoints(s3_endpoint, gcs_endpoint):
    return {"s3": s3_endpoint, "gcs": gcs_endpoint}


@pytest.fixture(scope="module")
def buckets(endpoints, monkeypatch_module):
    import boto3
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    s3 = boto3.client(
        "s3",
        endpoint_url=endpoints["s3"],
        aws_access_key_id="AKIATEST",
        aws_secret_access_key=CANARY,
        region_name="us-east-1",
    )
    s3.create_bucket(Bucket="answers")
    monkeypatch_module.setenv("STORAGE_EMULATOR_HOST", endpoints["gcs"])
    gcs = storage.Client(project="test", credentials=AnonymousCredentials())
    bucket = gcs.create_bucket("questions")
    sink = io.BytesIO()
    pq.write_table(pa.table({"id": list(range(len(QUESTIONS))), "prompt": QUESTIONS}), sink)
    bucket.blob("batch/part-0.parquet").upload_from_string(sink.getvalue())
    monkeypatch_module.setenv(
        "AIRFLOW_CONN_AWS_DEFAULT",
        json.dumps(
            {
                "conn_type": "aws",
                "login": "AKIATEST",
                "password": CANARY,
                "extra": {"endpoint_url": endpoints["s3"], "region_name": "us-east-1"},
            }
        ),
    )
    monkeypatch_module.setenv(
        "AIRFLOW_CONN_GCS_DEFAULT",
        json.dumps(
            {
                "conn_type": "google_cloud_platform",
                "extra": {"storage_emulator_host": endpoints["gcs"], "project": "test"},
            }
        ),
    )
    return {"s3": s3, "gcs": gcs}


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def bucket_run(ray_conn, airflow_db, smollm2, buckets):
    dag = load_dag("dags_examples", "example_gcs_parquet", "example_gcs_parquet")
    date = utc(2026, 5, 1)
    conf = {"model_source": str(smollm2), "input_uri": "gs://questions/batch/", "output_prefix": "s3://answers/runs"}
    dag_run = dag.test(logical_date=date, run_after=date, run_conf=conf)
    return {"dag_run": dag_run, "conf": conf}


def test_gcs_in_s3_out_with_connection_credentials(bucket_run, buckets):
    dag_run = bucket_run["dag_run"]
    assert_succeeded(dag_run, "generate")
    manifest = xcom(dag_run.dag_id, dag_run.run_id, "generate", "return_value")
    assert manifest["rows_in"] == manifest["rows_out"] == len(QUESTIONS)
    assert all(f["uri"].startswith("s3://answers/runs/2026-05-01/part-") for f in manifest["output_files"])
    rows = []
    for f in manifest["output_files"]:
        key = f["uri"].removeprefix("s3://answers/")
        body = buckets["s3"].get_object(Bucket="answers", Key=key)["Body"].read()
        assert len(body) == f["bytes"]
        rows.extend(pq.read_table(io.BytesIO(body)).to_pylist())
    assert sorted(r["id"] for r in rows) == list(range(len(QUESTIONS)))
    assert all(r["response"].strip() for r in rows)
    published = json.loads(
        buckets["s3"].get_object(Bucket="answers", Key="runs/2026-05-01/_manifest.json")["Body"].read()
    )
    assert published["submission_id"] == manifest["submission_id"]


def test_the_secret_shows_nowhere(bucket_run, ray_conn):
    from airflow_provider_rayllm.hooks.ray_job import RayJobHook

    dag_run = bucket_run["dag_run"]
    hook = RayJobHook()
    sid = xcom(dag_run.dag_id, dag_run.run_id, "generate", "submission_id")
    record = json.dumps(hook.get_job_info(sid))
    assert "worker_process_setup_hook" in record  # the secrets travel through the job package
    ray_token = ray_conn["info"].token  # the cluster's own secret, which the operator sends as a header
    logs = hook.get_job_logs(sid)
    for secret in (CANARY, ray_token):
        assert secret not in record
        assert secret not in logs
        for key in ("return_value", "output_uri", "ray_job_url", "submission_id"):
            assert secret not in json.dumps(xcom(dag_run.dag_id, dag_run.run_id, "generate", key))
    assert leaked_into_ray_logs(ray_conn["info"].temp_dir, {"aws": CANARY, "ray token": ray_token}) == []


@pytest.fixture(scope="module")
def echo_endpoint(service_logs):
    with echo_connection("llm_echo", 0.05, service_logs) as url:
        yield url


def _echo_op(task_id, input_uri, output_uri, **kw):
    return echo_operator(
        "llm_echo", task_id, input_uri, output_uri, aws_conn_id="aws_default", gcp_conn_id="gcs_default", **kw
    )


def test_jsonl_glob_from_s3_to_jsonl_on_gcs_and_partitioned_csv_from_gcs_to_s3(ray_conn, buckets, echo_endpoint):
    """The other formats over both protocols; the job calls a local chat endpoint, so no engine starts."""
    from tests.integration.helpers import StandInTI

    s3, gcs = buckets["s3"], buckets["gcs"]
    s3.create_bucket(Bucket="formats")
    for part in range(2):
        body = "".join(json.dumps({"id": part * 10 + i, "prompt": f"jsonl {part}-{i}"}) + "\n" for i in range(3))
        s3.put_object(Bucket="formats", Key=f"in/part-{part}.jsonl", Body=body.encode())
    s3.put_object(Bucket="formats", Key="in/notes.txt", Body=b"not matched by the glob")
    out_bucket = gcs.create_bucket("formats-out")

    manifest = _echo_op("jsonl", "s3://formats/in/*.jsonl", "gs://formats-out/jsonl", output_format="jsonl").execute(
        {"ti": StandInTI("formats", "manual__jsonl", "jsonl")}
    )
    assert manifest["rows_in"] == manifest["rows_out"] == 6
    rows = []
    for f in manifest["output_files"]:
        assert f["uri"].startswith("gs://formats-out/jsonl/part-") and f["uri"].endswith(".jsonl")
        text = out_bucket.blob(f["uri"].removeprefix("gs://formats-out/")).download_as_text()
        rows += [json.loads(line) for line in text.splitlines() if line.strip()]
    assert sorted(r["id"] for r in rows) == [0, 1, 2, 10, 11, 12]
    assert all(r["response"] == f"echo: {r['prompt']}" for r in rows)

    source = gcs.bucket("questions")
    for day, ids in (("2026-05-01", [1, 2]), ("2026-05-02", [3])):
        csv = "id,prompt\n" + "".join(f"{i},csv question {i}\n" for i in ids)
        source.blob(f"csv/date={day}/part-0.csv").upload_from_string(csv)
    manifest = _echo_op("csv", "gs://questions/csv/", "s3://formats/csv-out").execute(
        {"ti": StandInTI("formats", "manual__csv", "csv")}
    )
    assert manifest["rows_out"] == 3 and manifest["rows_errored"] == 0
    rows = []
    for f in manifest["output_files"]:
        body = s3.get_object(Bucket="formats", Key=f["uri"].removeprefix("s3://formats/"))["Body"].read()
        rows += pq.read_table(io.BytesIO(body)).to_pylist()
    assert sorted(int(r["id"]) for r in rows) == [1, 2, 3]
    assert {r["response"] for r in rows} == {f"echo: csv question {i}" for i in (1, 2, 3)}

    # Parquet from S3: each file a read task of its own, reading the bucket from the task's worker; the
    # job's object-store window reaches Ray Data.
    for part in range(2):
        sink = io.BytesIO()
        pq.write_table(
            pa.table({"id": [part * 10 + i for i in range(3)], "prompt": [f"pq {part}-{i}" for i in range(3)]}), sink
        )
        s3.put_object(Bucket="formats", Key=f"pq/part-{part}.parquet", Body=sink.getvalue())
    manifest = _echo_op("pq", "s3://formats/pq/", "s3://formats/pq-out", object_store_window_mb=8).execute(
        {"ti": StandInTI("formats", "manual__pq", "pq")}
    )
    rows = []
    for f in manifest["output_files"]:
        rows += pq.read_table(
            io.BytesIO(s3.get_object(Bucket="formats", Key=f["uri"].removeprefix("s3://formats/"))["Body"].read())
        ).to_pylist()
    assert sorted(r["id"] for r in rows) == [0, 1, 2, 10, 11, 12]
    from airflow_provider_rayllm.hooks.ray_job import RayJobHook

    assert "object store window: 8 MiB" in RayJobHook().get_job_logs(manifest["submission_id"])

    # The user clears that run: its rerun writes a new generation into the bucket, publishes it, and then
    # removes the older generation's objects; the manifest names the new one.
    from tests.integration.helpers import ClearedRun

    again = _echo_op("csv", "gs://questions/csv/", "s3://formats/csv-out").execute(
        {"ti": StandInTI("formats", "manual__csv", "csv"), "dag_run": ClearedRun(1)}
    )
    assert again["submission_id"] != manifest["submission_id"] and again["rows_out"] == 3
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="formats", Prefix="csv-out/")["Contents"]]
    # (pyarrow leaves empty "folder" marker objects such as ".../_generations/"; they name no generation)
    generations = {k.split("/_generations/")[1].split("/")[0] for k in keys if "/_generations/" in k} - {""}
    assert generations == set(), "the published and the older generation are removed once the new manifest is in place"
    names = [k.removeprefix("csv-out/") for k in keys]
    visible = {f"csv-out/{n}" for n in names if n and "/" not in n and not n.startswith(("_", "."))}
    assert visible == {f["uri"].removeprefix("s3://formats/") for f in again["output_files"]}, (
        "only the new rows are visible"
    )
    published = json.loads(s3.get_object(Bucket="formats", Key="csv-out/_manifest.json")["Body"].read())
    assert published["submission_id"] == again["submission_id"]
