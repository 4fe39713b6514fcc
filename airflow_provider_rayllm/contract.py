"""Names both halves must agree on, beside the spec: files in the job package, environment variables that
carry secrets, and the progress line the job prints and the operator reads.

Imports neither Airflow nor Ray nor numpy: the Airflow half imports this, never ``job/``.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from airflow_provider_rayllm.spec import MANIFEST_NAME, MANIFEST_VERSION, PROGRESS_LOG_PREFIX

__all__ = ["MANIFEST_NAME"]

# Files in the job package (the Ray job's working_dir).
SPEC_FILE = "spec.json"
# What the operator submits: the job half's command, run in the folder that holds SPEC_FILE.
ENTRYPOINT = f"python -m airflow_provider_rayllm.job {SPEC_FILE}"
SECRETS_FILE = "secrets.json"
# Every worker process of a job runs this first: it loads the secrets file into its own environment.
SETUP_HOOK = "airflow_provider_rayllm.job.worker_setup.setup"

# Secrets, as environment variables of the job's processes (loaded from the secrets file).
SQL_URI_ENV = "RAYLLM_SQL_URI"  # the source database, with its password
SINK_SQL_URI_ENV = "RAYLLM_SINK_SQL_URI"  # the output table's database
HTTP_API_KEY_ENV = "RAYLLM_HTTP_API_KEY"  # the OpenAI-compatible endpoint's key
GCP_KEYFILE_JSON = "RAYLLM_GCP_KEYFILE_JSON"  # a service-account key as JSON text


@dataclass
class Progress:
    """One progress line: ``RAYLLM_PROGRESS {json}``."""

    rows_done: int
    rows_total: int  # rows read so far (the total once the read has finished)
    rows_errored: int
    tokens_out: int
    elapsed_s: float
    tokens_per_s: float  # since the first answered row, not since the job started
    files_written: int = 0
    first_output_s: float | None = None

    def line(self) -> str:
        return PROGRESS_LOG_PREFIX + json.dumps(asdict(self))


def parse_progress(line: str) -> dict[str, Any] | None:
    """The payload of a progress line, or None for any other line."""
    if not line.startswith(PROGRESS_LOG_PREFIX):
        return None
    try:
        payload = json.loads(line[len(PROGRESS_LOG_PREFIX) :])
    except json.JSONDecodeError:
        return None
    return payload if isinstance(payload, dict) else None


def last_progress(logs: str) -> dict[str, Any] | None:
    """The newest progress payload in a job log."""
    for line in reversed(logs.splitlines()):
        payload = parse_progress(line)
        if payload is not None:
            return payload
    return None


def describe_progress(p: dict[str, Any]) -> str:
    read = int(p.get("rows_total") or 0)
    done = int(p.get("rows_done") or 0)
    share = f" ({done / read:.0%} of the rows read so far)" if read else ""
    errored = int(p.get("rows_errored") or 0)
    files = int(p.get("files_written") or 0)
    return (
        f"{done}/{read} rows done{share}, {errored} error row(s), {int(p.get('tokens_out') or 0)} tokens out, "
        f"{float(p.get('tokens_per_s') or 0):.1f} tokens/s, {files} file(s) written, {float(p.get('elapsed_s') or 0):.0f} s"
    )


class OutputFile(BaseModel):
    uri: str
    rows: int
    bytes: int


class Manifest(BaseModel):
    """What a finished batch job published (``manifest.json`` under ``output_uri``, written last), and what
    the operator returns through XCom: locations and figures, never rows. Engine-specific details (the
    resolved engine settings, the endpoint, cost) come as further keys."""

    model_config = ConfigDict(extra="allow")

    manifest_version: int = MANIFEST_VERSION
    status: str = "SUCCEEDED"
    submission_id: str = Field(description="The Ray job's submission id.")
    generation: str = Field(description="The folder under output_uri/_generations that this manifest publishes.")
    spec_hash: str
    output_uri: str = Field(description="The task's output prefix (the operator's output_uri).")
    outputs_folder: str = Field(description="Folder of the published output files.")
    errors_folder: str = Field(
        description="Folder of the published error files (one row per failed input row, with its reason)."
    )
    format: str
    output_files: list[OutputFile]
    error_files: list[OutputFile]
    rows_in: int
    rows_out: int
    rows_errored: int
    rows_resumed: int = 0
    errors_by_reason: dict[str, int] = Field(default_factory=dict)
    input_tokens: int
    output_tokens: int
    wall_time_s: float
    first_output_s: float | None = None
    timeline: dict[str, float | None] = Field(default_factory=dict)
    started_at: str
    finished_at: str
    kind: str
    model: str
    task_type: str
    versions: dict[str, str]
    run: dict[str, Any]
    output_table: dict[str, Any] | None = None


# Names that hold a secret: such a setting is moved to the job's secrets or shown as ***, never logged.
# "token" only as a word of its own (hf_token, VENDOR_API_TOKEN, accessToken): counts of tokens
# (max_num_batched_tokens) and the tokenizer are settings to show.
SECRET_NAME = re.compile(
    r"(token(?!s|iz)|secret|passw(or)?d|api[_-]?key|access[_-]?key|private[_-]?key|credential|auth)", re.IGNORECASE
)
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<who>[^/@\s:]+(:[^/@\s]*)?)@")


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(str(name)))


def redact(value: Any) -> Any:
    """A copy to show or store: values under secret-looking keys become ***, and credentials in URLs too."""
    if isinstance(value, dict):
        return {k: ("***" if is_secret_name(k) and v not in (None, "") else redact(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return _URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}***@", value)
    return value


# A secret-looking setting travels as an environment variable in the job's secrets file; the spec holds
# this marker in its place.
SECRET_MARKER = "$secret"
ENGINE_SECRET_ENV = "RAYLLM_ENGINE_SECRET_"
HTTP_USERINFO_ENV = "RAYLLM_HTTP_USERINFO"


def split_secrets(settings: dict[str, Any] | None, env_prefix: str) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """(settings with each secret-looking value replaced by a marker, the values as secret env vars)."""
    if not settings:
        return settings, {}
    kept, moved = {}, {}
    for name, value in settings.items():
        if is_secret_name(name) and isinstance(value, str) and value:
            env = env_prefix + re.sub(r"[^A-Z0-9]", "_", name.upper())
            kept[name], moved[env] = {SECRET_MARKER: env}, value
        else:
            kept[name] = value
    return kept, moved


def secret_env_vars(runtime_env: dict[str, Any] | None) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """(a runtime_env without its secret-looking env_vars, those env vars): Ray shows a runtime_env's
    env_vars to anyone who can list jobs; the job's secrets file carries them instead."""
    env_vars = (runtime_env or {}).get("env_vars") or {}
    moved = {k: str(v) for k, v in env_vars.items() if is_secret_name(k) and v not in (None, "")}
    if not moved:
        return runtime_env, {}
    kept = {k: v for k, v in env_vars.items() if k not in moved}
    return {**runtime_env, "env_vars": kept}, moved  # type: ignore[dict-item]
