"""ModelUploadOperator on the local stack: a model uploaded to moto's S3 and to the GCS emulator,
repeated (skipped), changed (re-uploaded), interrupted (completed by a retry), refused when the
destination holds another model; then SmolLM2's inference from the bucket gives the local folder's answers.

The upload-only checks move the small Idefics3 folder (29 MB, seven files) rather than SmolLM2 (260 MB):
what they check does not depend on the model's size."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.integration.helpers import (
    REPRODUCIBLE_ENGINE,
    StandInTI,
    assert_succeeded,
    load_dag,
    read_rows,
    utc,
    xcom,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def s3(s3_endpoint):
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        aws_access_key_id="AKIAUP",
        aws_secret_access_key="up-secret",
        region_name="us-east-1",
    )
    client.create_bucket(Bucket="models")
    mp = pytest.MonkeyPatch()
    mp.setenv(
        "AIRFLOW_CONN_AWS_DEFAULT",
        json.dumps(
            {"conn_type": "aws", "login": "AKIAUP", "password": "up-secret", "extra": {"endpoint_url": s3_endpoint}}
        ),
    )
    yield client
    mp.undo()


@pytest.fixture(scope="module")
def small_model():
    from airflow_provider_rayllm.local.models import tiny_vlm_path

    return tiny_vlm_path()


def upload(model_source, bucket_uri, task="upload", **kw):
    """Run the operator's execute() as a task instance would (non-deferred, real Ray job)."""
    from airflow_provider_rayllm.operators.model_upload import ModelUploadOperator

    op = ModelUploadOperator(
        task_id=task, model_source=str(model_source), bucket_uri=bucket_uri, poll_interval=0.5, **kw
    )
    ti = StandInTI("upload_tests", f"manual__{bucket_uri}", task)
    return op.execute({"ti": ti}), ti


def test_fresh_then_repeated_then_changed(ray_conn, small_model, s3, tmp_path):
    first, ti = upload(small_model, "s3://models/fresh", aws_conn_id="aws_default")
    assert first["skipped"] is False and first["uploaded_files"] == first["file_count"] >= 5
    assert ti.xcom["model_uri"] == "s3://models/fresh"
    keys = {o["Key"]: o["Size"] for o in s3.list_objects_v2(Bucket="models", Prefix="fresh/")["Contents"]}
    for f in first["files"]:
        assert keys[f"fresh/{f['path']}"] == f["bytes"]
    stored = json.loads(s3.get_object(Bucket="models", Key="fresh/rayllm-model-manifest.json")["Body"].read())
    assert stored["checksum"] == first["checksum"]

    again, _ = upload(small_model, "s3://models/fresh", task="upload_again", aws_conn_id="aws_default")
    assert again["skipped"] is True and again["uploaded_files"] == 0 and again["checksum"] == first["checksum"]

    changed_dir = tmp_path / "small-changed"
    shutil.copytree(small_model, changed_dir)
    config = json.loads((changed_dir / "generation_config.json").read_text())
    (changed_dir / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.5}))
    # Same model_source name is what makes it "the same model, changed"; use overwrite for a new path.
    changed, _ = upload(
        changed_dir, "s3://models/fresh", task="upload_changed", aws_conn_id="aws_default", overwrite=True
    )
    assert changed["skipped"] is False and changed["uploaded_files"] == 1
    assert changed["checksum"] != first["checksum"]


