"""The guide's HF token and its Hugging Face dataset: a model by Hugging Face id and a dataset by hf:// URI from a
gated Hub, the token from an Airflow connection.

The Hub is hf_hub_server.py on loopback, serving SmolLM2 under a model repo id and LMMs-Eval-Lite-shaped rows
under a dataset repo id, and refusing any request without the token. The job reaches it through HF_ENDPOINT
in `job_runtime_env` or the host of the `hf_conn_id` connection (an address, not a secret); the token
travels only in the job's secrets file.
"""

from __future__ import annotations

import json
import os
import secrets
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration.helpers import (
    assert_succeeded,
    leaked_into_ray_logs,
    load_dag,
    read_rows,
    record_figure,
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


DATASET_ID = "rayllm-test/LMMs-Eval-Lite"


def test_a_gated_hf_dataset_is_read_with_the_connections_token_and_refused_without(ray_conn, service_logs, test_home):
    """The guide's VLM dataset path (hf://datasets/.../coco2017_cap_val/) from a gated Hub on loopback, read by the
    HTTP operator with the guide's vision_preprocess and vision_postprocess (from tests/dags/guide_blocks.py)
    against the echo endpoint: no engine starts. The token and the Hub's address come from `hf_conn_id`. A second
    job reads JSON lines from the same repo by a glob."""
    from airflow_provider_rayllm.hooks.ray_job import RayJobHook
    from tests.integration.helpers import (
        LMMS_SPLIT,
        StandInTI,
        echo_connection,
        echo_operator,
        lmms_eval_lite_repo,
        png,
    )
    from tests.integration.services import hf_hub_server

    token = f"hf_{secrets.token_hex(16)}"
    pictures = [((40 * i % 256, 200 - 10 * i, 30 + 15 * i), (32 + 4 * i, 24 + 2 * i)) for i in range(12)]
    repo = lmms_eval_lite_repo(test_home / "hub" / "lmms", [png(c, s) for c, s in pictures], files=2)
    notes = [{"id": i, "prompt": f"note {i}"} for i in range(3)]
    write_jsonl(repo / "notes" / "notes.jsonl", notes)
    guide = load_dag("tests/dags", "guide_blocks", "guide_vlm").task_dict["vision_processor"]
    uri = f"hf://datasets/{DATASET_ID}/{LMMS_SPLIT}/"

    def operator(task_id: str, **kw):
        return echo_operator(
            "llm_hub",
            task_id,
            uri,
            str(test_home / "out" / task_id),
            prompt_column=None,
            preprocess=guide.preprocess,
            postprocess=guide.postprocess,
            output_column="generated_text",  # the name the guide's vision_postprocess reads
            max_in_flight=4,
            **kw,
        )

    with (
        hf_hub_server(service_logs, None, None, token, datasets={DATASET_ID: repo}) as (hub_url, requests_log),
        echo_connection("llm_hub", 0.01, service_logs) as echo_url,
    ):
        os.environ["AIRFLOW_CONN_HF_HUB"] = json.dumps({"conn_type": "generic", "host": hub_url, "password": token})
        try:
            op = operator("hub_dataset", hf_conn_id="hf_hub")
            manifest = op.execute({"ti": StandInTI("hub_dataset", "manual__token", op.task_id)})
            hub_requests = [json.loads(line) for line in Path(requests_log).read_text().splitlines()]
            # JSON lines by a glob: Ray Data's own JSON reader, given the Hub's filesystem.
            jsonl = echo_operator(
                "llm_hub",
                "hub_jsonl",
                f"hf://datasets/{DATASET_ID}/notes/*.jsonl",
                str(test_home / "out" / "hub_jsonl"),
                hf_conn_id="hf_hub",
            )
            jsonl_manifest = jsonl.execute({"ti": StandInTI("hub_dataset", "manual__jsonl", jsonl.task_id)})
            # Without a token: the Hub's address alone, in the job's environment.
            bare = operator("hub_dataset_bare", job_runtime_env={"env_vars": {"HF_ENDPOINT": hub_url}})
            started = time.monotonic()
            with pytest.raises(Exception) as refused:
                bare.execute({"ti": StandInTI("hub_dataset", "manual__bare", bare.task_id)})
            refused_after_s = time.monotonic() - started
        finally:
            os.environ.pop("AIRFLOW_CONN_HF_HUB", None)
        stats = json.loads(urllib.request.urlopen(f"{echo_url}/stats").read())

    # Every row answered once, each from its own picture: the echo tells the image it received.
    assert manifest["rows_in"] == manifest["rows_out"] == len(pictures) and manifest["rows_errored"] == 0
    choices = "\n\nChoices:\n" + "\n".join(f"{k}. {c}" for k, c in zip("ABC", ["red", "blue", "green"]))
    expected = [
        f"echo: What color is picture {i}?\n\n[image {w}x{h} {color}]{choices}"
        for i, (color, (w, h)) in enumerate(pictures)
    ]
    rows = read_rows(manifest["output_files"])
    assert all(set(r) == {"resp"} for r in rows), "the guide's vision_postprocess gives the output row, exactly"
    assert sorted(r["resp"] for r in rows) == sorted(expected)
    answered = sorted(r["response"] for r in read_rows(jsonl_manifest["output_files"]))
    assert answered == sorted(f"echo: {n['prompt']}" for n in notes)
    assert stats["total"] == len(pictures) + len(notes) and set(stats["requests"].values()) == {1}, stats

    # The files came from the Hub, each request with the token; the token shows nowhere Ray keeps.
    to_files = [r for r in hub_requests if r["path"].startswith(f"/datasets/{DATASET_ID}/resolve/")]
    assert {r["path"].rsplit("/", 1)[1] for r in to_files} == {p.name for p in (repo / LMMS_SPLIT).iterdir()}
    assert all(r["authorized"] for r in hub_requests if DATASET_ID in r["path"])
    hook = RayJobHook()
    assert token not in json.dumps(hook.get_job_info(manifest["submission_id"]))
    assert token not in hook.get_job_logs(manifest["submission_id"])

    # Without the token the job fails before any request reaches the endpoint, naming the dataset and the cure.
    message = str(refused.value)
    for words in (repr(uri), repr(DATASET_ID), "gated", "no Hugging Face token", "hf_conn_id"):
        assert words in message, message
    record_figure(
        "hf_dataset_gated",
        rows=len(pictures),
        parquet_files=len({r["path"] for r in to_files}),
        hub_file_requests=len(to_files),
        jsonl_rows=len(notes),
        endpoint_requests=stats["total"],
        refused_without_token_after_s=round(refused_after_s, 1),
    )


@pytest.mark.parametrize(
    "path, token, says",
    [
        ("rayllm-test/Nope/data", "right", "does not exist, or the job's token (hf_conn_id) cannot see it"),
        ("rayllm-test/Nope/data", None, "does not exist; if it is private, the job has no Hugging Face token"),
        (f"{DATASET_ID}@v9/{{split}}", "right", "has no revision 'v9'"),
        (f"{DATASET_ID}/{{split}}", "hf_wrong", "is gated and the job's token (hf_conn_id) has no access to it"),
        (f"{DATASET_ID}/{{split}}", None, "is gated and the job has no Hugging Face token: give hf_conn_id"),
    ],
)
def test_the_job_tells_each_hub_refusal_apart(path, token, says, service_logs, test_home):
    """What the driver's input check says for each way a dataset cannot be read (HfFileSystem alone reads all of
    them as "no such file"), asked of the loopback Hub directly: no job is needed to see the message."""
    from airflow_provider_rayllm.job.errors import JobError
    from airflow_provider_rayllm.job.sources.hub import check_dataset
    from tests.integration.helpers import LMMS_SPLIT, lmms_eval_lite_repo, png
    from tests.integration.services import hf_hub_server

    right = f"hf_{secrets.token_hex(16)}"
    repo = lmms_eval_lite_repo(test_home / "hub" / "lmms-refusals", [png((10, 20, 30))])
    uri = f"hf://datasets/{path.format(split=LMMS_SPLIT)}"
    with hf_hub_server(service_logs, None, None, right, datasets={DATASET_ID: repo}) as (hub_url, _):
        env = {"HF_ENDPOINT": hub_url}
        if token:
            env["HF_TOKEN"] = right if token == "right" else token
        with pytest.raises(JobError) as refused:
            check_dataset(uri, env)
        check_dataset(f"hf://datasets/{DATASET_ID}/{LMMS_SPLIT}", {"HF_ENDPOINT": hub_url, "HF_TOKEN": right})
    org, name = path.split("/")[:2]
    assert str(refused.value).startswith(f"input_uri {uri!r}: dataset {org + '/' + name.split('@')[0]!r} on {hub_url}")
    assert says in str(refused.value), str(refused.value)
