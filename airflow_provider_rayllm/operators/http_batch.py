"""HttpLLMBatchOperator: the guide's OpenAI-compatible endpoint section as a Ray job, fast and polite."""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseHook

from airflow_provider_rayllm.contract.names import HTTP_API_KEY_ENV, HTTP_USERINFO_ENV
from airflow_provider_rayllm.exceptions import InvalidSpec
from airflow_provider_rayllm.operators import arguments
from airflow_provider_rayllm.operators.batch import BatchOperator

if TYPE_CHECKING:
    from airflow.sdk import Context

OPENAI_BASE_URL = "https://api.openai.com/v1"


def endpoint_from_connection(conn_id: str) -> tuple[str, str | None]:
    """(base URL without credentials, API key) from an `openai`, `http` or any connection: host (+ schema,
    port) and password."""
    conn = BaseHook.get_connection(conn_id)
    extra = conn.extra_dejson or {}
    base = extra.get("base_url") or conn.host or ""
    if not base and (conn.conn_type or "") == "openai":
        base = OPENAI_BASE_URL
    if not base:
        raise InvalidSpec(f"http_conn_id {conn_id!r} has no host (the endpoint's base URL, e.g. http://host:8000/v1)")
    if "://" not in base:
        scheme = conn.schema if conn.schema in ("http", "https") else "https"
        base = f"{scheme}://{base}"
    if conn.port and base.count(":") < 2:
        head, _, path = base.partition("://")[2].partition("/")
        base = f"{base.split('://')[0]}://{head}:{conn.port}" + (f"/{path}" if path else "")
    key = conn.password or extra.get("api_key") or None
    return _without_userinfo(base.rstrip("/"))[0], key


def _without_userinfo(base: str) -> tuple[str, str | None]:
    """('https://host/v1', 'user:pass') for 'https://user:pass@host/v1': credentials travel as a job secret."""
    parts = urllib.parse.urlsplit(base)
    if "@" not in parts.netloc:
        return base, None
    userinfo, _, host = parts.netloc.rpartition("@")
    return urllib.parse.urlunsplit(parts._replace(netloc=host)), urllib.parse.unquote(userinfo)


class HttpLLMBatchOperator(BatchOperator):
    """Send every row to an OpenAI-compatible endpoint from a Ray job; return the manifest.

    The endpoint's base URL and API key come from ``http_conn_id`` only: no templated argument can
    point the requests (and the key) at another host. Rows are built as for VLLMBatchOperator
    (``prompt_column`` / ``prompt_template`` / ``messages_column`` / ``preprocess``) and sent to
    ``endpoint`` (``chat/completions``, ``completions`` or ``embeddings``) with ``sampling_params``.
    Throughput: ``concurrency`` actors x ``max_in_flight`` requests each, ``qps`` for the whole job,
    retries on 408/429/5xx honouring Retry-After with jittered exponential backoff.
    """

    arguments = arguments.operator_arguments("http")

    def job_secrets(self) -> dict[str, str]:
        env = super().job_secrets()
        _, key = endpoint_from_connection(self.http_conn_id)
        if key:
            env[HTTP_API_KEY_ENV] = key
        conn = BaseHook.get_connection(self.http_conn_id)
        _, userinfo = _without_userinfo((conn.extra_dejson or {}).get("base_url") or conn.host or "")
        if userinfo:
            env[HTTP_USERINFO_ENV] = userinfo
        return env

    def spec_body(self, context: Context, output_uri: str, package_dir: Path) -> dict[str, Any]:
        base_url, _ = endpoint_from_connection(self.http_conn_id)
        body = self.batch_body(
            "http", {"http": {**self.section("http"), "base_url": base_url}}, output_uri, package_dir, context
        )
        # Embeddings take plain text; chat and completions take the built messages.
        if self.endpoint == "embeddings":
            body["prompt"]["sampling_params"] = {}
        return body
