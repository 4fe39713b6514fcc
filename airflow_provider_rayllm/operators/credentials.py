"""Credentials from Airflow connections, turned into the environment the Ray job's processes need.

They travel in the job package's ``secrets.json`` (see ``job/secrets.py``): never in the entrypoint,
metadata, runtime_env env_vars, logs or XCom.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseHook

from airflow_provider_rayllm.contract.names import GCP_KEYFILE_JSON
from airflow_provider_rayllm.exceptions import InvalidSpec


def _extra(conn: Any, name: str, conn_type: str) -> Any:
    extra = conn.extra_dejson or {}
    return extra.get(name) or extra.get(f"extra__{conn_type}__{name}")


# What only the Amazon provider's hook can turn into keys: refused without it rather than dropped.
_AWS_PROVIDER_ONLY = ("role_arn", "profile_name", "assume_role_method", "external_id", "session_kwargs")


def aws_env(conn_id: str) -> dict[str, str]:
    """An Airflow ``aws`` connection as the job's AWS variables: keys (or, with the Amazon provider installed,
    those its hook resolves: an assumed role, a profile), region and endpoint_url. A connection with no
    credentials gives the job none: the cluster's own role answers."""
    conn = BaseHook.get_connection(conn_id)
    if bool(conn.login) != bool(conn.password):
        raise InvalidSpec(f"connection {conn_id!r}: give both the access key id (login) and the secret (password)")
    try:
        from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook
    except ImportError:
        return _aws_env_from_fields(conn_id, conn)
    hook = AwsBaseHook(aws_conn_id=conn_id, client_type="s3")
    config = hook.conn_config
    env: dict[str, str] = {}
    if config.aws_access_key_id or config.role_arn or config.profile_name:
        credentials = hook.get_credentials()
        env["AWS_ACCESS_KEY_ID"] = credentials.access_key
        env["AWS_SECRET_ACCESS_KEY"] = credentials.secret_key
        if credentials.token:
            env["AWS_SESSION_TOKEN"] = credentials.token
    if hook.conn_region_name:
        env["AWS_REGION"] = env["AWS_DEFAULT_REGION"] = hook.conn_region_name
    endpoint = config.get_service_endpoint_url("s3") or config.endpoint_url
    if endpoint:
        env["AWS_ENDPOINT_URL"] = endpoint
    return env


def _aws_env_from_fields(conn_id: str, conn: Any) -> dict[str, str]:
    """Without the Amazon provider: the connection's keys, session token, region and endpoint as written."""
    extra = conn.extra_dejson or {}
    needs_provider = sorted(name for name in _AWS_PROVIDER_ONLY if extra.get(name))
    if needs_provider:
        raise InvalidSpec(
            f"connection {conn_id!r} sets {', '.join(needs_provider)}: resolving it needs the Amazon provider "
            "(pip install apache-airflow-providers-amazon) on the Airflow worker"
        )
    env: dict[str, str] = {}
    if conn.login:
        env["AWS_ACCESS_KEY_ID"] = conn.login
    if conn.password:
        env["AWS_SECRET_ACCESS_KEY"] = conn.password
    token = _extra(conn, "aws_session_token", "aws")
    if token:
        env["AWS_SESSION_TOKEN"] = token
    region = _extra(conn, "region_name", "aws")
    if region:
        env["AWS_REGION"] = env["AWS_DEFAULT_REGION"] = region
    service_config = extra.get("service_config") or {}
    endpoint = _extra(conn, "endpoint_url", "aws") or (service_config.get("s3") or {}).get("endpoint_url")
    if endpoint:
        env["AWS_ENDPOINT_URL"] = endpoint
    return env


# Google connection fields that resolve credentials on the Airflow worker only (a secret manager, a chain of
# impersonated accounts, a workload identity file): refused rather than dropped.
_GCP_UNSUPPORTED = ("key_secret_name", "impersonation_chain", "credential_config_file", "is_anonymous")


