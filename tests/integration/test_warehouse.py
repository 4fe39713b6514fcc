"""Warehouse in, bucket out: PostgreSQL (the server on this machine) and SQLite, answers to S3 (moto).

The shipped example DAG runs for one logical date over a table that holds the days before and after too:
its query takes only its own date's rows, and the answers land under that date's prefix. (Backfills over
several dates, disjoint per date and replaced on a rerun, are test_backfill.py's, on a real scheduler.)
Query errors, missing tables and empty results fail before any engine starts.
"""

from __future__ import annotations

import io
import json
import os
import sqlite3

import pyarrow.parquet as pq
import pytest

from tests.integration.helpers import assert_succeeded, jobs_of_run, load_dag, task_state, utc, xcom

pytestmark = pytest.mark.integration

TABLE = f"rayllm_tickets_{os.getpid()}"
# The date the example runs for: the table holds the day before and the day after as well.
DAY = "2026-06-02"
TICKETS = {
    "2026-06-01": ["My printer is jammed again.", "I cannot log in to my account.", "The invoice total is wrong."],
    "2026-06-02": ["The app crashes on start.", "Please reset my password.", "Shipping is late by a week."],
    "2026-06-03": ["The screen flickers.", "I was charged twice.", "How do I export my data?"],
}


@pytest.fixture(scope="module")
def warehouse(postgres_dsn, s3_endpoint):
    import boto3
    import psycopg2

    with psycopg2.connect(postgres_dsn) as conn, conn.cursor() as cur:
        cur.execute(f"DROP TABLE IF EXISTS {TABLE}")
        cur.execute(f"CREATE TABLE {TABLE} (id int PRIMARY KEY, body text, created_on date)")
        # A third day's tickets are in the table too: each run's query must take only its own date's.
        for day_index, day in enumerate(TICKETS):
            for i, body in enumerate(TICKETS[day]):
                cur.execute(f"INSERT INTO {TABLE} VALUES (%s, %s, %s)", (day_index * 10 + i, body, day))
    s3 = boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        aws_access_key_id="AKIAWH",
        aws_secret_access_key="wh-secret",
        region_name="us-east-1",
    )
    s3.create_bucket(Bucket="llm-outputs")
    mp = pytest.MonkeyPatch()
    user_host = postgres_dsn.split("://", 1)[1]
    login, _, rest = user_host.partition("@")
    host_port, _, database = rest.partition("/")
    host, _, port = host_port.partition(":")
    mp.setenv(
        "AIRFLOW_CONN_POSTGRES_DEFAULT",
        json.dumps(
            {"conn_type": "postgres", "host": host, "port": int(port or 5432), "login": login, "schema": database}
        ),
    )
    mp.setenv(
        "AIRFLOW_CONN_AWS_DEFAULT",
        json.dumps(
            {"conn_type": "aws", "login": "AKIAWH", "password": "wh-secret", "extra": {"endpoint_url": s3_endpoint}}
        ),
    )
    yield {"s3": s3, "dsn": postgres_dsn}
    mp.undo()
    with psycopg2.connect(postgres_dsn) as conn, conn.cursor() as cur:
        cur.execute(f"DROP TABLE IF EXISTS {TABLE}")


def _objects(s3, prefix):
    listed = s3.list_objects_v2(Bucket="llm-outputs", Prefix=prefix).get("Contents", [])
    return sorted(o["Key"] for o in listed)


def _rows(s3, manifest):
    rows = []
    for f in manifest["output_files"]:
        body = s3.get_object(Bucket="llm-outputs", Key=f["uri"].removeprefix("s3://llm-outputs/"))["Body"].read()
        rows.extend(pq.read_table(io.BytesIO(body)).to_pylist())
    return rows


@pytest.fixture(scope="module")
def example_run(ray_conn, airflow_db, smollm2, warehouse):
    conf = {"model_source": str(smollm2), "table": TABLE, "output_prefix": "s3://llm-outputs/tickets", "max_tokens": 24}
    date = utc(*map(int, DAY.split("-")))
    dag = load_dag("dags_examples", "example_postgres_to_s3", "example_postgres_to_s3")
    dag_run = dag.test(logical_date=date, run_after=date, run_conf=conf)
    assert_succeeded(dag_run, "summarize_tickets", context=DAY)
    return xcom(dag.dag_id, dag_run.run_id, "summarize_tickets", "return_value")


