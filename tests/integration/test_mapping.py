"""Dynamic task mapping: example_sharded_http answers each shard in its own map index, Ray job and prefix."""

from __future__ import annotations

import pytest

from tests.integration.helpers import echo_connection, load_dag, read_rows, utc, write_jsonl

pytestmark = pytest.mark.integration


@pytest.fixture()
def echo_default(service_logs):
    """The example's `llm_endpoint_default` connection pointed at a local echo endpoint."""
    with echo_connection("llm_endpoint_default", 0.02, service_logs) as url:
        yield url


def _mapped_values(dag_id: str, run_id: str, task_id: str, key: str) -> dict[int, object]:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.scalars(
            select(XComModel).where(
                XComModel.dag_id == dag_id,
                XComModel.run_id == run_id,
                XComModel.task_id == task_id,
                XComModel.key == key,
            )
        ).all()
        return {row.map_index: row.value for row in rows}


def test_each_shard_is_its_own_map_index_job_and_prefix(ray_conn, airflow_db, echo_default, test_home):
    from airflow_provider_rayllm.hooks.ray_job import RayJobHook

    sizes = [3, 5, 4]
    for shard, size in enumerate(sizes):
        write_jsonl(
            test_home / "inputs" / "shards" / f"part-{shard}.jsonl",
            [{"id": i, "prompt": f"shard {shard} row {i}"} for i in range(size)],
        )
    dag = load_dag("dags_examples", "example_sharded_http", "example_sharded_http")
    conf = {"input_glob": str(test_home / "inputs" / "shards" / "part-*.jsonl"), "model": "echo"}
    dag_run = dag.test(logical_date=utc(2026, 9, 1), run_after=utc(2026, 9, 1), run_conf=conf)

    mapped = [ti for ti in dag_run.get_task_instances() if ti.task_id == "answer_shard"]
    assert sorted(ti.map_index for ti in mapped) == list(range(len(sizes)))
    assert all(str(ti.state) == "success" for ti in mapped), [(ti.map_index, ti.state) for ti in mapped]

    manifests = _mapped_values(dag_run.dag_id, dag_run.run_id, "answer_shard", "return_value")
    assert sorted(manifests) == list(range(len(sizes)))
    prefixes = {m["output_uri"] for m in manifests.values()}
    jobs = {m["submission_id"] for m in manifests.values()}
    assert len(prefixes) == len(jobs) == len(sizes), "each map index has its own prefix and Ray job"
    for index, manifest in manifests.items():
        # shards() sorts the files, so map index i answers part-i
        assert manifest["output_uri"].rstrip("/").endswith(f"map_{index}")
        rows = read_rows(manifest["output_files"])
        assert sorted(r["prompt"] for r in rows) == sorted(f"shard {index} row {i}" for i in range(sizes[index]))
        assert manifest["rows_out"] == sizes[index]
        assert all(r["response"] == f"echo: {r['prompt']}" for r in rows)
        assert RayJobHook().get_job_info(manifest["submission_id"])["status"] == "SUCCEEDED"
