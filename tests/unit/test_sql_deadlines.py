"""Every wait on the warehouse ends: a server that accepts the connection and never says a word is a clear
error within the job's deadlines, on PostgreSQL and MySQL alike (a real socket, the real drivers)."""

from __future__ import annotations

import time

import pytest

from airflow_provider_rayllm.job import databases
from tests.unit.local_http import silent_server


@pytest.fixture()
def silent_port():
    with silent_server() as port:
        yield port


@pytest.mark.parametrize(
    "dialect, uri", [("postgresql", "postgresql://u@127.0.0.1:{port}/db"), ("mysql", "mysql://u@127.0.0.1:{port}/db")]
)
def test_a_server_that_never_answers_ends_the_connect_within_its_deadline(dialect, uri, silent_port, monkeypatch):
    # pymysql reads the server's greeting under its read timeout, psycopg2 under connect_timeout: both are the job's.
    monkeypatch.setattr(databases, "CONNECT_TIMEOUT_S", 2)
    monkeypatch.setattr(databases, "STATEMENT_TIMEOUT_S", 2)
    monkeypatch.setenv("RAYLLM_TEST_SQL_URI", uri.format(port=silent_port))
    started = time.monotonic()
    with pytest.raises(Exception) as failed:
        databases.connect(dialect, "RAYLLM_TEST_SQL_URI")
    seconds = time.monotonic() - started
    assert seconds < 10, f"{dialect}: the connect waited {seconds:.1f} s"
    assert "timeout" in str(failed.value).lower() or "timed out" in str(failed.value).lower(), failed.value
    from tests.integration.helpers import record_figure

    record_figure(
        f"sql_server_silent_{dialect}", seconds_to_error=round(seconds, 2), deadline_s=databases.CONNECT_TIMEOUT_S
    )


def test_the_postgres_deadlines_are_the_jobs_unless_the_connection_sets_its_own():
    own = databases.postgres_options({})
    assert own["connect_timeout"] == databases.CONNECT_TIMEOUT_S
    assert own["options"] == f"-c statement_timeout={databases.STATEMENT_TIMEOUT_S * 1000}"
    assert own["keepalives"] == 1
    theirs = databases.postgres_options({"connect_timeout": "5", "options": "-c statement_timeout=1000"})
    assert "connect_timeout" not in theirs and "options" not in theirs
    merged = databases.postgres_options({"options": "-c search_path=s"})
    assert merged["options"] == f"-c search_path=s -c statement_timeout={databases.STATEMENT_TIMEOUT_S * 1000}"
