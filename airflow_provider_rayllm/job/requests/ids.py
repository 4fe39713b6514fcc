"""The id column: each id once, and the ids an earlier attempt of this run answered skipped (resume)."""

from __future__ import annotations

from typing import Any

from airflow_provider_rayllm.job import filesystems
from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.job.stream import is_empty


def read_ids(files: list[str], id_column: str) -> set[Any]:
    """The ids in the given output files (only that column is read)."""
    import pyarrow.json as pajson
    import pyarrow.parquet as pq

    ids: set[Any] = set()
    for uri in files:
        fs, path = filesystems.filesystem_for(uri)
        with fs.open_input_file(path) as handle:
            table = pq.read_table(handle, columns=[id_column]) if uri.endswith(".parquet") else pajson.read_json(handle)
        if id_column not in table.column_names:
            raise JobError(f"saved rows in {uri!r} have no id column {id_column!r}; columns: {table.column_names!r}")
        ids.update(table.column(id_column).to_pylist())
    return ids


class IdGate:
    """Each id once (a repeat fails the job, naming it); ids answered by an earlier attempt are skipped."""

    def __init__(self, id_column: str, saved_files: list[str], counts: Any):
        self.column = id_column
        self.saved = read_ids(saved_files, id_column)
        self.seen: set[Any] = set()
        import ray

        ray.get(counts.saved.remote(len(self.saved)))

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
