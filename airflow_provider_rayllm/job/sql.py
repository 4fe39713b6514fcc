"""Warehouse input: the Ray job runs the query itself with Ray Data's SQL reader.

The database URI (with its password) is a job secret: it reaches every worker as the environment
variable below and is read inside the connection factory, so it is never pickled into a task.
"""

from __future__ import annotations

import functools
import os
import urllib.parse
from typing import Any

from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.spec import SqlSource

SQL_URI_ENV = "RAYLLM_SQL_URI"
SINK_SQL_URI_ENV = "RAYLLM_SINK_SQL_URI"


def connect(dialect: str, env_name: str = SQL_URI_ENV) -> Any:
    uri = os.environ.get(env_name)
    if not uri:
        raise JobError(f"no database URI reached the job (environment variable {env_name} is unset)")
    if dialect == "postgresql":
        import psycopg2

        return psycopg2.connect(uri)
    if dialect == "sqlite":
        import sqlite3

        path = uri.removeprefix("sqlite:")
        if not os.path.exists(path):
            raise JobError(f"the SQLite database {path!r} does not exist on the cluster")
        return sqlite3.connect(path)
    if dialect == "mysql":
        import pymysql

        parts = urllib.parse.urlsplit(uri)
        return pymysql.connect(
            host=parts.hostname or "127.0.0.1",
            port=parts.port or 3306,
            user=urllib.parse.unquote(parts.username or ""),
            password=urllib.parse.unquote(parts.password or ""),
            database=parts.path.lstrip("/") or None,
        )
    raise JobError(f"source.dialect {dialect!r} is not supported")


def probe_columns(source: SqlSource) -> list[str]:
    """Run the query with no rows to learn its columns; a bad query or table fails here, before any engine."""
    try:
        conn = connect(source.dialect)
    except JobError:
        raise
    except Exception as exc:
        raise JobError(f"sql: cannot connect to the {source.dialect} database: {type(exc).__name__}: {exc}") from None
    try:
        cursor = conn.cursor()
        cursor.execute(f"SELECT * FROM ({source.sql}) AS rayllm_probe LIMIT 0")
        return [d[0] for d in cursor.description or []]
    except Exception as exc:
        raise JobError(f"sql: the query failed: {type(exc).__name__}: {str(exc).strip()}") from None
    finally:
        conn.close()


def read(source: SqlSource) -> Any:
    import ray.data

    kwargs: dict[str, Any] = {}
    if source.shard_keys:
        kwargs["shard_keys"] = source.shard_keys
        if source.parallelism:
            kwargs["override_num_blocks"] = source.parallelism
    return ray.data.read_sql(source.sql, functools.partial(connect, source.dialect), **kwargs)
