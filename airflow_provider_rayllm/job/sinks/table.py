"""Optional warehouse output: the published rows in a table, switched together with the manifest.

The table and the prefix's manifest are two stores with no transaction in common, so the table's rows are
written in two steps around the manifest, and every run first repairs what a crash left:

1. ``stage`` (before the manifest): the output files are read one at a time and inserted in batches into a
   staging table of this generation's own (``rayllm_staged_<id>``, beside the output table, with its column
   types), and the ledger ``rayllm_table_generations`` records the generation as ``staged``; one commit.
   Readers of the output table see nothing new: a crash here leaves the old rows and the old manifest.
2. ``switched`` (around the manifest's write): one transaction deletes the run key's rows, copies the staged
   rows in, and marks the generation ``published`` in the ledger (the run key's earlier ``published`` entry
   goes); the manifest is written while that transaction is open and it commits right after. A failure
   before the manifest rolls it back (both old); the commit follows the manifest's write by one round trip.
   If the commit itself fails, the switch is tried again in a new transaction.
3. ``repair`` (at the start of every run of the run key): if the published manifest names a generation the
   ledger still calls ``staged`` (the driver died between the manifest and the commit), it is switched in
   now; staged generations no manifest names (attempts that died before the manifest) are dropped. Each
   step is idempotent: a switch of a ``published`` generation changes nothing.

So a crash before the manifest leaves both old, a crash after the commit both new, and the one window
between (the commit's round trip) is closed by the next run. The ledger's ``published`` row per table and
run key names the generation the table holds, the one the manifest names. Each row also carries its
generation (``rayllm_generation``) and run key.

Every identifier is quoted for its dialect, so a column named ``x"; DROP TABLE t; --`` is a column of
that name; the table name itself must be a plain name (``schema.table`` allowed).
"""

from __future__ import annotations

import hashlib
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
LEDGER = "rayllm_table_generations"
STAGED, PUBLISHED = "staged", "published"
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


def _beside(table: str, name: str) -> str:
    """``name`` in the output table's schema (``schema.name``, or plain)."""
    schema = table.rpartition(".")[0]
    return f"{schema}.{name}" if schema else name


def staged_table(table: str, generation: str) -> str:
    """This generation's staging table, beside the output table; its name is a digest (a plain identifier
    within every dialect's length limit)."""
    return _beside(table, "rayllm_staged_" + hashlib.sha256(f"{table}\0{generation}".encode()).hexdigest()[:16])


def ledger_table(table: str) -> str:
    return _beside(table, LEDGER)


def ensure_ledger(cur: Any, dialect: str, table: str) -> str:
    """The ledger (one row per staged or published generation of a table), created when missing; its SQL name."""
    ledger_sql = quote_table(ledger_table(table), dialect)
    cur.execute(
        f"CREATE TABLE IF NOT EXISTS {ledger_sql} (table_name TEXT, run_key TEXT, generation TEXT, "
        f"staged_table TEXT, column_names {'LONGTEXT' if dialect == 'mysql' else 'TEXT'}, row_count BIGINT, state TEXT)"
    )
    return ledger_sql


def _create_like(cur: Any, dialect: str, staged_sql: str, table_sql: str) -> None:
    """The staging table with the output table's column types, so that a value the table refuses is refused
    at staging, and the copy into the table needs no cast."""
    if dialect == "postgresql":
        cur.execute(f"CREATE TABLE {staged_sql} (LIKE {table_sql})")
    elif dialect == "mysql":
        cur.execute(f"CREATE TABLE {staged_sql} LIKE {table_sql}")
    else:
        cur.execute(f"CREATE TABLE {staged_sql} AS SELECT * FROM {table_sql} WHERE 0")


def drop_quietly(conn: Any, table_sql: str) -> None:
    """Best effort: a staging table nobody needs any more (the next run's repair drops what this leaves)."""
    try:
        conn.rollback()
        conn.cursor().execute(f"DROP TABLE IF EXISTS {table_sql}")
        conn.commit()
    except Exception:
        pass


