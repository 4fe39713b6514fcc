"""The manifest: written last, it is what makes a generation's output the published one."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any, Mapping

from airflow_provider_rayllm.contract.manifest import Manifest
from airflow_provider_rayllm.contract.names import MANIFEST_LOG_PREFIX, MANIFEST_NAME, MANIFEST_VERSION
from airflow_provider_rayllm.contract.spec import JobSpec
from airflow_provider_rayllm.job import filesystems
from airflow_provider_rayllm.version import __version__


def manifest_uri(output_uri: str) -> str:
    return filesystems.join(output_uri, MANIFEST_NAME)


def build(
    *,
    spec: JobSpec,
    submission_id: str,
    generation: str,
    outputs_folder: str,
    errors_folder: str,
    written: dict[str, Any],
    rows_in: int,
    rows_resumed: int,
    rows_resume_stale: int = 0,
    started_at: str,
    wall_time_s: float,
    timeline: dict[str, float | None],
    details: dict[str, Any],
    versions: dict[str, str],
    table_rows: int = 0,
    rows_over_time: list[dict[str, float]] | None = None,
    canary: dict[str, Any] | None = None,
    incremental: dict[str, Any] | None = None,
) -> dict[str, Any]:
    table = spec.sink.table
    body = {
        "manifest_version": MANIFEST_VERSION,
        "status": "SUCCEEDED",
        "submission_id": submission_id,
        "generation": generation,
        "spec_hash": spec.content_hash(),
        "output_uri": spec.sink.uri,
        "outputs_folder": outputs_folder,
        "errors_folder": errors_folder,
        "format": spec.sink.format,
        "output_files": written["output_files"],
        "error_files": written["error_files"],
        "rows_in": rows_in,
        "rows_out": written["rows_out"],
        "rows_errored": written["rows_errored"],
        "rows_resumed": rows_resumed,
        "rows_resume_stale": rows_resume_stale,
        "errors_by_reason": written["errors_by_reason"],
        "input_tokens": written["input_tokens"],
        "output_tokens": written["output_tokens"],
        "wall_time_s": round(wall_time_s, 3),
        "first_output_s": timeline.get("first_output_file_s"),
        "timeline": timeline,
        "rows_over_time": rows_over_time or [],
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
        "canary": canary,
        "incremental": incremental,
    }
    return Manifest.model_validate(body).model_dump(mode="json")


def publish(output_uri: str, body: dict[str, Any]) -> None:
    filesystems.write_text_atomic(manifest_uri(output_uri), json.dumps(body, indent=2, sort_keys=True))


def read(output_uri: str, env: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    return filesystems.read_json(manifest_uri(output_uri), env)


def log_line(body: dict[str, Any]) -> str:
    return MANIFEST_LOG_PREFIX + json.dumps(body, sort_keys=True)
