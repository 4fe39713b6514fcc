"""The manifest: what a finished job published, written last under its output prefix."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from airflow_provider_rayllm.contract.names import MANIFEST_VERSION


class OutputFile(BaseModel):
    uri: str
    rows: int
    bytes: int


class Manifest(BaseModel):
    """What a finished batch job published (``_manifest.json`` under ``output_uri``, written last), and what
    the operator returns through XCom: locations and figures, never rows. Engine-specific details (the
    resolved engine settings, the endpoint, cost) come as further keys."""

    model_config = ConfigDict(extra="allow")

    manifest_version: int = MANIFEST_VERSION
    status: str = "SUCCEEDED"
    submission_id: str = Field(description="The Ray job's submission id.")
    generation: str = Field(
        description="The attempt (its folder was under output_uri/_generations) that this manifest publishes."
    )
    spec_hash: str
    output_uri: str = Field(description="The task's output prefix (the operator's output_uri).")
    outputs_folder: str = Field(description="Folder of the published output files: output_uri itself.")
    errors_folder: str = Field(
        description="Folder of the published error files (output_uri/_errors; one row per failed input row, with its reason)."
    )
    format: str
    output_files: list[OutputFile]
    error_files: list[OutputFile]
    rows_in: int
    rows_out: int
    rows_errored: int
    rows_resumed: int = Field(
        0, description="Rows an earlier, unpublished attempt of this run answered for the same request, kept (resume)."
    )
    rows_resume_stale: int = Field(
        0,
        description="Rows an earlier attempt saved that were dropped: their request (input, prompt, model or "
        "sampling) changed, or their id left the input. Those ids still present were answered again.",
    )
    errors_by_reason: dict[str, int] = Field(default_factory=dict)
    input_tokens: int
    output_tokens: int
    wall_time_s: float
    first_output_s: float | None = None
    timeline: dict[str, float | None] = Field(
        default_factory=dict,
        description="Seconds from the driver's start to each moment it recorded: plan_started_s, engine_ready_s, "
        "first_answer_s, first_output_file_s, last_answer_s, stream_done_s (None where a moment did not happen).",
    )
    rows_over_time: list[dict[str, float]] = Field(
        default_factory=list,
        description="Rows and tokens answered so far ({t_s, rows, tokens_out}), at most 60 samples over the stream.",
    )
    report_uri: str | None = Field(
        None, description="The run's report page (output_uri/_report.html); None where it could not be written."
    )
    started_at: str
    finished_at: str
    kind: str
    model: str
    task_type: str
    versions: dict[str, str]
    run: dict[str, Any]
    output_table: dict[str, Any] | None = None
    estimated_cost: float | None = Field(
        None, description="What the run cost at the prices given (engine time or tokens); None without a price."
    )
    canary: dict[str, Any] | None = Field(
        None, description="With canary_rows: the canary's rows, figures and verdict (its rows are in the output)."
    )
    incremental: dict[str, Any] | None = Field(
        None,
        description="With incremental: {base (the base run's manifest URI, None when there was none), key (the "
        "id column, or '(whole row)'), rows_reused, rows_computed, rows_dropped (base rows whose id left the input)}.",
    )
