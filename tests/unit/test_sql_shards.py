"""Sharded warehouse reads: the query is split into parallel reads (one block each) on a real in-process
Ray, over SQLite and the PostgreSQL and MariaDB servers on this machine; every row comes back exactly once,
rows whose shard key is NULL included, and a shard key is a column, never SQL."""

from __future__ import annotations

import os
import sqlite3

import pytest

from airflow_provider_rayllm.contract.spec import SqlSource
from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.job.sources import sql

ROWS = 400
TABLE = f"rayllm_shards_{os.getpid()}"


@pytest.fixture(scope="module")
def mysql_uri():
    """The MariaDB/MySQL server on the machine. Missing: a skip for a user, a failure in CI."""
    uri = os.environ.get("RAYLLM_TEST_MYSQL", "mysql://root@127.0.0.1:3306/test")
    os.environ[sql.SQL_URI_ENV] = uri
    try:
        sql.connect("mysql").close()
    except Exception as exc:
        message = f"no MySQL/MariaDB at {uri}: {exc}"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI requires it)")
        pytest.skip(message)
    finally:
        os.environ.pop(sql.SQL_URI_ENV, None)
    return uri


@pytest.fixture(scope="module")
def databases(tmp_path_factory, postgres_dsn, mysql_uri):
    import psycopg2
    import pymysql

    path = tmp_path_factory.mktemp("sql") / "tickets.db"
    with sqlite3.connect(path) as conn:
        conn.execute(f"CREATE TABLE {TABLE} (id INTEGER PRIMARY KEY, region TEXT, body TEXT)")
        conn.executemany(
            f"INSERT INTO {TABLE} VALUES (?, ?, ?)",
            [(i, None if i % 5 == 0 else f"r{i % 7}", f"ticket {i}") for i in range(ROWS)],
        )
    with psycopg2.connect(postgres_dsn) as conn, conn.cursor() as cur:
        cur.execute(f"DROP TABLE IF EXISTS {TABLE}")
        cur.execute(f"CREATE TABLE {TABLE} (id int PRIMARY KEY, region text, body text)")
        cur.executemany(
            f"INSERT INTO {TABLE} VALUES (%s, %s, %s)",
            [(i, None if i % 5 == 0 else f"r{i % 7}", f"ticket {i}") for i in range(ROWS)],
        )
    os.environ[sql.SQL_URI_ENV] = mysql_uri
    conn = sql.connect("mysql")
    with conn.cursor() as cur:
        cur.execute(f"DROP TABLE IF EXISTS {TABLE}")
        cur.execute(f"CREATE TABLE {TABLE} (id int PRIMARY KEY, region varchar(8), body varchar(64))")
        cur.executemany(
            f"INSERT INTO {TABLE} VALUES (%s, %s, %s)",
            [(i, None if i % 5 == 0 else f"r{i % 7}", f"ticket {i}") for i in range(ROWS)],
        )
    conn.commit()
    yield {"sqlite": f"sqlite:{path}", "postgresql": postgres_dsn, "mysql": mysql_uri}
    with psycopg2.connect(postgres_dsn) as conn, conn.cursor() as cur:
        cur.execute(f"DROP TABLE IF EXISTS {TABLE}")
    conn = pymysql.connect(host="127.0.0.1", user="root", password="", database="test")
    with conn.cursor() as cur:
        cur.execute(f"DROP TABLE IF EXISTS {TABLE}")
    conn.close()


@pytest.fixture(scope="module")
def local_ray(databases):
    """Start (or restart) an in-process Ray whose workers see the given database's URI in their
    environment, as a job's workers see the secret the operator sends."""
    import ray

    started = {"for": None}

    def start(dialect: str) -> None:
        if started["for"] == dialect:
            return
        ray.shutdown()
        os.environ[sql.SQL_URI_ENV] = databases[dialect]
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        started["for"] = dialect

    yield start
    ray.shutdown()
    os.environ.pop(sql.SQL_URI_ENV, None)


COLUMNS = ["id", "region", "body"]


@pytest.mark.parametrize("keys", [["id"], ["region"], ["region", "id"]])
@pytest.mark.parametrize("dialect", ["sqlite", "postgresql", "mysql"])
def test_a_sharded_query_is_read_in_parallel_blocks_with_every_row_once(local_ray, dialect, keys):
    """Every fifth row has a NULL region: sharded on region, those rows are read too."""
    local_ray(dialect)
    source = SqlSource(sql=f"SELECT id, region, body FROM {TABLE}", dialect=dialect, shard_keys=keys, parallelism=4)
    ds = sql.read(source, COLUMNS).materialize()
    assert ds.num_blocks() == 4, "one block per shard"
    ids = sorted(r["id"] for r in ds.take_all())
    assert ids == list(range(ROWS))


def test_a_shard_key_is_a_column_of_the_query_never_sql(local_ray):
    local_ray("sqlite")
    hostile = f"id), 1); DROP TABLE {TABLE}; --"
    for keys in (["no_such_column"], [hostile]):
        source = SqlSource(sql=f"SELECT id FROM {TABLE}", dialect="sqlite", shard_keys=keys, parallelism=4)
        with pytest.raises(JobError, match=r"sql_shard_keys .* are not columns of the query"):
            sql.read(source, ["id"])
    assert sql.read(SqlSource(sql=f"SELECT id FROM {TABLE}", dialect="sqlite"), ["id"]).count() == ROWS
