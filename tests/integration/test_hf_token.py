"""The guide's HF token: a model by Hugging Face id from a gated Hub, the token from an Airflow connection.

The Hub is hf_hub_server.py on loopback, serving SmolLM2 under a repo id and refusing any request without
the token. The job reaches it through HF_ENDPOINT in `job_runtime_env` (an address, not a secret); the
token travels only in the job's secrets file.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import pytest

from tests.integration.helpers import (
    assert_succeeded,
    leaked_into_ray_logs,
    load_dag,
    read_rows,
    utc,
    write_jsonl,
    xcom,
)

pytestmark = pytest.mark.integration

REPO_ID = "rayllm-test/SmolLM2-135M-Instruct"


def test_hf_token_from_a_connection_opens_a_gated_hub_and_shows_nowhere(
    ray_conn, airflow_db, smollm2, test_home, service_logs, capfd
):
    from airflow_provider_rayllm.hooks.ray_job import RayJobHook
    from tests.integration.services import hf_hub_server

    token = f"hf_{secrets.token_hex(16)}"
    input_uri = write_jsonl(
        test_home / "inputs" / "hub.jsonl",
        [{"id": i, "prompt": p} for i, p in enumerate(["What is the capital of France?", "Name a primary color."])],
    )
    with hf_hub_server(service_logs, REPO_ID, smollm2, token) as (hub_url, requests_log):
        os.environ["AIRFLOW_CONN_HF_TEST"] = json.dumps({"conn_type": "generic", "password": token})
        try:
            dag = load_dag("tests/dags", "rayllm_it", "rayllm_it_hub")
            conf = {
                "model_source": REPO_ID,
                "input_uri": input_uri,
                "output_uri": str(test_home / "out" / "hub"),
                # A fresh Hugging Face cache, so every file comes from the Hub during this run.
                "job_runtime_env": {"env_vars": {"HF_ENDPOINT": hub_url, "HF_HOME": str(test_home / "hf-home")}},
            }
            dag_run = dag.test(logical_date=utc(2026, 11, 1), run_after=utc(2026, 11, 1), run_conf=conf)
        finally:
            os.environ.pop("AIRFLOW_CONN_HF_TEST", None)
        task_output = capfd.readouterr()
        requests = [json.loads(line) for line in Path(requests_log).read_text().splitlines()]

    assert_succeeded(dag_run, "generate")
    manifest = xcom(dag_run.dag_id, dag_run.run_id, "generate", "return_value")
    assert manifest["model"] == REPO_ID and manifest["rows_out"] == 2
    assert all(r["response"].strip() for r in read_rows(manifest["output_files"]))

    # The engine's weights came from the gated Hub, and every request for the repo carried the token.
    to_repo = [r for r in requests if REPO_ID in r["path"]]
    assert any(r["method"] == "GET" and r["path"].endswith("/model.safetensors") for r in to_repo), to_repo
    assert all(r["authorized"] for r in to_repo), [r for r in to_repo if not r["authorized"]]

    # ... and it shows nowhere: the Jobs API record (entrypoint, metadata, runtime_env), the job log, XCom,
    # the task log, Ray's own log files.
    hook = RayJobHook()
    sid = manifest["submission_id"]
    assert token not in json.dumps(hook.get_job_info(sid))
    assert token not in hook.get_job_logs(sid)
    for key in ("return_value", "output_uri", "ray_job_url", "submission_id"):
        assert token not in json.dumps(xcom(dag_run.dag_id, dag_run.run_id, "generate", key))
    assert token not in task_output.out + task_output.err
    assert leaked_into_ray_logs(ray_conn["info"].temp_dir, {"hf token": token}) == []