def test_interrupted_upload_is_completed_by_a_retry(ray_conn, small_model, s3):
    first, _ = upload(small_model, "s3://models/interrupted", aws_conn_id="aws_default")
    # What an interruption leaves: no manifest, one file cut short, one missing.
    s3.delete_object(Bucket="models", Key="interrupted/rayllm-model-manifest.json")
    weights = s3.get_object(Bucket="models", Key="interrupted/model.safetensors")["Body"].read()
    s3.put_object(Bucket="models", Key="interrupted/model.safetensors", Body=weights[: len(weights) // 2])
    s3.delete_object(Bucket="models", Key="interrupted/tokenizer.json")
    retried, _ = upload(small_model, "s3://models/interrupted", task="retry", aws_conn_id="aws_default")
    assert retried["skipped"] is False and retried["uploaded_files"] >= 2
    assert retried["checksum"] == first["checksum"]
    body = s3.get_object(Bucket="models", Key="interrupted/model.safetensors")["Body"].read()
    assert body == weights


def test_another_model_at_the_destination_is_refused(ray_conn, small_model, s3, tmp_path):
    from airflow_provider_rayllm.exceptions import RayJobFailed

    upload(small_model, "s3://models/taken", aws_conn_id="aws_default")
    other = tmp_path / "other-model"
    other.mkdir()
    (other / "config.json").write_text("{}")
    with pytest.raises(RayJobFailed, match="holds another model .*overwrite=True"):
        upload(other, "s3://models/taken", task="other", aws_conn_id="aws_default")


@pytest.mark.parametrize(
    "source, expected",
    [
        ("/nonexistent/model-folder", "model_source '/nonexistent/model-folder' is not a folder on the cluster"),
        ("no-such-org/no-such-model", "cannot download it from the Hugging Face Hub"),
    ],
)
def test_bad_sources_fail_clearly(ray_conn, s3, source, expected):
    from airflow_provider_rayllm.exceptions import RayJobFailed

    with pytest.raises(RayJobFailed, match=expected.replace("(", r"\(").replace(")", r"\)")):
        upload(
            source,
            f"s3://models/bad-{abs(hash(source)) % 1000}",
            task=f"bad{abs(hash(source)) % 1000}",
            aws_conn_id="aws_default",
        )


QUICKSTART = dict(
    prompt_column="prompt",
    system_prompt="You are a helpful assistant. Answer in one or two sentences.",
    sampling_params={"temperature": 0.0, "max_tokens": 24},
    engine_kwargs=REPRODUCIBLE_ENGINE,
    batch_size=16,
)  # the settings of example_model_upload's "answer" task, with the quickstart fixture's engine_kwargs


@pytest.fixture(scope="module")
def local_answers(quickstart_run):
    """The quickstart's answers with the model read from its local folder: what every bucket must reproduce."""
    assert_succeeded(quickstart_run["dag_run"], "answer")
    return {r["id"]: r["response"] for r in quickstart_run["rows"]}


@pytest.fixture()
def gcs_conn(gcs_endpoint, service_logs, monkeypatch):
    """A bucket on the GCS emulator and a google_cloud_platform connection with a keyfile, as users have."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    from tests.integration.services import authorized_user_keyfile, oauth_token_server

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_endpoint)
    client = storage.Client(project="test", credentials=AnonymousCredentials())
    if client.lookup_bucket("gcs-models") is None:
        client.create_bucket("gcs-models")
    with oauth_token_server(service_logs) as token_uri:
        extra = {
            "keyfile_dict": authorized_user_keyfile(token_uri),
            "storage_emulator_host": gcs_endpoint,
            "project": "test",
        }
        monkeypatch.setenv("AIRFLOW_CONN_GCS_UP", json.dumps({"conn_type": "google_cloud_platform", "extra": extra}))
        yield "gcs_up"


def test_upload_to_gcs(ray_conn, smollm2, gcs_conn):
    result, _ = upload(smollm2, "gs://gcs-models/smol", task="gcs", gcp_conn_id=gcs_conn)
    assert result["skipped"] is False and result["uploaded_files"] == result["file_count"]
    again, _ = upload(smollm2, "gs://gcs-models/smol", task="gcs_again", gcp_conn_id=gcs_conn)
    assert again["skipped"] is True


def test_upload_then_infer_from_the_bucket_matches_the_local_folder(ray_conn, airflow_db, smollm2, s3, local_answers):
    date = utc(2026, 10, 1)
    dag = load_dag("dags_examples", "example_model_upload", "example_model_upload")
    conf = {
        "model_source": str(smollm2),
        "bucket_uri": "s3://models/chain",
        "max_tokens": 24,
        "engine_kwargs": REPRODUCIBLE_ENGINE,
    }
    dag_run = dag.test(logical_date=date, run_after=date, run_conf=conf)
    assert_succeeded(dag_run, "upload", "answer")
    from_bucket = xcom(dag.dag_id, dag_run.run_id, "answer", "return_value")
    assert from_bucket["model"] == "s3://models/chain"
    bucket_answers = {r["id"]: r["response"] for r in read_rows(from_bucket["output_files"])}
    assert len(bucket_answers) == 16 and bucket_answers == local_answers


def test_infer_from_gcs_matches_the_local_folder(ray_conn, smollm2, gcs_conn, local_answers, tmp_path):
    """gs:// weights: Ray's loader reads them with pyarrow's GCS client using the connection's keyfile. The
    engine's vLLM cache lives in the same bucket (``compile_cache``): what vLLM wrote there while the engine
    started (its inspection of the model's class) is saved under the prefix."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    from airflow_provider_rayllm.hooks.ray_job import RayJobHook
    from airflow_provider_rayllm.local.defaults import DEMO_INPUT
    from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

    cache = f"gs://gcs-models/vllm-cache-{tmp_path.name}"

    # The same destination as test_upload_to_gcs: skipped when that test ran first, uploaded otherwise.
    uploaded, _ = upload(smollm2, "gs://gcs-models/smol", task="gcs_chain", gcp_conn_id=gcs_conn)
    op = VLLMBatchOperator(
        task_id="answer_gcs",
        model_source=uploaded["output_uri"],
        input_uri=str(DEMO_INPUT),
        output_uri=str(tmp_path / "out"),
        gcp_conn_id=gcs_conn,
        deferrable=False,
        poll_interval=1.0,
        compile_cache=cache,
        **QUICKSTART,
    )
    manifest = op.execute({"ti": StandInTI("upload_tests", "manual__gcs_chain", "answer_gcs")})
    assert manifest["model"] == "gs://gcs-models/smol"
    answers = {r["id"]: r["response"] for r in read_rows(manifest["output_files"])}
    assert len(answers) == 16 and answers == local_answers

    # The engine actor restored the (empty) prefix before its engine started, and saved vLLM's own files to it.
    log = RayJobHook().get_job_logs(manifest["submission_id"])
    assert f"rayllm compile cache: restored 0 file(s) (0.0 MiB) from {cache}" in log, log[-3000:]
    assert f"vLLM's cache in {cache}" in log, "the driver's engine line names the cache"
    client = storage.Client(project="test", credentials=AnonymousCredentials())
    prefix = cache.removeprefix("gs://gcs-models/") + "/"
    saved = sorted(b.name.removeprefix(prefix) for b in client.list_blobs("gcs-models", prefix=prefix))
    assert "modelinfos/vllm-model_executor-models-llama-LlamaForCausalLM.json" in saved, saved


def test_missing_bucket_is_a_clear_failure_and_nothing_is_reported_uploaded(ray_conn, smollm2, s3):
    from airflow_provider_rayllm.exceptions import RayJobFailed

    with pytest.raises(RayJobFailed) as failure:
        upload(smollm2, "s3://no-such-bucket/smol", task="nobucket", aws_conn_id="aws_default")
    message = str(failure.value)
    assert "no-such-bucket" in message and "ended FAILED" in message


def test_revoked_gcs_credentials_are_a_clear_failure(ray_conn, smollm2, gcs_endpoint, service_logs, monkeypatch):
    from airflow_provider_rayllm.exceptions import RayJobFailed
    from tests.integration.services import authorized_user_keyfile, oauth_token_server

    with oauth_token_server(service_logs) as token_uri:
        extra = {
            "keyfile_dict": authorized_user_keyfile(token_uri, revoked=True),
            "storage_emulator_host": gcs_endpoint,
            "project": "test",
        }
        monkeypatch.setenv(
            "AIRFLOW_CONN_GCS_REVOKED", json.dumps({"conn_type": "google_cloud_platform", "extra": extra})
        )
        with pytest.raises(RayJobFailed) as failure:
            upload(smollm2, "gs://gcs-models/revoked", task="revoked", gcp_conn_id="gcs_revoked")
    message = str(failure.value)
    assert "ended FAILED" in message and "gs://gcs-models/revoked" in message
    assert "OAuth2 access token" in message or "invalid_grant" in message, message
    assert "revoked-refresh-token" not in message and "local-client-secret" not in message
