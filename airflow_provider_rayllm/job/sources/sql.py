"""Warehouse input: the Ray job runs the query itself, streamed in chunks, every reader in one snapshot.

Bounded: each reader opens a server-side cursor (a named cursor on PostgreSQL, an unbuffered one on
MySQL/MariaDB; SQLite steps through its rows) and fetches ``FETCH_ROWS`` rows at a time, each chunk one
block; no reader holds the whole result, and a chunk goes downstream before the next is fetched.

Consistent: rows inserted, updated or deleted while the read runs are neither lost nor read twice, because
every reader sees one snapshot of the database:

- PostgreSQL with ``sql_shard_keys``: the driver opens a REPEATABLE READ, READ ONLY transaction and exports
  its snapshot (``pg_export_snapshot()``); each shard's reader imports it (``SET TRANSACTION SNAPSHOT``) in
  a transaction of its own, and the driver keeps the exporting transaction open until the stream has read
  everything (``Input.close``), since a snapshot can be imported only while its exporter is open. The
  shards run in parallel.
- MySQL/MariaDB and SQLite cannot hand a snapshot to another session, so one reader reads the query in one
  consistent-snapshot transaction (``START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY``; SQLite's read
  transaction) and ``sql_shard_keys`` are checked but do not split it: parallel readers there would each
  see the table at a different moment.
- PostgreSQL without shard keys: one reader, one statement, which is its own snapshot.

The database URI (with its password) is a job secret: it reaches every worker as the environment
variable below and is read inside each reader, so it is never pickled into a task.
"""

from __future__ import annotations

import functools
import uuid
from typing import Any, Callable, Iterator

from airflow_provider_rayllm.contract.names import SQL_URI_ENV
from airflow_provider_rayllm.contract.spec import SqlSource
from airflow_provider_rayllm.job.databases import connect, quote
from airflow_provider_rayllm.job.errors import JobError

# Rows per fetch, and so per block: a reader's memory is one chunk, whatever the query returns.
FETCH_ROWS = 1000
# The hash each PostgreSQL shard filters on (``MOD(ABS(hashtext(keys)), n) = i``): it yields a number.
SHARD_HASH = "hashtext"
# Shards when sql_shard_keys come without sql_parallelism.
DEFAULT_SHARDS = 4
# Names the readers' cursors (PostgreSQL shows it in pg_stat_activity: ``FETCH FORWARD n FROM "rayllm_read_..."``).
CURSOR_PREFIX = "rayllm_read_"


def shard_keys_for(dialect: str, keys: list[str], columns: list[str]) -> list[str]:
    """Each key as SQL for a shard's filter: a column of the query, quoted for the dialect (a key is never SQL
    of its own), cast to text (the hash takes text), and never NULL, so a row with a NULL key falls in a shard
    too instead of in none."""
    unknown = [k for k in keys if k not in columns]
    if unknown:
        raise JobError(f"sql_shard_keys {unknown!r} are not columns of the query; its columns: {columns!r}")
    cast = {"mysql": "CHAR"}.get(dialect, "TEXT")
    return [f"COALESCE(CAST({quote(key, dialect)} AS {cast}), '')" for key in keys]


def shard_queries(sql: str, keys_sql: list[str], shards: int) -> list[str]:
    """The query split into ``shards`` disjoint parts that together hold every row once."""
    key = keys_sql[0] if len(keys_sql) == 1 else f"CONCAT({', '.join(keys_sql)})"
    return [
        f"SELECT * FROM ({sql}) AS rayllm_shard WHERE MOD(ABS({SHARD_HASH}({key})), {shards}) = {i}"
        for i in range(shards)
    ]


def probe(source: SqlSource) -> tuple[list[str], bool]:
    """(the query's columns, whether it returns any row), from the query limited to one row; a bad query
    or table fails here, before any engine starts."""
    try:
        conn = connect(source.dialect, SQL_URI_ENV)
    except JobError:
        raise
    except Exception as exc:
        raise JobError(f"sql: cannot connect to the {source.dialect} database: {type(exc).__name__}: {exc}") from None
    try:
        cursor = conn.cursor()
        cursor.execute(f"SELECT * FROM ({source.sql}) AS rayllm_probe LIMIT 1")
        return [d[0] for d in cursor.description or []], cursor.fetchone() is not None
    except Exception as exc:
        raise JobError(f"sql: the query failed: {type(exc).__name__}: {str(exc).strip()}") from None
    finally:
        conn.close()


