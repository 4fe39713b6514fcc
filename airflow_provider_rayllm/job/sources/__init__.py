"""The job's input as one lazy Ray dataset: files and buckets, or a SQL query the job runs itself.

Opening an input reads only what its columns and emptiness need (file footers and heads, the query
limited to one row); the rows themselves are read by the stream.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from airflow_provider_rayllm.contract.spec import JobSpec, RowsSource, SqlSource
from airflow_provider_rayllm.job.errors import JobError


@dataclass
class Input:
    ds: Any
    columns: list[str]
    description: str
    # The folders holding the input's files: where image_column paths may be read from by default.
    folders: list[str] = field(default_factory=list)
    # Called once the stream has read every row (a SQL read's shared snapshot ends there).
    close: Callable[[], None] = field(default=lambda: None)


def _nothing() -> None:
    return None


def input_folders(uris: list[str], files: list[str]) -> list[str]:
    """Each input URI's folder: a folder as given, a file's parent, the folder a glob's fixed part names."""
    folders = []
    for uri in uris:
        fixed = re.split(r"[*?\[]", uri, maxsplit=1)[0]
        if fixed != uri:
            folder = fixed if fixed.endswith("/") else posixpath.dirname(fixed)
        elif uri in files or uri.removeprefix("file://") in files:
            folder = posixpath.dirname(uri)
        else:
            folder = uri
        folders.append(folder.rstrip("/") or "/")
    return folders


def open_input(spec: JobSpec) -> Input:
    source = spec.source
    close: Callable[[], None] = _nothing
    if isinstance(source, RowsSource):
        import ray.data

        columns = list(dict.fromkeys(k for row in source.rows for k in row))
        where, has_rows = "input_rows", bool(source.rows)
        description = f"{len(source.rows)} row(s) given with the task, columns {columns}"
        ds = ray.data.from_items(source.rows)
    elif isinstance(source, SqlSource):
        from airflow_provider_rayllm.job.sources import sql

        columns, has_rows = sql.probe(source)
        where = "the query"
        description = f"{source.dialect} query with columns {columns}"
        ds, close = sql.read(source, columns) if has_rows else (None, close)
    else:
        from airflow_provider_rayllm.job.sources import files

        paths = files.expand(source)
        fmt = files.file_format(source, paths)
        columns, has_rows = files.probe(fmt, paths)
        where = repr(source.uris)
        if source.columns:
            absent = [c for c in source.columns if c not in columns]
            if absent:
                raise JobError(f"input_columns {absent!r} are not in the input; its columns: {columns!r}")
            columns = list(source.columns)
        description = f"{len(paths)} {fmt} file(s) with columns {columns}"
        ds = files.read(source, paths, fmt) if has_rows else None
    if not has_rows:
        raise JobError(f"source: no rows in {where}")
    if spec.limits.max_rows:
        ds = ds.limit(spec.limits.max_rows)
    folders = input_folders(source.uris, paths) if not isinstance(source, (RowsSource, SqlSource)) else []
    return Input(ds, columns, description, folders, close)
