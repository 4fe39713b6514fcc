"""Writing output rows back to a table: staged out of the readers' way, switched in one transaction, once per
run, replaced on rerun, all or nothing, any column name; a switch a crash cut short is completed by repair.

Real PostgreSQL and MariaDB/MySQL (the servers on this machine) and SQLite; the rows come from output files
as the job wrote them.
"""

from __future__ import annotations

import json
import sqlite3

import pyarrow as pa
import pytest

from airflow_provider_rayllm.contract.names import SINK_SQL_URI_ENV
from airflow_provider_rayllm.job.databases import connect
from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.job.publish import table_switch
from airflow_provider_rayllm.job.sinks import table as table_sink

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


def write(files, dialect, table, run_key, generation) -> int:
    """What a publish does to the table: stage, then switch."""
    staged = table_sink.stage(files, dialect, table, run_key, generation)
    table_switch.switch(dialect, table, generation)
    return staged


def query(dialect, sql, params=()):
    conn = connect(dialect, SINK_SQL_URI_ENV)
    try:
        cur = conn.cursor()
        cur.execute(sql.replace("%s", "?") if dialect == "sqlite" else sql, params)
        found = [tuple(row) for row in cur.fetchall()] if cur.description else []
        conn.commit()
        return found
    finally:
        conn.close()


def generations(dialect, table, run_key):
    """What a reader of the table sees of a run key: the generation of each row."""
    return sorted(
        g for (g,) in query(dialect, f"SELECT rayllm_generation FROM {table} WHERE rayllm_run_key = %s", (run_key,))
    )


def ledger(dialect, table):
    return dict(query(dialect, f"SELECT generation, state FROM {table_sink.LEDGER} WHERE table_name = %s", (table,)))


def table_exists(dialect, name) -> bool:
    conn = connect(dialect, SINK_SQL_URI_ENV)
    try:
        return table_sink._existing_columns(conn.cursor(), name) is not None
    finally:
        conn.rollback()
        conn.close()


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


@pytest.fixture(params=["sqlite", "postgresql", "mysql"])
def database(request, tmp_path, monkeypatch):
    table = f"rayllm_sink_{request.node.name.split('[')[0][-20:]}_{tmp_path.name[-6:]}".replace("-", "_")
    if request.param == "sqlite":
        monkeypatch.setenv(SINK_SQL_URI_ENV, f"sqlite:{tmp_path / 'w.sqlite'}")
        sqlite3.connect(tmp_path / "w.sqlite").close()
    else:
        uri = request.getfixturevalue("postgres_dsn" if request.param == "postgresql" else "mysql_uri")
        monkeypatch.setenv(SINK_SQL_URI_ENV, uri)
    yield request.param, table
    if request.param != "sqlite":
        for generation in ledger(request.param, table) if table_exists(request.param, table_sink.LEDGER) else {}:
            query(request.param, f"DROP TABLE IF EXISTS {table_sink.staged_table(table, generation)}")
        query(request.param, f"DROP TABLE IF EXISTS {table}")
        if table_exists(request.param, table_sink.LEDGER):
            query(request.param, f"DELETE FROM {table_sink.LEDGER} WHERE table_name = %s", (table,))


def test_rerun_replaces_only_its_own_rows(database, tmp_path):
    dialect, table = database
    assert write(rows(tmp_path, [1, 2, 3]), dialect, table, "dag/run-1/t/-1", "gen-a") == 3
    assert write(rows(tmp_path, [7, 8]), dialect, table, "dag/run-2/t/-1", "gen-b") == 2
    assert write(rows(tmp_path, [1, 2, 3], answer="again"), dialect, table, "dag/run-1/t/-1", "gen-c") == 3
    assert count(dialect, table) == 5
    assert count(dialect, table, "dag/run-1/t/-1") == 3
    assert query(dialect, f"SELECT response, embedding, rayllm_generation FROM {table} WHERE id = 1") == [
        ("again 1", "[0.5, 0.25]", "gen-c")
    ]


def test_a_failed_write_leaves_the_previous_rows(database, tmp_path):
    dialect, table = database
    write(rows(tmp_path, [1, 2]), dialect, table, "dag/run-1/t/-1", "gen-a")
    bad = rows_file(tmp_path, pa.table({"id": ["not-a-number"], "response": ["x"], "embedding": [[1.0]]}))
    if dialect == "sqlite":  # SQLite stores any type; break it with a column the table lacks instead
        bad = rows_file(tmp_path, pa.table({"id": [1], "extra_column": ["x"]}))
    with pytest.raises(JobError, match="nothing was written"):
        write(bad, dialect, table, "dag/run-1/t/-1", "gen-b")
    assert count(dialect, table, "dag/run-1/t/-1") == 2


