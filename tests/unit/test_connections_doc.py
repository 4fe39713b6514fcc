"""docs/CONNECTIONS.md's example lines, run: each `export AIRFLOW_CONN_...` block goes through bash, and the
connection it defines is read by Airflow and then by the function the operators use for that connection."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from airflow_provider_rayllm.contract.names import SQL_URI_ENV

DOC = Path(__file__).resolve().parents[2] / "docs" / "CONNECTIONS.md"


def exported(name: str) -> str:
    """The value the doc's block exports for ``name``, as bash leaves it."""
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(encoding="utf-8"), re.DOTALL)
    (script,) = [b for b in blocks if f"export {name}=" in b]
    out = subprocess.run(["bash", "-c", script + f'printf %s "${name}"'], capture_output=True, text=True, check=True)
    return out.stdout


@pytest.fixture
def conn(monkeypatch):
    def define(name: str) -> None:
        monkeypatch.setenv(name, exported(name))

    return define


def test_the_ray_example(conn):
    from airflow.sdk import BaseHook

    from airflow_provider_rayllm.hooks.ray_job import RayConnSettings

    conn("AIRFLOW_CONN_RAY_DEFAULT")
    settings = RayConnSettings.from_connection(BaseHook.get_connection("ray_default"))
    assert settings.address == "https://ray.example"
    assert settings.request_headers()["Authorization"] == "Bearer <token>"
    assert settings.output_base == "s3://my-bucket/llm"


def test_the_s3_compatible_example(conn):
    from airflow_provider_rayllm.operators.credentials import aws_env

    conn("AIRFLOW_CONN_AWS_DEFAULT")
    env = aws_env("aws_default")
    assert env["AWS_ENDPOINT_URL"] == "http://minio:9000"
    assert env["AWS_REGION"] == "us-east-1"
    assert (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]) == ("minio", "minio123")


def test_the_postgres_example(conn):
    from airflow_provider_rayllm.operators.credentials import sql_source

    conn("AIRFLOW_CONN_WAREHOUSE")
    dialect, env = sql_source("warehouse")
    uri = urlsplit(env[SQL_URI_ENV])
    assert dialect == "postgresql"
    assert (uri.hostname, uri.port, uri.path, uri.username, unquote(uri.password or "")) == (
        "db.example",
        5432,
        "/analytics",
        "llm",
        "<pw>",
    )
    assert parse_qs(uri.query)["sslmode"] == ["require"]


def test_the_openai_compatible_example(conn):
    from airflow_provider_rayllm.operators.http_batch import endpoint_from_connection

    conn("AIRFLOW_CONN_LLM_ENDPOINT_DEFAULT")
    assert endpoint_from_connection("llm_endpoint_default") == ("http://127.0.0.1:8000/v1", "<key>")
