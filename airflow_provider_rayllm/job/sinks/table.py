"""Optional warehouse output: the published output files, written into a table at publish, all or nothing.

The files the stream wrote are read one at a time and inserted in batches inside one transaction, which
first deletes the rows this run wrote before (matched on the run key column): a rerun replaces its rows
instead of adding copies, a failure leaves the table as it was, and the driver never holds more than one
file. Each row also names the generation it came from, the one the manifest names once published.

Every identifier is quoted for its dialect, so a column named ``x"; DROP TABLE t; --`` is a column of
that name; the table name itself must be a plain name (``schema.table`` allowed).
"""

from __future__ import annotations

import json
import re
from datetime import date, datetime
from typing import Any

from airflow_provider_rayllm.contract.names import REQUEST_KEY_COLUMN, SINK_SQL_URI_ENV
from airflow_provider_rayllm.job import filesystems
from airflow_provider_rayllm.job.databases import connect, quote
from airflow_provider_rayllm.job.errors import JobError

RUN_KEY_COLUMN = "rayllm_run_key"
GENERATION_COLUMN = "rayllm_generation"
_PLACEHOLDER = {"postgresql": "%s", "mysql": "%s", "sqlite": "?"}
_TABLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")


def quote_table(table: str, dialect: str) -> str:
    if not _TABLE.match(table):
        raise JobError(f"output_table {table!r} is not a plain table name")
    return ".".join(quote(part, dialect) for part in table.split("."))


def sql_type(arrow_type: Any, dialect: str) -> str:
    import pyarrow as pa

    if pa.types.is_boolean(arrow_type):
        return "BOOLEAN"
    if pa.types.is_integer(arrow_type):
        return "BIGINT"
    if pa.types.is_floating(arrow_type):
        return "DOUBLE PRECISION" if dialect == "postgresql" else "DOUBLE" if dialect == "mysql" else "REAL"
    if pa.types.is_timestamp(arrow_type) or pa.types.is_date(arrow_type):
        return {"postgresql": "TIMESTAMP", "mysql": "DATETIME(6)", "sqlite": "TEXT"}[dialect]
    if pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type):
        return {"postgresql": "BYTEA", "mysql": "LONGBLOB", "sqlite": "BLOB"}[dialect]
    return "LONGTEXT" if dialect == "mysql" else "TEXT"  # text, and JSON text for lists and structs


def value(item: Any, dialect: str) -> Any:
    if hasattr(item, "tolist"):
        item = item.tolist()
    if isinstance(item, (list, dict)):
        return json.dumps(item, default=str)
    if dialect == "sqlite" and isinstance(item, (datetime, date)):
        return item.isoformat()
    return item


def _read(uri: str) -> Any:
    import pyarrow.json as pajson
    import pyarrow.parquet as pq

    fs, path = filesystems.filesystem_for(uri)
    with fs.open_input_file(path) as handle:
        if uri.endswith(".parquet"):
            return pq.read_table(handle)
        # The whole file as one block: a row longer than pyarrow's default block fails its parse.
        block = min(max(handle.size(), 1), (1 << 31) - 1)
        return pajson.read_json(handle, read_options=pajson.ReadOptions(block_size=block))


def _schema(files: list[str]) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schemas = []
    for uri in files:
        if uri.endswith(".parquet"):
            fs, path = filesystems.filesystem_for(uri)
            with fs.open_input_file(path) as handle:
                schemas.append(pq.ParquetFile(handle).schema_arrow)
        else:
            schemas.append(_read(uri).schema)
    try:
        return pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise JobError(f"output_table: the output files disagree on column types ({exc})") from None


def _existing_columns(cur: Any, table_sql: str) -> list[str] | None:
    try:
        cur.execute(f"SELECT * FROM {table_sql} WHERE 1 = 0")
    except Exception:
        return None
    return [d[0] for d in cur.description or []]


def write(files: list[str], dialect: str, table: str, run_key: str, generation: str, batch_rows: int = 1000) -> int:
    """Replace this run's rows in ``table`` with the rows of the given output files; returns the rows written."""
    table_sql = quote_table(table, dialect)
    if not files:
        schema_names, types = [], []
    else:
        schema = _schema(files)
        schema_names, types = list(schema.names), list(schema.types)
    reserved = {RUN_KEY_COLUMN, GENERATION_COLUMN} & set(schema_names)
    if reserved:
        raise JobError(f"the output already has column(s) {sorted(reserved)!r}, which output_table reserves")
    mark = _PLACEHOLDER[dialect]
    conn = connect(dialect, SINK_SQL_URI_ENV)
    written = 0
    try:
        cur = conn.cursor()
        existing = _existing_columns(cur, table_sql)
        if dialect == "postgresql":
            conn.rollback()  # a failed probe aborts PostgreSQL's transaction
        if existing is None:
            definitions = ", ".join(
                [
                    f"{quote(RUN_KEY_COLUMN, dialect)} TEXT",
                    f"{quote(GENERATION_COLUMN, dialect)} TEXT",
                    *(f"{quote(n, dialect)} {sql_type(t, dialect)}" for n, t in zip(schema_names, types)),
                ]
            )
            cur.execute(f"CREATE TABLE {table_sql} ({definitions})")
        else:
            # A table made before outputs carried request keys keeps working without them.
            if REQUEST_KEY_COLUMN in schema_names and REQUEST_KEY_COLUMN not in existing:
                schema_names = [n for n in schema_names if n != REQUEST_KEY_COLUMN]
            missing = [n for n in [RUN_KEY_COLUMN, GENERATION_COLUMN, *schema_names] if n not in existing]
            if missing:
                raise JobError(
                    f"output_table {table!r} has no column(s) {missing!r} that this run's output has; its columns: "
                    f"{existing!r} (the output's schema changed: write to a new table, or add the columns); nothing was written"
                )
        names = [RUN_KEY_COLUMN, GENERATION_COLUMN, *schema_names]
        insert = f"INSERT INTO {table_sql} ({', '.join(quote(n, dialect) for n in names)}) VALUES ({', '.join([mark] * len(names))})"
        cur.execute(f"DELETE FROM {table_sql} WHERE {quote(RUN_KEY_COLUMN, dialect)} = {mark}", (run_key,))
        for uri in files:
            part = _read(uri)
            for batch in part.to_batches(max_chunksize=batch_rows):
                rows = [
                    [run_key, generation, *(value(row.get(n), dialect) for n in schema_names)]
                    for row in batch.to_pylist()
                ]
                cur.executemany(insert, rows)
                written += len(rows)
        conn.commit()
    except JobError:
        conn.rollback()
        raise
    except Exception as exc:
        conn.rollback()
        raise JobError(
            f"output_table {table!r}: {type(exc).__name__}: {str(exc).strip()} (nothing was written)"
        ) from None
    finally:
        conn.close()
    return written
