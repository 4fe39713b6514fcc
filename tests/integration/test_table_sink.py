"""Writing output rows back to a table: once per run, replaced on rerun, all or nothing, any column name.

Real PostgreSQL (the server on this machine) and SQLite; the rows come from output files as the job
wrote them.
"""

from __future__ import annotations

import json
import sqlite3

import pyarrow as pa
import pytest

from airflow_provider_rayllm.contract.names import SINK_SQL_URI_ENV
from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.job.sinks import table as table_sink
from airflow_provider_rayllm.job.sources.sql import connect

pytestmark = pytest.mark.integration


_FILES = iter(range(10**6))


def rows_file(tmp_path, table: pa.Table) -> list[str]:
    """The table as one output file, as the job's sink writes it."""
    import pyarrow.parquet as pq

    path = tmp_path / f"part-{next(_FILES):06d}.parquet"
    pq.write_table(table, path)
    return [str(path)]


def rows(tmp_path, ids, answer="ok"):
    return rows_file(
        tmp_path,
        pa.table({"id": ids, "response": [f"{answer} {i}" for i in ids], "embedding": [[0.5, 0.25]] * len(ids)}),
    )


def count(dialect, table, run_key=None):
    conn = connect(dialect, SINK_SQL_URI_ENV)
    try:
        cur = conn.cursor()
        mark = "?" if dialect == "sqlite" else "%s"
        if run_key is None:
            cur.execute(f"SELECT COUNT(*) FROM {table}")
        else:
            cur.execute(f"SELECT COUNT(*) FROM {table} WHERE rayllm_run_key = {mark}", (run_key,))
        return cur.fetchone()[0]
    finally:
        conn.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request, tmp_path, monkeypatch):
    table = f"rayllm_sink_{request.node.name.split('[')[0][-20:]}_{tmp_path.name[-6:]}".replace("-", "_")
    if request.param == "sqlite":
        monkeypatch.setenv(SINK_SQL_URI_ENV, f"sqlite:{tmp_path / 'w.sqlite'}")
        sqlite3.connect(tmp_path / "w.sqlite").close()
    else:
        dsn = request.getfixturevalue("postgres_dsn")
        monkeypatch.setenv(SINK_SQL_URI_ENV, dsn)
    yield request.param, table
    if request.param == "postgresql":
        conn = connect("postgresql", SINK_SQL_URI_ENV)
        conn.cursor().execute(f"DROP TABLE IF EXISTS {table}")
        conn.commit()
        conn.close()


def test_rerun_replaces_only_its_own_rows(database, tmp_path):
    dialect, table = database
    assert table_sink.write(rows(tmp_path, [1, 2, 3]), dialect, table, "dag/run-1/t/-1", "gen-a") == 3
    assert table_sink.write(rows(tmp_path, [7, 8]), dialect, table, "dag/run-2/t/-1", "gen-b") == 2
    assert table_sink.write(rows(tmp_path, [1, 2, 3], answer="again"), dialect, table, "dag/run-1/t/-1", "gen-c") == 3
    assert count(dialect, table) == 5
    assert count(dialect, table, "dag/run-1/t/-1") == 3
    conn = connect(dialect, SINK_SQL_URI_ENV)
    cur = conn.cursor()
    cur.execute(f"SELECT response, embedding, rayllm_generation FROM {table} WHERE id = 1")
    assert cur.fetchall() == [("again 1", "[0.5, 0.25]", "gen-c")]
    conn.close()


def test_a_failed_write_leaves_the_previous_rows(database, tmp_path):
    dialect, table = database
    table_sink.write(rows(tmp_path, [1, 2]), dialect, table, "dag/run-1/t/-1", "gen-a")
    bad = rows_file(tmp_path, pa.table({"id": ["not-a-number"], "response": ["x"], "embedding": [[1.0]]}))
    if dialect == "sqlite":  # SQLite stores any type; break it with a column the table lacks instead
        bad = rows_file(tmp_path, pa.table({"id": [1], "extra_column": ["x"]}))
    with pytest.raises(JobError, match="nothing was written"):
        table_sink.write(bad, dialect, table, "dag/run-1/t/-1", "gen-b")
    assert count(dialect, table, "dag/run-1/t/-1") == 2


def test_a_hostile_column_name_is_a_column_and_runs_no_sql(database, tmp_path):
    dialect, table = database
    hostile = f'x"; DROP TABLE {table}; --'
    files = rows_file(tmp_path, pa.table({"id": [1, 2], hostile: ["a", "b"], "n`x": [1.5, 2.5]}))
    assert table_sink.write(files, dialect, table, "dag/run-1/t/-1", "gen-a") == 2
    conn = connect(dialect, SINK_SQL_URI_ENV)
    cur = conn.cursor()
    cur.execute(f"SELECT {table_sink.quote(hostile, dialect)} FROM {table} ORDER BY id")
    assert [r[0] for r in cur.fetchall()] == ["a", "b"], "the table still exists and the column holds the values"
    conn.close()


def test_table_name_is_checked(tmp_path):
    with pytest.raises(JobError, match="not a plain table name"):
        table_sink.write(rows(tmp_path, [1]), "sqlite", "t; DROP TABLE x", "k", "g")


def test_nested_datetime_and_binary_columns_are_written_as_the_dialect_holds_them(database, tmp_path):
    from datetime import datetime

    dialect, table = database
    when = datetime(2026, 12, 2, 9, 30, 15, 123456)
    files = rows_file(
        tmp_path,
        pa.table(
            {
                "id": [1],
                "meta": pa.array([{"source": "crm", "tags": ["a", "b"]}]),
                "asked_at": pa.array([when], pa.timestamp("us")),
                "raw": pa.array([b"\x00\xffbytes"], pa.binary()),
            }
        ),
    )
    assert table_sink.write(files, dialect, table, "dag/run-1/t/-1", "gen-a") == 1
    conn = connect(dialect, SINK_SQL_URI_ENV)
    cur = conn.cursor()
    cur.execute(f"SELECT meta, asked_at, raw FROM {table}")
    meta, asked_at, raw = cur.fetchone()
    conn.close()
    assert json.loads(meta) == {"source": "crm", "tags": ["a", "b"]}, "a struct is JSON text"
    assert str(asked_at).replace("T", " ").startswith("2026-12-02 09:30:15"), asked_at
    assert bytes(raw) == b"\x00\xffbytes"


def test_a_schema_that_changed_between_two_dates_is_refused_naming_the_columns(database, tmp_path):
    """Two backfill dates into one table: the second date's output has a column the table lacks. Its write
    fails naming the column, and the first date's rows stay."""
    dialect, table = database
    assert table_sink.write(rows(tmp_path, [1, 2]), dialect, table, "dag/2026-05-01/t/-1", "gen-a") == 2
    changed = rows_file(tmp_path, pa.table({"id": [3], "response": ["x"], "embedding": [[1.0]], "score": [0.5]}))
    with pytest.raises(JobError, match=r"has no column\(s\) \['score'\].*nothing was written"):
        table_sink.write(changed, dialect, table, "dag/2026-05-02/t/-1", "gen-b")
    assert count(dialect, table) == 2 and count(dialect, table, "dag/2026-05-01/t/-1") == 2
