"""Warehouse reads over SQLite and the PostgreSQL and MariaDB servers on this machine: every row once (rows
whose shard key is NULL included), a shard key is a column and never SQL, rows fetched a chunk at a time
from a server-side cursor, and rows changed by another session while the read runs neither lost nor read
twice. The reads run on a real in-process Ray, or reader by reader in this process where a test pauses
between chunks and shards to change rows meanwhile."""

from __future__ import annotations

import math
import os
import sqlite3
from contextlib import contextmanager

import pytest

from airflow_provider_rayllm.contract.names import SQL_URI_ENV
from airflow_provider_rayllm.contract.spec import SqlSource
from airflow_provider_rayllm.job.databases import connect
from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.job.sources import sql

ROWS = 400
TABLE = f"rayllm_shards_{os.getpid()}"
DIALECTS = ["sqlite", "postgresql", "mysql"]


def _fill(dialect: str, table: str, rows: int, body_bytes: int = 0) -> None:
    """``table`` anew with ``rows`` rows (id, region, body); every fifth region is NULL."""
    mark = "?" if dialect == "sqlite" else "%s"
    text = "varchar(64)" if dialect == "mysql" else "text"
    body = "longtext" if dialect == "mysql" else "text"
    conn = connect(dialect)
    try:
        cur = conn.cursor()
        cur.execute(f"DROP TABLE IF EXISTS {table}")
        cur.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, region {text}, body {body})")
        pad = "x" * body_bytes
        values = [(i, None if i % 5 == 0 else f"r{i % 7}", f"ticket {i}{pad}") for i in range(rows)]
        for start in range(0, rows, 1000):
            cur.executemany(f"INSERT INTO {table} VALUES ({mark}, {mark}, {mark})", values[start : start + 1000])
        conn.commit()
    finally:
        conn.close()


def _run(dialect: str, *statements: str) -> None:
    conn = connect(dialect)
    try:
        cur = conn.cursor()
        for statement in statements:
            cur.execute(statement)
        conn.commit()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def uris(tmp_path_factory, postgres_dsn, mysql_uri):
    path = tmp_path_factory.mktemp("sql") / "tickets.db"
    with sqlite3.connect(path) as conn:
        # Readers beside a writer (what the changed-rows test does): a rollback-journal database would make
        # the writer wait for the reader's transaction instead.
        conn.execute("PRAGMA journal_mode=WAL")
    return {"sqlite": f"sqlite:{path}", "postgresql": postgres_dsn, "mysql": mysql_uri}


@contextmanager
def using(uris, dialect: str):
    """The job's secret (the database URI) in this process's environment, as a job's workers have it."""
    before = os.environ.get(SQL_URI_ENV)
    os.environ[SQL_URI_ENV] = uris[dialect]
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SQL_URI_ENV, None)
        else:
            os.environ[SQL_URI_ENV] = before


@pytest.fixture(scope="module")
def databases(uris):
    for dialect in DIALECTS:
        with using(uris, dialect):
            _fill(dialect, TABLE, ROWS)
    yield uris
    for dialect in ("postgresql", "mysql"):
        with using(uris, dialect):
            _run(dialect, f"DROP TABLE IF EXISTS {TABLE}")


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
        os.environ[SQL_URI_ENV] = databases[dialect]
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        started["for"] = dialect

    yield start
    ray.shutdown()
    os.environ.pop(SQL_URI_ENV, None)


COLUMNS = ["id", "region", "body"]


def test_a_shard_key_is_a_column_of_the_query_never_sql(local_ray):
    # First in the module: the sharded-query cases that follow start with SQLite too, so Ray starts once for both.
    local_ray("sqlite")
    hostile = f"id), 1); DROP TABLE {TABLE}; --"
    for keys in (["no_such_column"], [hostile]):
        source = SqlSource(sql=f"SELECT id FROM {TABLE}", dialect="sqlite", shard_keys=keys, parallelism=4)
        with pytest.raises(JobError, match=r"sql_shard_keys .* are not columns of the query"):
            sql.read(source, ["id"])
    ds, _ = sql.read(SqlSource(sql=f"SELECT id FROM {TABLE}", dialect="sqlite"), ["id"])
    assert ds.count() == ROWS


@pytest.mark.parametrize("keys", [["id"], ["region"], ["region", "id"]])
@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_sharded_query_reads_every_row_once(local_ray, dialect, keys):
    """Every fifth row has a NULL region: sharded on region, those rows are read too. PostgreSQL reads the
    shards in parallel (one reader each, one shared snapshot); MySQL and SQLite, whose sessions cannot share
    a snapshot, read the query with one reader."""
    local_ray(dialect)
    source = SqlSource(sql=f"SELECT id, region, body FROM {TABLE}", dialect=dialect, shard_keys=keys, parallelism=4)
    queries, shared = sql.plan_reads(source, COLUMNS)
    assert (len(queries), shared) == ((4, True) if dialect == "postgresql" else (1, False))
    ds, close = sql.read(source, COLUMNS, fetch_rows=64)
    try:
        ids = sorted(r["id"] for r in ds.take_all())
    finally:
        close()
    assert ids == list(range(ROWS))


