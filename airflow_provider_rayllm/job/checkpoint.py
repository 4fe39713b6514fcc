"""Resume: finished rows are saved as they finish, and a later generation of the same run skips them.

With ``prompt.id_column`` set, a stage right after the engine (or the endpoint callers) writes each
finished batch's successful rows, already shaped as output rows, to
``_generations/<submission id>/checkpoint/<uuid>.parquet``. A job stopped or failed midway leaves those
files behind, unpublished. The next generation of the same task instance and settings (same submission
id up to ``-g<N>``, and newer than the published generation, if any) reads the ids in them, sends only the other rows to the engine, and publishes the
saved rows together with the new ones. Error rows are not saved: a retry tries them again.

Each file is written whole (a rename on local disks, a single PUT on object stores), so a stop in the
middle of a write leaves no half file that a resume would read.
"""

from __future__ import annotations

import logging
import posixpath
import re
import uuid
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from airflow_provider_rayllm.job import io
from airflow_provider_rayllm.job.errors import JobError

log = logging.getLogger("airflow_provider_rayllm.job")

CHECKPOINT = "checkpoint"
_GENERATION = re.compile(r"^(?P<base>.+)-g(?P<n>\d+)$")


def checkpoint_uri(generation_uri: str) -> str:
    return io.join(generation_uri, CHECKPOINT)


def _plain(value: Any) -> Any:
    """numpy scalars and arrays (what Ray's numpy batches hold) -> Python values pyarrow can type."""
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class CheckpointStage:
    """map_batches stage: save the batch's finished rows (shaped), pass the batch on unchanged."""

    def __init__(self, uri: str, shape: Callable[[dict[str, Any]], dict[str, Any]], failed: Callable[[dict[str, Any]], bool]):
        self.uri, self.shape, self.failed = uri, shape, failed

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        n = len(next(iter(batch.values()))) if batch else 0
        rows = [{key: _plain(batch[key][i]) for key in batch} for i in range(n)]
        done = [self.shape(r) for r in rows if not self.failed(r)]
        if done:
            write_rows(self.uri, done)
        return batch


def write_rows(uri: str, rows: list[dict[str, Any]]) -> str:
    """One whole parquet file under ``uri``; returns its URI."""
    buffer = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), buffer)
    target = io.join(uri, f"{uuid.uuid4().hex}.parquet")
    io.write_bytes_atomic(target, buffer.getvalue().to_pybytes())
    return target


def earlier_generations(generations_uri: str, submission_id: str, published: str | None = None) -> list[str]:
    """Names of this task instance's earlier unpublished generations with the same settings, oldest first.

    Only generations after the ``published`` one count: a run that finished and is run again on purpose
    (a cleared task, a second backfill) computes every row again, since its input may have changed.
    """
    match = _GENERATION.match(submission_id)
    if not match:
        return []
    base, current = match.group("base"), int(match.group("n"))
    after = -1
    done = _GENERATION.match(published or "")
    if done and done.group("base") == base:
        after = int(done.group("n"))
    found: list[tuple[int, str]] = []
    for name in io.list_subdirs(generations_uri):
        m = _GENERATION.match(name)
        if m and m.group("base") == base and after < int(m.group("n")) < current:
            found.append((int(m.group("n")), name))
    return [name for _, name in sorted(found)]


def read_saved(uris: list[str], id_column: str) -> pa.Table | None:
    """Every saved row of the given checkpoint folders, one row per id (the first saved wins)."""
    tables: list[pa.Table] = []
    for uri in uris:
        fs, base = io.filesystem_for(uri)
        selector = pafs.FileSelector(base, recursive=False, allow_not_found=True)
        for info in sorted(fs.get_file_info(selector), key=lambda i: i.path):
            name = posixpath.basename(info.path)
            if info.type != pafs.FileType.File or not name.endswith(".parquet") or name.startswith("."):
                continue
            tables.append(pq.read_table(info.path, filesystem=fs))
    if not tables:
        return None
    table = pa.concat_tables(tables, promote_options="permissive")
    if id_column not in table.column_names:
        raise JobError(f"saved rows have no id column {id_column!r}; columns: {table.column_names!r}")
    first: dict[Any, int] = {}
    for i, value in enumerate(table.column(id_column).to_pylist()):
        first.setdefault(value, i)
    return table if len(first) == table.num_rows else table.take(sorted(first.values()))
