"""The manifest: written last, it is what makes a generation's output the published one."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any, Mapping

from airflow_provider_rayllm import __version__
from airflow_provider_rayllm.job import io
from airflow_provider_rayllm.spec import MANIFEST_LOG_PREFIX, MANIFEST_NAME, MANIFEST_VERSION, JobSpec

GENERATIONS = "_generations"


def generation_uri(output_uri: str, submission_id: str) -> str:
    return io.join(output_uri, GENERATIONS, submission_id)


def manifest_uri(output_uri: str) -> str:
    return io.join(output_uri, MANIFEST_NAME)


def build(
    *,
    spec: JobSpec,
    submission_id: str,
    outputs_uri: str,
    errors_uri: str,
    output_files: list[dict[str, Any]],
    error_files: list[dict[str, Any]],
    rows_in: int,
    rows_out: int,
    rows_errored: int,
    input_tokens: int,
    output_tokens: int,
    started_at: str,
    wall_time_s: float,
    details: dict[str, Any],
    versions: dict[str, str],
    table_rows: int = 0,
) -> dict[str, Any]:
    table = spec.sink.table
    return {
        "manifest_version": MANIFEST_VERSION,
        "status": "SUCCEEDED",
        "submission_id": submission_id,
        "spec_hash": spec.content_hash(),
        "output_uri": spec.sink.uri,
        "outputs_uri": outputs_uri,
        "errors_uri": errors_uri,
        "format": spec.sink.format,
        "output_files": output_files,
        "error_files": error_files,
        "rows_in": rows_in,
        "rows_out": rows_out,
        "rows_errored": rows_errored,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "wall_time_s": round(wall_time_s, 3),
        "started_at": started_at,
        "finished_at": datetime.now(timezone.utc).isoformat(),
        "kind": spec.kind,
        "model": spec.model_name,
        "task_type": spec.task_type,
        **details,
        "versions": {**versions, "airflow_provider_rayllm": __version__},
        "run": spec.run.model_dump(),
        "output_table": (
            {"table": table.table, "run_key": table.run_key, "rows": table_rows} if table is not None else None
        ),
    }


def publish(output_uri: str, body: dict[str, Any]) -> None:
    io.write_text_atomic(manifest_uri(output_uri), json.dumps(body, indent=2, sort_keys=True))


def read(output_uri: str, env: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    return io.read_json(manifest_uri(output_uri), env)


def remove_stale_generations(output_uri: str, keep_submission_id: str) -> None:
    """A rerun replaces its own output: older generations go once the new manifest is in place."""
    base = io.join(output_uri, GENERATIONS)
    for name in io.list_subdirs(base):
        if name != keep_submission_id:
            io.delete_dir(io.join(base, name))


def log_line(body: dict[str, Any]) -> str:
    return MANIFEST_LOG_PREFIX + json.dumps(body, sort_keys=True)