def gcp_env(conn_id: str) -> dict[str, str]:
    """A ``google_cloud_platform`` connection: keyfile_dict or key_path, project; storage_emulator_host for tests."""
    conn = BaseHook.get_connection(conn_id)
    unsupported = sorted(name for name in _GCP_UNSUPPORTED if _extra(conn, name, "google_cloud_platform"))
    if unsupported:
        raise InvalidSpec(
            f"gcp_conn_id {conn_id!r} sets {', '.join(unsupported)}: a Ray job needs a key it can carry; give "
            "keyfile_dict (the service account's JSON key) or key_path (a key file on every cluster node)"
        )
    env: dict[str, str] = {}
    keyfile = _extra(conn, "keyfile_dict", "google_cloud_platform")
    key_path = _extra(conn, "key_path", "google_cloud_platform")
    if keyfile:
        import json

        env[GCP_KEYFILE_JSON] = keyfile if isinstance(keyfile, str) else json.dumps(keyfile)
    elif key_path:
        env["GOOGLE_APPLICATION_CREDENTIALS"] = key_path
    project = _extra(conn, "project", "google_cloud_platform")
    if project:
        env["GOOGLE_CLOUD_PROJECT"] = project
    emulator = _extra(conn, "storage_emulator_host", "google_cloud_platform")
    if emulator:
        # google-cloud-storage reads the first name; pyarrow's GCS client (used by Ray's model
        # loader) reads the second.
        env["STORAGE_EMULATOR_HOST"] = emulator
        env["CLOUD_STORAGE_EMULATOR_ENDPOINT"] = emulator
    return env


def hf_env(conn_id: str) -> dict[str, str]:
    """A Hugging Face token: the connection's password (any connection type); its host, when set, is the Hub
    the job talks to (a private hub or a mirror: HF_ENDPOINT)."""
    conn = BaseHook.get_connection(conn_id)
    token = conn.password or _extra(conn, "token", conn.conn_type or "")
    if not token:
        raise InvalidSpec(f"hf_conn_id {conn_id!r} holds no token (put it in the password field)")
    env = {"HF_TOKEN": token, "HUGGING_FACE_HUB_TOKEN": token}
    endpoint = _extra(conn, "endpoint", conn.conn_type or "") or conn.host
    if endpoint:
        if "://" not in endpoint:
            endpoint = f"{conn.schema or 'https'}://{endpoint}" + (f":{conn.port}" if conn.port else "")
        env["HF_ENDPOINT"] = endpoint.rstrip("/")
    return env


_DIALECTS = {"postgres": "postgresql", "postgresql": "postgresql", "mysql": "mysql", "sqlite": "sqlite"}


def sql_source(conn_id: str) -> tuple[str, dict[str, str]]:
    """(dialect, secret env) for an Airflow SQL connection; the URI with its password is a job secret."""
    from urllib.parse import quote, urlencode

    from airflow_provider_rayllm.contract.names import SQL_URI_ENV

    conn = BaseHook.get_connection(conn_id)
    dialect = _DIALECTS.get((conn.conn_type or "").lower())
    if dialect is None:
        raise InvalidSpec(
            f"sql_conn_id {conn_id!r} has connection type {conn.conn_type!r}; supported: {sorted(set(_DIALECTS))}"
        )
    if dialect == "sqlite":
        if not conn.host:
            raise InvalidSpec(f"sql_conn_id {conn_id!r}: a sqlite connection needs the database path as its host")
        return dialect, {SQL_URI_ENV: f"sqlite:{conn.host}"}
    auth = ""
    if conn.login:
        auth = quote(conn.login, safe="")
        if conn.password:
            auth += ":" + quote(conn.password, safe="")
        auth += "@"
    port = f":{conn.port}" if conn.port else ""
    query = _driver_options(dialect, conn.extra_dejson or {})
    uri = f"{dialect}://{auth}{conn.host or '127.0.0.1'}{port}/{conn.schema or ''}"
    return dialect, {SQL_URI_ENV: f"{uri}?{urlencode(query)}" if query else uri}


# Connection extras the job's database driver takes (libpq's URI parameters; pymysql's TLS and timeouts).
DRIVER_OPTIONS = {
    "postgresql": (
        "sslmode",
        "sslcert",
        "sslkey",
        "sslrootcert",
        "sslcrl",
        "connect_timeout",
        "application_name",
        "options",
        "target_session_attrs",
        "keepalives",
        "keepalives_idle",
    ),
    "mysql": ("ssl_ca", "ssl_cert", "ssl_key", "ssl_verify_cert", "connect_timeout", "read_timeout", "charset"),
}


def _driver_options(dialect: str, extra: dict[str, Any]) -> dict[str, str]:
    """The connection's extras the job's driver understands, as URI query parameters (sslmode=require...)."""
    return {
        name: str(extra[name]).lower() if isinstance(extra[name], bool) else str(extra[name])
        for name in DRIVER_OPTIONS.get(dialect, ())
        if extra.get(name) not in (None, "")
    }
