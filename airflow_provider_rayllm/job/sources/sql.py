"""Warehouse input: the Ray job runs the query itself with Ray Data's SQL reader.

The database URI (with its password) is a job secret: it reaches every worker as the environment
variable below and is read inside the connection factory, so it is never pickled into a task.
"""

from __future__ import annotations

import functools
from typing import Any

from airflow_provider_rayllm.contract.names import SQL_URI_ENV
from airflow_provider_rayllm.contract.spec import SqlSource
from airflow_provider_rayllm.job.databases import SQLITE_SHARD_HASH, connect, quote
from airflow_provider_rayllm.job.errors import JobError

# Ray's sharded read asks each reader for `MOD(ABS(<hash>(<keys>)), n) = i`; Ray's default hash (MD5)
# gives text on PostgreSQL and does not exist on SQLite, so each dialect gets one that yields a number.
SHARD_HASH = {"postgresql": "hashtext", "mysql": "CRC32", "sqlite": SQLITE_SHARD_HASH}
_CAST_TO_TEXT = {"postgresql": "TEXT", "mysql": "CHAR", "sqlite": "TEXT"}


def shard_keys_for(dialect: str, keys: list[str], columns: list[str]) -> list[str]:
    """Each key as SQL for Ray's sharded read (``MOD(ABS(hash(CONCAT(keys))), n) = i``): a column of the
    query, quoted for the dialect (a key is never SQL of its own), cast to text (the hash functions take
    text), and never NULL, so a row with a NULL key falls in a shard too instead of in none."""
    unknown = [k for k in keys if k not in columns]
    if unknown:
        raise JobError(f"sql_shard_keys {unknown!r} are not columns of the query; its columns: {columns!r}")
    return [f"COALESCE(CAST({quote(key, dialect)} AS {_CAST_TO_TEXT[dialect]}), '')" for key in keys]


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


def read(source: SqlSource, columns: list[str]) -> Any:
    import ray.data

    from airflow_provider_rayllm.job.stream import LIGHT

    kwargs: dict[str, Any] = {"num_cpus": LIGHT["num_cpus"]}
    if source.shard_keys:
        kwargs["shard_keys"] = shard_keys_for(source.dialect, source.shard_keys, columns)
        kwargs["shard_hash_fn"] = SHARD_HASH.get(source.dialect, "MD5")
        if source.parallelism:
            kwargs["override_num_blocks"] = source.parallelism
    try:
        return ray.data.read_sql(source.sql, functools.partial(connect, source.dialect, SQL_URI_ENV), **kwargs)
    except ValueError as exc:  # Ray's own check of the sharded query, before any read task runs
        raise JobError(
            f"sql_shard_keys={source.shard_keys!r} with sql_parallelism={source.parallelism}: the "
            f"{source.dialect} database cannot run the sharded query ({exc})"
        ) from None
