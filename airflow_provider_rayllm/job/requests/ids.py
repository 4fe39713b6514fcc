"""The id column: each id once, and the ids an earlier attempt of this run answered skipped (resume)."""

from __future__ import annotations

from typing import Any

from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.job.stream import is_empty


class IdGate:
    """Each id once (a repeat fails the job, naming it); ids answered by an earlier attempt are skipped."""

    def __init__(self, id_column: str, saved_files: list[str], tally: Any):
        from airflow_provider_rayllm.job.publish.resume import read_ids

        self.column = id_column
        self.saved = read_ids(saved_files, id_column)
        self.seen: set[Any] = set()
        import ray

        ray.get(tally.saved.remote(len(self.saved)))

    def admit(self, rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
        kept = []
        for row in rows:
            value = row.get(self.column)
            if is_empty(value):
                raise JobError(
                    f"id_column {self.column!r}: a row has no id (value {value!r}); ids must be set and unique"
                )
            if value in self.seen:
                raise JobError(f"id_column {self.column!r} must be unique per row: {value!r} appears more than once")
            self.seen.add(value)
            if value not in self.saved:
                kept.append(row)
        return kept, len(rows) - len(kept)
