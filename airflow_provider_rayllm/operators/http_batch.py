"""HttpLLMBatchOperator: the guide's OpenAI-compatible endpoint section as a Ray job, fast and polite."""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from airflow.sdk import BaseHook
from typing_extensions import Unpack

from airflow_provider_rayllm.contract.names import HTTP_API_KEY_ENV, HTTP_USERINFO_ENV
from airflow_provider_rayllm.contract.spec import FileFormat, HttpEndpoint, QualityGate, SinkFormat
from airflow_provider_rayllm.exceptions import InvalidSpec
from airflow_provider_rayllm.operators import arguments
from airflow_provider_rayllm.operators.batch import BatchOperator, connection_price
from airflow_provider_rayllm.operators.guide_config import HTTP_FIELDS
from airflow_provider_rayllm.operators.task_args import RayJobArgs

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

    def __init__(
        self,
        *,
        input_uri: str | list[str] | None = None,
        input_format: FileFormat | None = None,
        input_columns: list[str] | None = None,
        sql: str | None = None,
        sql_shard_keys: list[str] | None = None,
        sql_parallelism: int | None = None,
        sql_conn_id: str | None = None,
        input_rows: list[Any] | str | None = None,
        prompt_column: str | None = None,
        prompt_template: str | None = None,
        messages_column: str | None = None,
        preprocess: Callable[..., Any] | str | None = None,
        system_prompt: str | None = None,
        sampling_params: dict[str, Any] | str | None = None,
        pooling_params: dict[str, Any] | None = None,
        postprocess: Callable[..., Any] | str | None = None,
        output_column: str = "response",
        keep_columns: list[str] | None = None,
        id_column: str | None = None,
        prefix_window_rows: int | None = None,
        image_column: str | None = None,
        image_max_bytes: int = 20971520,
        image_allow_private_hosts: bool = False,
        image_path_prefixes: list[str] | None = None,
        endpoint: HttpEndpoint = "chat/completions",
        model: str,
        concurrency: int = 1,
        batch_size: int = 256,
        max_in_flight: int | str = 64,
        qps: float | str | None = None,
        max_retries: int = 6,
        max_total_wait_s: float = 300.0,
        timeout_s: float = 120.0,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 30.0,
        price_per_1k_input_tokens: float | None = None,
        price_per_1k_output_tokens: float | None = None,
        http_conn_id: str = "llm_endpoint_default",
        processor_config: Any = None,
        output_uri: str | None = None,
        output_format: SinkFormat = "parquet",
        output_rows_per_file: int | None = None,
        output_table: str | None = None,
        output_table_conn_id: str | None = None,
        incremental: bool = False,
        incremental_from: str | None = None,
        max_error_fraction: float = 0.1,
        max_rows: int | str | None = None,
        object_store_window_mb: int | str | None = None,
        canary_rows: int | None = None,
        quality_gate: QualityGate | dict[str, Any] | None = None,
        max_tokens_budget: int | None = None,
        max_cost: float | None = None,
        stall_timeout_s: float | None = 3600.0,
        **kwargs: Unpack[RayJobArgs],
    ) -> None:
        super().__init__(**kwargs)
        given = locals()
        self.take_arguments(given)
        self.take_guide_config(processor_config, HTTP_FIELDS, given)

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
        http = {**self.section("http"), "base_url": base_url}
        for name in ("price_per_1k_input_tokens", "price_per_1k_output_tokens"):
            # An endpoint's prices are the endpoint's: its connection may carry them for every task.
            if http[name] is None:
                http[name] = connection_price(self.http_conn_id, name)
        body = self.batch_body("http", {"http": http}, output_uri, package_dir, context)
        # Embeddings take plain text; chat and completions take the built messages.
        if self.endpoint == "embeddings":
            body["prompt"]["sampling_params"] = {}
        return body
