"""The warehouse, for the SQL source and the output table alike: a connection from a URI the job got as a
secret (an environment variable, read here, so it is never pickled into a task), and identifiers quoted
for each dialect."""

from __future__ import annotations

import os
import urllib.parse
from typing import Any

from airflow_provider_rayllm.contract.names import SQL_URI_ENV
from airflow_provider_rayllm.job.errors import JobError

# Every wait on the warehouse has an end unless the connection says otherwise (its URI's query, from the
# Airflow connection's extras): connecting, a statement (a fetch of one chunk, one insert), and a peer that
# went silent (TCP keepalives notice it within about a minute).
CONNECT_TIMEOUT_S = 30
STATEMENT_TIMEOUT_S = 600
POSTGRES_KEEPALIVES = {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10, "keepalives_count": 3}


def postgres_options(query: dict[str, str]) -> dict[str, Any]:
    """psycopg2's keyword arguments for the deadlines the URI does not set itself."""
    options: dict[str, Any] = {k: v for k, v in POSTGRES_KEEPALIVES.items() if k not in query}
    if "connect_timeout" not in query:
        options["connect_timeout"] = CONNECT_TIMEOUT_S
    if "statement_timeout" not in query.get("options", ""):
        options["options"] = " ".join(
            filter(None, [query.get("options"), f"-c statement_timeout={STATEMENT_TIMEOUT_S * 1000}"])
        )
    return options


def connect(dialect: str, env_name: str = SQL_URI_ENV) -> Any:
    uri = os.environ.get(env_name)
    if not uri:
        raise JobError(f"no database URI reached the job (environment variable {env_name} is unset)")
    if dialect == "postgresql":
        import psycopg2

        query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(uri).query))
        return psycopg2.connect(uri, **postgres_options(query))
    if dialect == "sqlite":
        import sqlite3

        path = uri.removeprefix("sqlite:")
        if not os.path.exists(path):
            raise JobError(f"the SQLite database {path!r} does not exist on the cluster")
        return sqlite3.connect(path)
    if dialect == "mysql":
        import pymysql

        parts = urllib.parse.urlsplit(uri)
        return pymysql.connect(
            host=parts.hostname or "127.0.0.1",
            port=parts.port or 3306,
            user=urllib.parse.unquote(parts.username or ""),
            password=urllib.parse.unquote(parts.password or ""),
            database=parts.path.lstrip("/") or None,
            **mysql_options(dict(urllib.parse.parse_qsl(parts.query))),
        )
    raise JobError(f"source.dialect {dialect!r} is not supported")


def mysql_options(query: dict[str, str]) -> dict[str, Any]:
    """The connection's driver options (the URI's query, from the Airflow connection's extras) as pymysql's
    keyword arguments: TLS files, whether to verify the server's certificate, timeouts, charset."""
    options: dict[str, Any] = {}
    ssl = {key: query[f"ssl_{key}"] for key in ("ca", "cert", "key") if query.get(f"ssl_{key}")}
    if ssl:
        options["ssl"] = ssl
    if "ssl_verify_cert" in query:
        options["ssl_verify_cert"] = query["ssl_verify_cert"].lower() in ("1", "true", "yes")
    defaults = {
        "connect_timeout": CONNECT_TIMEOUT_S,
        "read_timeout": STATEMENT_TIMEOUT_S,
        "write_timeout": STATEMENT_TIMEOUT_S,
    }
    for name, default in defaults.items():
        options[name] = int(float(query[name])) if query.get(name) else default
    if query.get("charset"):
        options["charset"] = query["charset"]
    return options


def quote(name: str, dialect: str) -> str:
    """An identifier quoted for the dialect (the quote character doubled inside)."""
    if "\x00" in name:
        raise JobError(f"output_table: column name {name!r} holds a NUL character")
    mark = "`" if dialect == "mysql" else '"'
    return mark + name.replace(mark, mark * 2) + mark