def _prepare_table(cur: Any, dialect: str, table: str, names: list[str], types: list[Any]) -> tuple[str, list[str]]:
    """The output table, created (empty) when missing; refused when it lacks a column this output has. Returns
    the table as SQL and the columns to write (an older table without request keys is written without them)."""
    table_sql = quote_table(table, dialect)
    existing = _existing_columns(cur, table_sql)
    if dialect == "postgresql":
        cur.connection.rollback()  # a failed probe aborts PostgreSQL's transaction
    if existing is None:
        definitions = ", ".join(
            [
                f"{quote(RUN_KEY_COLUMN, dialect)} TEXT",
                f"{quote(GENERATION_COLUMN, dialect)} TEXT",
                *(f"{quote(n, dialect)} {sql_type(t, dialect)}" for n, t in zip(names[2:], types)),
            ]
        )
        cur.execute(f"CREATE TABLE {table_sql} ({definitions})")
    else:
        # A table made before outputs carried request keys keeps working without them.
        if REQUEST_KEY_COLUMN in names and REQUEST_KEY_COLUMN not in existing:
            names = [n for n in names if n != REQUEST_KEY_COLUMN]
        missing = [n for n in names if n not in existing]
        if missing:
            raise JobError(
                f"output_table {table!r} has no column(s) {missing!r} that this run's output has; its columns: "
                f"{existing!r} (the output's schema changed: write to a new table, or add the columns); nothing was written"
            )
    return table_sql, names


def stage(files: list[str], dialect: str, table: str, run_key: str, generation: str, batch_rows: int = 1000) -> int:
    """Step 1 of the module's docstring: the rows of the given output files into this generation's staging
    table, and the generation into the ledger as staged, in one commit. Returns the rows staged; the output
    table's rows are not touched."""
    quote_table(table, dialect)
    if not files:
        schema_names, types = [], []
    else:
        schema = _schema(files)
        schema_names, types = list(schema.names), list(schema.types)
    reserved = {RUN_KEY_COLUMN, GENERATION_COLUMN} & set(schema_names)
    if reserved:
        raise JobError(f"the output already has column(s) {sorted(reserved)!r}, which output_table reserves")
    names = [RUN_KEY_COLUMN, GENERATION_COLUMN, *schema_names]
    mark = _PLACEHOLDER[dialect]
    staged = staged_table(table, generation)
    staged_sql = quote_table(staged, dialect)
    conn = connect(dialect, SINK_SQL_URI_ENV)
    written = 0
    try:
        cur = conn.cursor()
        table_sql, names = _prepare_table(cur, dialect, table, names, types)
        schema_names = names[2:]
        insert = f"INSERT INTO {staged_sql} ({', '.join(quote(n, dialect) for n in names)}) VALUES ({', '.join([mark] * len(names))})"
        ledger_sql = ensure_ledger(cur, dialect, table)
        conn.commit()  # the output table and the ledger exist (MySQL commits its DDL at once anyway)
        cur.execute(f"DROP TABLE IF EXISTS {staged_sql}")
        _create_like(cur, dialect, staged_sql, table_sql)
        for uri in files:
            part = _read(uri)
            for batch in part.to_batches(max_chunksize=batch_rows):
                rows = [
                    [run_key, generation, *(value(row.get(n), dialect) for n in schema_names)]
                    for row in batch.to_pylist()
                ]
                cur.executemany(insert, rows)
                written += len(rows)
        cur.execute(f"DELETE FROM {ledger_sql} WHERE table_name = {mark} AND generation = {mark}", (table, generation))
        cur.execute(
            f"INSERT INTO {ledger_sql} (table_name, run_key, generation, staged_table, column_names, row_count, state) "
            f"VALUES ({', '.join([mark] * 7)})",
            (table, run_key, generation, staged, json.dumps(names), written, STAGED),
        )
        conn.commit()
    except JobError:
        drop_quietly(conn, staged_sql)
        raise
    except Exception as exc:
        drop_quietly(conn, staged_sql)
        raise JobError(
            f"output_table {table!r}: {type(exc).__name__}: {str(exc).strip()} (nothing was written)"
        ) from None
    finally:
        conn.close()
    return written