def _server_side_statement(dialect: str, table: str) -> list[str]:
    """What the database server is running for a reader right now, seen from another session: a FETCH from
    our named cursor (PostgreSQL), or the reader's SELECT still sending rows (MySQL)."""
    conn = connect(dialect)
    try:
        cur = conn.cursor()
        if dialect == "postgresql":
            cur.execute(
                "SELECT query FROM pg_stat_activity WHERE query LIKE %s AND pid <> pg_backend_pid()",
                (f'FETCH FORWARD % FROM "{sql.CURSOR_PREFIX}%',),
            )
        else:
            cur.execute(
                "SELECT info FROM information_schema.processlist WHERE command = 'Query' AND info LIKE %s "
                "AND id <> CONNECTION_ID()",
                (f"SELECT % FROM {table}%",),
            )
        return [row[0] for row in cur.fetchall()]
    finally:
        conn.close()


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_table_larger_than_a_chunk_is_fetched_a_chunk_at_a_time_from_a_server_side_cursor(uris, dialect):
    """20,000 rows of about 1 kB (20 MB, more than the socket buffers hold) read 500 rows a fetch: each
    block is one fetch, and while the reader waits after its first block, the server still holds the
    result (PostgreSQL runs a FETCH of 500 from the reader's named cursor; MySQL still sends the SELECT's
    rows), so the reader has only what it fetched."""
    rows, fetch = 20_000, 500
    table = f"rayllm_chunks_{os.getpid()}"
    with using(uris, dialect):
        _fill(dialect, table, rows, body_bytes=1000)
        reader = sql.read_chunks(dialect, f"SELECT id, body FROM {table}", None, fetch)
        try:
            first = next(reader)
            if dialect != "sqlite":
                running = _server_side_statement(dialect, table)
                assert running, f"the {dialect} server holds no open read for the paused reader"
                if dialect == "postgresql":
                    assert all(q.startswith(f"FETCH FORWARD {fetch} ") for q in running), running
            blocks = [first, *reader]
        finally:
            reader.close()  # a reader left open would hold its lock on the table past the DROP below
            _run(dialect, f"DROP TABLE IF EXISTS {table}")
    assert [b.num_rows for b in blocks] == [fetch] * math.ceil(rows / fetch), "one block per fetch of 500 rows"
    ids = [i for b in blocks for i in b.column("id").to_pylist()]
    assert sorted(ids) == list(range(rows))
    from tests.integration.helpers import record_figure

    record_figure(
        f"sql_chunks_{dialect}",
        rows=rows,
        rows_read=len(ids),
        duplicate_rows=len(ids) - len(set(ids)),
        blocks=len(blocks),
        rows_per_fetch=fetch,
    )


@pytest.mark.parametrize("dialect", DIALECTS)
def test_rows_changed_while_the_read_runs_are_neither_lost_nor_read_twice(uris, dialect):
    """The read is paused after its first shard and a chunk of the second (PostgreSQL: 4 shards in parallel
    readers; MySQL and SQLite: one reader, so after two chunks), and another session moves every row to
    another shard (its region changes), deletes 40 rows and inserts 40. The read still returns the table as
    it was when the read began: each of the 400 rows once, none of the changes."""
    table = f"rayllm_moving_{os.getpid()}"
    fetch = 64
    with using(uris, dialect):
        _fill(dialect, table, ROWS)
        source = SqlSource(sql=f"SELECT id, region FROM {table}", dialect=dialect, shard_keys=["region"], parallelism=4)
        queries, shared = sql.plan_reads(source, ["id", "region"])
        snapshot, exporter = sql.export_snapshot(queries[0]) if shared else (None, None)
        readers: list = []
        try:
            readers = [sql.read_chunks(dialect, q, snapshot, fetch) for q in queries]
            blocks = list(readers[0]) if len(readers) > 1 else [next(readers[0])]
            blocks += [next(readers[-1])]
            moved = (
                "COALESCE(region, 'none') || '-moved'"
                if dialect == "sqlite"
                else "CONCAT(COALESCE(region, 'none'), '-moved')"
            )
            _run(
                dialect,
                f"UPDATE {table} SET region = {moved}",
                f"DELETE FROM {table} WHERE id >= {ROWS - 40}",
                *(f"INSERT INTO {table} VALUES ({ROWS + i}, 'new', 'new')" for i in range(40)),
            )
            for reader in readers[1:] if len(readers) > 1 else readers:
                blocks += list(reader)
        finally:
            for reader in readers:
                reader.close()  # a reader left open would hold its lock on the table past the DROP below
            if exporter is not None:
                exporter.close()
            _run(dialect, f"DROP TABLE IF EXISTS {table}")
    read = [row for b in blocks for row in b.to_pylist()]
    assert sorted(r["id"] for r in read) == list(range(ROWS)), "each row of the table as it was, once"
    assert not [r for r in read if r["region"] is not None and r["region"].endswith("-moved")], "no changed row"
    from tests.integration.helpers import record_figure

    ids = [r["id"] for r in read]
    record_figure(
        f"sql_snapshot_{dialect}",
        rows=ROWS,
        rows_read=len(ids),
        rows_lost=ROWS - len(set(ids) & set(range(ROWS))),
        duplicate_rows=len(ids) - len(set(ids)),
        readers=len(queries),
    )
