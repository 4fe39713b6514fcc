"""The output table's switch to a staged generation, and the repair of a switch a crash cut short.

Steps 2 and 3 of ``sinks.table``'s docstring: ``switched`` wraps the manifest's write in the transaction
that puts the staged rows in the table; ``repair`` runs at the start of every run of a run key.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from typing import Any, Iterator

from airflow_provider_rayllm.contract.names import SINK_SQL_URI_ENV
from airflow_provider_rayllm.job.databases import connect, quote
from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.job.sinks.table import (
    _PLACEHOLDER,
    PUBLISHED,
    RUN_KEY_COLUMN,
    STAGED,
    drop_quietly,
    ledger_table,
    quote_table,
)

log = logging.getLogger("airflow_provider_rayllm.job")


def _ledger_exists(cur: Any, ledger_sql: str) -> bool:
    try:
        cur.execute(f"SELECT 1 FROM {ledger_sql} WHERE 1 = 0")
        return True
    except Exception:
        return False


def _switch_statements(cur: Any, dialect: str, table: str, generation: str) -> str | None:
    """The switch, uncommitted: the run key's rows replaced by the staged ones, the generation marked
    published (and the run key's earlier published entry gone). Returns the staging table to drop after the
    commit; None when the generation is published already (nothing to do)."""
    mark = _PLACEHOLDER[dialect]
    ledger_sql = quote_table(ledger_table(table), dialect)
    lock = "" if dialect == "sqlite" else " FOR UPDATE"  # two switches of one generation: one waits
    cur.execute(
        f"SELECT run_key, state, staged_table, column_names FROM {ledger_sql} "
        f"WHERE table_name = {mark} AND generation = {mark}{lock}",
        (table, generation),
    )
    found = cur.fetchone()
    if found is None:
        raise JobError(f"output_table {table!r}: generation {generation!r} was never staged")
    run_key, state, staged, column_names = found
    if state == PUBLISHED:
        return None
    table_sql, staged_sql = quote_table(table, dialect), quote_table(staged, dialect)
    columns = ", ".join(quote(name, dialect) for name in json.loads(column_names))
    cur.execute(f"DELETE FROM {table_sql} WHERE {quote(RUN_KEY_COLUMN, dialect)} = {mark}", (run_key,))
    cur.execute(f"INSERT INTO {table_sql} ({columns}) SELECT {columns} FROM {staged_sql}")
    cur.execute(
        f"DELETE FROM {ledger_sql} WHERE table_name = {mark} AND run_key = {mark} AND state = {mark}",
        (table, run_key, PUBLISHED),
    )
    cur.execute(
        f"UPDATE {ledger_sql} SET state = {mark} WHERE table_name = {mark} AND generation = {mark}",
        (PUBLISHED, table, generation),
    )
    return str(staged_sql)


@contextmanager
def switched(dialect: str, table: str, generation: str) -> Iterator[None]:
    """The switch's transaction held open around the body (the manifest's write): an error in the body
    rolls it back; after the body it commits. A commit that fails is tried once more as a switch of its own;
    when that fails too, the error says the next run switches it."""
    conn = connect(dialect, SINK_SQL_URI_ENV)
    try:
        try:
            staged = _switch_statements(conn.cursor(), dialect, table, generation)
        except JobError:
            raise
        except Exception as exc:
            raise JobError(
                f"output_table {table!r}: the switch to generation {generation!r} failed before the manifest: "
                f"{type(exc).__name__}: {str(exc).strip()}; nothing was published"
            ) from None
        try:
            yield
        except BaseException:
            conn.rollback()
            raise
        try:
            conn.commit()
        except Exception as exc:
            log.warning("output_table %s: the switch's commit failed (%s); switching again", table, exc)
            switch(dialect, table, generation)
            return
        if staged is not None:
            drop_quietly(conn, staged)
    finally:
        conn.close()


def switch(dialect: str, table: str, generation: str) -> bool:
    """The switch in a transaction of its own (idempotent). Returns whether it changed the table."""
    conn = connect(dialect, SINK_SQL_URI_ENV)
    try:
        staged = _switch_statements(conn.cursor(), dialect, table, generation)
        conn.commit()
        if staged is not None:
            drop_quietly(conn, staged)
        return staged is not None
    except JobError:
        conn.rollback()
        raise
    except Exception as exc:
        conn.rollback()
        raise JobError(
            f"output_table {table!r}: the manifest names generation {generation!r} but its rows could not be "
            f"switched in ({type(exc).__name__}: {str(exc).strip()}); the next run switches them"
        ) from None
    finally:
        conn.close()


def repair(dialect: str, table: str, run_key: str, published: str | None) -> list[str]:
    """Step 3: the generation the manifest names switched in if a crash left it staged; staged generations of
    this run key that no manifest names dropped (and staging tables a crash left after a switch). Returns
    what it did, one line each."""
    mark = _PLACEHOLDER[dialect]
    ledger_sql = quote_table(ledger_table(table), dialect)
    done: list[str] = []
    conn = connect(dialect, SINK_SQL_URI_ENV)
    try:
        cur = conn.cursor()
        if not _ledger_exists(cur, ledger_sql):
            return done
        cur.execute(
            f"SELECT generation, state, staged_table FROM {ledger_sql} WHERE table_name = {mark} AND run_key = {mark}",
            (table, run_key),
        )
        entries = cur.fetchall()
        conn.rollback()
    finally:
        conn.close()
    for generation, state, staged in entries:
        if generation == published and state == STAGED:
            switch(dialect, table, generation)
            done.append(f"switched in generation {generation} (the manifest names it; a crash cut its switch short)")
            continue
        conn = connect(dialect, SINK_SQL_URI_ENV)
        try:
            drop_quietly(conn, quote_table(staged, dialect))
            if state == STAGED:
                cur = conn.cursor()
                cur.execute(
                    f"DELETE FROM {ledger_sql} WHERE table_name = {mark} AND generation = {mark}", (table, generation)
                )
                conn.commit()
                done.append(f"dropped staged generation {generation} (no manifest names it)")
        finally:
            conn.close()
    return done