def test_the_example_answers_only_its_dates_rows_under_its_dates_prefix(example_run, warehouse):
    manifest, day_index = example_run, list(TICKETS).index(DAY)
    assert manifest["output_uri"] == f"s3://llm-outputs/tickets/{DAY}"
    assert manifest["rows_in"] == manifest["rows_out"] == len(TICKETS[DAY]) and manifest["rows_errored"] == 0
    rows = _rows(warehouse["s3"], manifest)
    assert sorted(r["id"] for r in rows) == [day_index * 10 + i for i in range(len(TICKETS[DAY]))]
    assert all(r["response"].strip() for r in rows)
    assert {r["body"] for r in rows} == set(TICKETS[DAY])
    # Nothing was written beside the date's own prefix (S3 folder markers of the path down to it aside).
    own = f"tickets/{DAY}/"
    written = _objects(warehouse["s3"], "tickets/")
    assert written and [key for key in written if not (key.startswith(own) or own.startswith(key))] == []


def _sql_job_error(hook, dag_run):
    jobs = jobs_of_run(hook, dag_run.run_id)
    assert len(jobs) == 1
    logs = hook.get_job_logs(jobs[0].submission_id)
    assert "vLLMEngineStageUDF" not in logs, "no engine may start for a bad query"
    return [line for line in logs.splitlines() if line.startswith("RAYLLM_ERROR ")][-1]


@pytest.mark.parametrize(
    "day, sql, expected",
    [
        (1, "SELECT id, body AS prompt FROM rayllm_no_such_table", "sql: the query failed"),
        (2, f"SELECT id, body AS prompt FROM {TABLE} WHERE id < 0", "source: no rows in the query"),
        (3, f"SELECT id, body FROM {TABLE}", "prompt needs column(s) ['prompt'] that the input lacks"),
    ],
    ids=["missing-table", "no-rows", "no-prompt-column"],  # the same in every worker (TABLE names a process)
)
def test_postgres_query_problems_fail_before_any_engine(
    day, sql, expected, ray_conn, airflow_db, smollm2, warehouse, test_home, monkeypatch
):
    from airflow_provider_rayllm.hooks.ray_job import RayJobHook

    dsn = warehouse["dsn"]
    login, _, rest = dsn.split("://", 1)[1].partition("@")
    host_port, _, database = rest.partition("/")
    monkeypatch.setenv(
        "AIRFLOW_CONN_SQL_TEST",
        json.dumps(
            {"conn_type": "postgres", "host": host_port.split(":")[0], "port": 5432, "login": login, "schema": database}
        ),
    )
    dag = load_dag("tests/dags", "rayllm_it", "rayllm_it_sql")
    conf = {"model_source": str(smollm2), "sql": sql, "output_uri": str(test_home / "out" / f"sql-bad-{day}")}
    dag_run = dag.test(logical_date=utc(2026, 7, day), run_after=utc(2026, 7, day), run_conf=conf)
    assert task_state(dag_run, "generate") == "failed"
    error = _sql_job_error(RayJobHook(), dag_run)
    assert expected in error
    if day == 1:
        assert "rayllm_no_such_table" in error  # the database's own message names the table


def test_sqlite_missing_table_is_named(ray_conn, airflow_db, smollm2, test_home, monkeypatch):
    from airflow_provider_rayllm.hooks.ray_job import RayJobHook

    db = test_home / "warehouse.sqlite"
    sqlite3.connect(db).execute("CREATE TABLE IF NOT EXISTS notes (id int, prompt text)").connection.commit()
    monkeypatch.setenv("AIRFLOW_CONN_SQL_TEST", json.dumps({"conn_type": "sqlite", "host": str(db)}))
    dag = load_dag("tests/dags", "rayllm_it", "rayllm_it_sql")
    conf = {
        "model_source": str(smollm2),
        "sql": "SELECT id, prompt FROM missing_notes",
        "output_uri": str(test_home / "out" / "sqlite-bad"),
    }
    dag_run = dag.test(logical_date=utc(2026, 7, 10), run_after=utc(2026, 7, 10), run_conf=conf)
    assert task_state(dag_run, "generate") == "failed"
    error = _sql_job_error(RayJobHook(), dag_run)
    assert "sql: the query failed: OperationalError: no such table: missing_notes" in error