def test_a_hostile_column_name_is_a_column_and_runs_no_sql(database, tmp_path):
    dialect, table = database
    hostile = f'x"; DROP TABLE {table}; --'
    files = rows_file(tmp_path, pa.table({"id": [1, 2], hostile: ["a", "b"], "n`x": [1.5, 2.5]}))
    assert write(files, dialect, table, "dag/run-1/t/-1", "gen-a") == 2
    conn = connect(dialect, SINK_SQL_URI_ENV)
    cur = conn.cursor()
    cur.execute(f"SELECT {table_sink.quote(hostile, dialect)} FROM {table} ORDER BY id")
    assert [r[0] for r in cur.fetchall()] == ["a", "b"], "the table still exists and the column holds the values"
    conn.close()


def test_table_name_is_checked(tmp_path):
    with pytest.raises(JobError, match="not a plain table name"):
        table_sink.stage(rows(tmp_path, [1]), "sqlite", "t; DROP TABLE x", "k", "g")


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
    assert write(files, dialect, table, "dag/run-1/t/-1", "gen-a") == 1
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
    assert write(rows(tmp_path, [1, 2]), dialect, table, "dag/2026-05-01/t/-1", "gen-a") == 2
    changed = rows_file(tmp_path, pa.table({"id": [3], "response": ["x"], "embedding": [[1.0]], "score": [0.5]}))
    with pytest.raises(JobError, match=r"has no column\(s\) \['score'\].*nothing was written"):
        write(changed, dialect, table, "dag/2026-05-02/t/-1", "gen-b")
    assert count(dialect, table) == 2 and count(dialect, table, "dag/2026-05-01/t/-1") == 2


def test_staged_rows_stay_out_of_the_table_until_the_switch_and_a_second_switch_changes_nothing(database, tmp_path):
    dialect, table = database
    key = "dag/run-1/t/-1"
    write(rows(tmp_path, [1, 2, 3]), dialect, table, key, "gen-a")
    staged = table_sink.stage(rows(tmp_path, [1, 2, 3, 4], answer="new"), dialect, table, key, "gen-b")
    assert generations(dialect, table, key) == ["gen-a"] * 3, "a reader of the table still sees the old rows"
    assert ledger(dialect, table) == {"gen-a": "published", "gen-b": "staged"}
    assert table_switch.switch(dialect, table, "gen-b") is True
    assert generations(dialect, table, key) == ["gen-b"] * staged
    assert ledger(dialect, table) == {"gen-b": "published"}, "the table's generation for the run key, once"
    assert not table_exists(dialect, table_sink.staged_table(table, "gen-b")), "the staging table went"
    assert table_switch.switch(dialect, table, "gen-b") is False, "switching again is a no-op"
    assert generations(dialect, table, key) == ["gen-b"] * staged


def test_a_failure_while_the_switch_is_open_leaves_the_table_old_and_repair_drops_the_stage(database, tmp_path):
    """The manifest's write fails inside the open switch: the table keeps its rows; the staged generation,
    which no manifest names, is dropped by the next run's repair."""
    dialect, table = database
    key = "dag/run-1/t/-1"
    write(rows(tmp_path, [1, 2]), dialect, table, key, "gen-a")
    table_sink.stage(rows(tmp_path, [1, 2, 3], answer="new"), dialect, table, key, "gen-b")
    with pytest.raises(OSError, match="manifest"):
        with table_switch.switched(dialect, table, "gen-b"):
            raise OSError("the manifest could not be written")
    assert generations(dialect, table, key) == ["gen-a"] * 2
    done = table_switch.repair(dialect, table, key, published="gen-a")
    assert done == ["dropped staged generation gen-b (no manifest names it)"]
    assert ledger(dialect, table) == {"gen-a": "published"}
    assert not table_exists(dialect, table_sink.staged_table(table, "gen-b"))
    assert generations(dialect, table, key) == ["gen-a"] * 2


def test_repair_completes_the_switch_of_the_generation_the_manifest_names(database, tmp_path):
    """The driver died after the manifest named gen-b and before the switch's commit: the next run's repair
    switches gen-b in, and the table and the manifest agree again."""
    dialect, table = database
    key = "dag/run-1/t/-1"
    write(rows(tmp_path, [1, 2]), dialect, table, key, "gen-a")
    table_sink.stage(rows(tmp_path, [1, 2, 3], answer="new"), dialect, table, key, "gen-b")
    other = table_sink.stage(rows(tmp_path, [9]), dialect, table, "dag/run-2/t/-1", "gen-x")
    done = table_switch.repair(dialect, table, key, published="gen-b")
    assert done == ["switched in generation gen-b (the manifest names it; a crash cut its switch short)"]
    assert generations(dialect, table, key) == ["gen-b"] * 3
    assert table_switch.repair(dialect, table, key, published="gen-b") == [], "repairing again does nothing"
    assert ledger(dialect, table)["gen-x"] == "staged" and other == 1, "another run key's stage is not touched"
