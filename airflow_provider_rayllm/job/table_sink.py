"""Optional warehouse output: the run's output rows written back to a table, once per run.

One transaction deletes the rows this run wrote before (matched on the run key column) and inserts
the new ones, so a rerun of the same run replaces its rows instead of adding copies. The table is
created when missing, with column types taken from the output schema.
"""

from __future__ import annotations

import json
import re
from typing import Any

from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.job.sql import SINK_SQL_URI_ENV, connect

RUN_KEY_COLUMN = "rayllm_run_key"
_PLACEHOLDER = {"postgresql": "%s", "mysql": "%s", "sqlite": "?"}
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")


def _sql_type(arrow_type: Any, dialect: str) -> str:
    import pyarrow as pa

    if pa.types.is_boolean(arrow_type):
        return "BOOLEAN"
    if pa.types.is_integer(arrow_type):
        return "BIGINT"
    if pa.types.is_floating(arrow_type):
        return "DOUBLE PRECISION" if dialect == "postgresql" else "DOUBLE" if dialect == "mysql" else "REAL"
    return "TEXT"  # text, and JSON text for lists and structs


def _value(value: Any) -> Any:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return value


def write(ds: Any, dialect: str, table: str, run_key: str, batch_rows: int = 1000) -> int:
    """Replace this run's rows in ``table`` with the rows of ``ds``; returns the rows written."""
    if not _IDENT.match(table):
        raise JobError(f"output_table {table!r} is not a plain table name")
    schema = ds.schema()
    names = list(schema.names)
    types = list(schema.types)
    if RUN_KEY_COLUMN in names:
        raise JobError(f"the output already has a column {RUN_KEY_COLUMN!r}, which output_table reserves")
    mark = _PLACEHOLDER[dialect]
    columns = ", ".join([RUN_KEY_COLUMN, *names])
    insert = f"INSERT INTO {table} ({columns}) VALUES ({', '.join([mark] * (len(names) + 1))})"
    conn = connect(dialect, SINK_SQL_URI_ENV)
    written = 0
    try:
        cur = conn.cursor()
        definitions = ", ".join([f"{RUN_KEY_COLUMN} TEXT", *(f"{n} {_sql_type(t, dialect)}" for n, t in zip(names, types))])
        cur.execute(f"CREATE TABLE IF NOT EXISTS {table} ({definitions})")
        cur.execute(f"DELETE FROM {table} WHERE {RUN_KEY_COLUMN} = {mark}", (run_key,))
        for batch in ds.iter_batches(batch_size=batch_rows, batch_format="pyarrow"):
            rows = [[run_key, *(_value(v) for v in row.values())] for row in batch.to_pylist()]
            cur.executemany(insert, rows)
            written += len(rows)
        conn.commit()
    except JobError:
        conn.rollback()
        raise
    except Exception as exc:
        conn.rollback()
        raise JobError(f"output_table {table!r}: {type(exc).__name__}: {str(exc).strip()} (nothing was written)") from None
    finally:
        conn.close()
    return written
