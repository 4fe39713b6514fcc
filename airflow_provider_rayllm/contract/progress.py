"""The progress line: ``RAYLLM_PROGRESS {json}``, printed by the job's driver, read by the operator."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from airflow_provider_rayllm.contract.names import PROGRESS_LOG_PREFIX


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
    elapsed = float(p.get("elapsed_s") or 0)
    if not read and not done:
        return f"starting: no input row read yet, {elapsed:.0f} s"
    share = f" ({done / read:.0%} of the rows read so far)" if read else ""
    errored = int(p.get("rows_errored") or 0)
    files = int(p.get("files_written") or 0)
    tokens = int(p.get("tokens_out") or 0)
    # The rate since the first answer; a job whose answers all came within one progress period has none
    # yet, and its rate over the whole run is the honest figure.
    rate = float(p.get("tokens_per_s") or 0) or (tokens / elapsed if elapsed and tokens else 0.0)
    shown_rate = f"{rate:.1f} tokens/s, " if tokens else ""
    return (
        f"{done}/{read} rows done{share}, {errored} error row(s), {tokens} tokens out, {shown_rate}"
        f"{files} file(s) written, {elapsed:.0f} s"
    )
