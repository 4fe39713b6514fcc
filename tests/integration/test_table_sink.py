"""Writing output rows back to a table: once per run, replaced on rerun, all or nothing.

Real PostgreSQL (the server on this machine) and SQLite; the rows come from a pyarrow table behind
the two dataset methods the sink uses.
"""

from __future__ import annotations

import sqlite3

import pyarrow as pa
import pytest

from airflow_provider_rayllm.job import table_sink
from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.job.sql import SINK_SQL_URI_ENV, connect

pytestmark = pytest.mark.integration


class Rows:
    def __init__(self, table: pa.Table):
        self.table = table

    def schema(self):
        return self.table.schema

    def iter_batches(self, batch_size, batch_format):
        for batch in self.table.to_batches(max_chunksize=batch_size):
            yield pa.Table.from_batches([batch])


def rows(ids, answer="ok"):
    return Rows(pa.table({"id": ids, "response": [f"{answer} {i}" for i in ids], "embedding": [[0.5, 0.25]] * len(ids)}))


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


def test_rerun_replaces_only_its_own_rows(database):
    dialect, table = database
    assert table_sink.write(rows([1, 2, 3]), dialect, table, "dag/run-1/t/-1") == 3
    assert table_sink.write(rows([7, 8]), dialect, table, "dag/run-2/t/-1") == 2
    assert table_sink.write(rows([1, 2, 3], answer="again"), dialect, table, "dag/run-1/t/-1") == 3
    assert count(dialect, table) == 5
    assert count(dialect, table, "dag/run-1/t/-1") == 3
    conn = connect(dialect, SINK_SQL_URI_ENV)
    cur = conn.cursor()
    cur.execute(f"SELECT response, embedding FROM {table} WHERE id = 1")
    assert cur.fetchall() == [("again 1", "[0.5, 0.25]")]
    conn.close()


def test_a_failed_write_leaves_the_previous_rows(database):
    dialect, table = database
    table_sink.write(rows([1, 2]), dialect, table, "dag/run-1/t/-1")
    bad = Rows(pa.table({"id": ["not-a-number"], "response": ["x"], "embedding": [[1.0]]}))
    if dialect == "sqlite":  # SQLite stores any type; break it with a column the table lacks instead
        bad = Rows(pa.table({"id": [1], "extra_column": ["x"]}))
    with pytest.raises(JobError, match="nothing was written"):
        table_sink.write(bad, dialect, table, "dag/run-1/t/-1")
    assert count(dialect, table, "dag/run-1/t/-1") == 2


def test_table_name_is_checked():
    with pytest.raises(JobError, match="not a plain table name"):
        table_sink.write(rows([1]), "sqlite", "t; DROP TABLE x", "k")