def _begin(conn: Any, dialect: str, snapshot: str | None) -> Any:
    """Open the reader's snapshot transaction; returns a server-side cursor inside it."""
    if dialect == "postgresql":
        conn.set_session(isolation_level="REPEATABLE READ", readonly=True)
        if snapshot is not None:
            # The transaction's first statement: psycopg2 has just sent BEGIN before it.
            conn.cursor().execute("SET TRANSACTION SNAPSHOT %s", (snapshot,))
        return conn.cursor(name=f"{CURSOR_PREFIX}{uuid.uuid4().hex[:12]}")
    if dialect == "mysql":
        import pymysql.cursors

        cursor = conn.cursor(pymysql.cursors.SSCursor)
        cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        cursor.execute("START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY")
        return cursor
    conn.isolation_level = None  # transactions by hand: BEGIN below holds one read snapshot
    conn.execute("BEGIN")
    return conn.cursor()


def read_chunks(dialect: str, query: str, snapshot: str | None, fetch_rows: int) -> Iterator[Any]:
    """One reader: the query's rows as Arrow tables of at most ``fetch_rows`` rows, fetched one chunk at a
    time from a server-side cursor inside the reader's snapshot transaction."""
    import pyarrow as pa

    conn = connect(dialect, SQL_URI_ENV)
    try:
        cursor = _begin(conn, dialect, snapshot)
        cursor.execute(query)
        while True:
            rows = cursor.fetchmany(fetch_rows)
            if not rows:
                break
            # A named cursor describes its columns only once it has fetched.
            names = [d[0] for d in cursor.description]
            yield pa.Table.from_pydict({name: [row[i] for row in rows] for i, name in enumerate(names)})
        cursor.close()
        conn.rollback()  # read only: ends the snapshot transaction
    finally:
        conn.close()


def _datasource(dialect: str, queries: list[str], snapshot: str | None, fetch_rows: int) -> Any:
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    class SQLDatasource(Datasource):
        """One read task per query; each task a generator of chunks (only primitives travel to the task)."""

        def estimate_inmemory_data_size(self) -> int | None:
            return None

        def get_read_tasks(
            self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
        ) -> list[ReadTask]:
            meta = BlockMetadata(num_rows=None, size_bytes=None, input_files=None, exec_stats=None)
            return [
                ReadTask(
                    functools.partial(read_chunks, dialect, query, snapshot, fetch_rows),
                    meta,
                    per_task_row_limit=per_task_row_limit,
                )
                for query in queries
            ]

    return SQLDatasource()


def export_snapshot(check: str) -> tuple[str, Any]:
    """A PostgreSQL snapshot for the shards to share: (its id, the connection whose open transaction keeps it
    importable; close it once every shard has read). ``check`` (a shard's query) runs once, limited to a
    row, so a database that cannot run it fails here, before any engine starts."""
    conn = connect("postgresql", SQL_URI_ENV)
    try:
        conn.set_session(isolation_level="REPEATABLE READ", readonly=True)
        cursor = conn.cursor()
        cursor.execute("SELECT pg_export_snapshot()")
        snapshot = str(cursor.fetchone()[0])
        cursor.execute(f"SELECT * FROM ({check}) AS rayllm_check LIMIT 1")
    except Exception:
        conn.close()
        raise
    return snapshot, conn


def plan_reads(source: SqlSource, columns: list[str]) -> tuple[list[str], bool]:
    """The queries the readers run, and whether they share an exported snapshot (PostgreSQL shards)."""
    if not source.shard_keys:
        return [source.sql], False
    keys_sql = shard_keys_for(source.dialect, source.shard_keys, columns)
    if source.dialect != "postgresql":
        return [source.sql], False
    return shard_queries(source.sql, keys_sql, source.parallelism or DEFAULT_SHARDS), True


def _nothing() -> None:
    return None


def read(source: SqlSource, columns: list[str], fetch_rows: int = FETCH_ROWS) -> tuple[Any, Callable[[], None]]:
    """The lazy dataset of the query's rows, and what to call once the stream has read them all (it ends the
    exported snapshot's transaction, if any)."""
    import ray.data

    from airflow_provider_rayllm.job.stream import LIGHT

    queries, shared = plan_reads(source, columns)
    snapshot: str | None = None
    close: Callable[[], None] = _nothing
    if shared:
        try:
            snapshot, exporter = export_snapshot(queries[0])
        except Exception as exc:
            raise JobError(
                f"sql_shard_keys={source.shard_keys!r} with sql_parallelism={source.parallelism}: the "
                f"{source.dialect} database cannot run the sharded query ({type(exc).__name__}: {str(exc).strip()})"
            ) from None
        close = exporter.close
    ds = ray.data.read_datasource(
        _datasource(source.dialect, queries, snapshot, fetch_rows),
        override_num_blocks=len(queries),
        num_cpus=LIGHT["num_cpus"],
    )
    return ds, close
