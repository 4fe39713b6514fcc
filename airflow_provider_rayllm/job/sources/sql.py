"""Warehouse input: the Ray job runs the query itself with Ray Data's SQL reader.

The database URI (with its password) is a job secret: it reaches every worker as the environment
variable below and is read inside the connection factory, so it is never pickled into a task.
"""

from __future__ import annotations

import functools
import os
import urllib.parse
from typing import Any

from airflow_provider_rayllm.contract.names import SQL_URI_ENV
from airflow_provider_rayllm.contract.spec import SqlSource
from airflow_provider_rayllm.job.errors import JobError


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
        conn = sqlite3.connect(path)
        # SQLite has no hash function (nor CONCAT before 3.44) for Ray's sharded reads: ours.
        conn.create_function(SQLITE_SHARD_HASH, 1, _stable_hash, deterministic=True)
        if sqlite3.sqlite_version_info < (3, 44):
            conn.create_function(
                "CONCAT", -1, lambda *parts: "".join("" if p is None else str(p) for p in parts), deterministic=True
            )
        return conn
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


SQLITE_SHARD_HASH = "rayllm_shard_hash"
# Ray's sharded read asks each reader for `MOD(ABS(<hash>(<keys>)), n) = i`; Ray's default hash (MD5)
# gives text on PostgreSQL and does not exist on SQLite, so each dialect gets one that yields a number.
SHARD_HASH = {"postgresql": "hashtext", "mysql": "CRC32", "sqlite": SQLITE_SHARD_HASH}


def _stable_hash(value: Any) -> int:
    import zlib

    return zlib.crc32(str(value).encode("utf-8"))


_CAST_TO_TEXT = {"postgresql": "TEXT", "mysql": "CHAR", "sqlite": "TEXT"}


def shard_keys_for(dialect: str, keys: list[str], columns: list[str]) -> list[str]:
    """Each key as SQL for Ray's sharded read (``MOD(ABS(hash(CONCAT(keys))), n) = i``): a column of the
    query, quoted for the dialect (a key is never SQL of its own), cast to text (the hash functions take
    text), and never NULL, so a row with a NULL key falls in a shard too instead of in none."""
    from airflow_provider_rayllm.job.sinks.table import quote

    unknown = [k for k in keys if k not in columns]
    if unknown:
        raise JobError(f"sql_shard_keys {unknown!r} are not columns of the query; its columns: {columns!r}")
    return [f"COALESCE(CAST({quote(key, dialect)} AS {_CAST_TO_TEXT[dialect]}), '')" for key in keys]


def probe(source: SqlSource) -> tuple[list[str], bool]:
    """(the query's columns, whether it returns any row), from the query limited to one row; a bad query
    or table fails here, before any engine starts."""
    try:
        conn = connect(source.dialect)
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


def read(source: SqlSource, columns: list[str]) -> Any:
    import ray.data

    from airflow_provider_rayllm.job.engines.base import LIGHT

    kwargs: dict[str, Any] = {"num_cpus": LIGHT["num_cpus"]}
    if source.shard_keys:
        kwargs["shard_keys"] = shard_keys_for(source.dialect, source.shard_keys, columns)
        kwargs["shard_hash_fn"] = SHARD_HASH.get(source.dialect, "MD5")
        if source.parallelism:
            kwargs["override_num_blocks"] = source.parallelism
    try:
        return ray.data.read_sql(source.sql, functools.partial(connect, source.dialect), **kwargs)
    except ValueError as exc:  # Ray's own check of the sharded query, before any read task runs
        raise JobError(
            f"sql_shard_keys={source.shard_keys!r} with sql_parallelism={source.parallelism}: the "
            f"{source.dialect} database cannot run the sharded query ({exc})"
        ) from None
