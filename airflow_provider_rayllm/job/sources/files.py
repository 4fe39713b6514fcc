"""Files, bucket objects and Hugging Face datasets as the job's input: Parquet, JSONL or CSV, through Ray
Data's readers."""

from __future__ import annotations

import fnmatch
import functools
import glob as globlib
import os
import posixpath
from typing import Any, Iterator

import pyarrow.fs as pafs

from airflow_provider_rayllm.contract.spec import FileSource, format_from_uri, hf_dataset, uri_scheme
from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.job.filesystems import filesystem_for
from airflow_provider_rayllm.job.sources import hub

# Enough of a JSON or CSV file to learn its columns (pyarrow infers from its first block too); more when its
# first row (or, for CSV, the header and first row) is longer.
PROBE_BYTES = 1 << 20
# pyarrow's CSV reader parses blocks of this size and fails on a row longer than one block ("straddling
# object"); the reader starts here and grows the block when a row needs it.
CSV_BLOCK_BYTES = 1 << 20
# pyarrow keeps a block size in 32 bits: a row longer than this cannot be read.
MAX_BLOCK_BYTES = (1 << 31) - 1


def _has_glob(path: str) -> bool:
    return any(ch in path for ch in "*?[")


def _hidden(relative: str) -> bool:
    return any(part.startswith(("_", ".")) for part in relative.split("/"))


def _glob_base(path: str) -> str:
    """The folder above a glob's first wildcard."""
    first = min(path.index(ch) for ch in "*?[" if ch in path)
    return path[:first].rsplit("/", 1)[0]


def _skip_hidden(matched: list[str], path: str) -> list[str]:
    """Matches of a glob without the names folder readers skip (``_``/``.``: a published prefix's
    ``_errors/``, ``_generations/``, ``_manifest.json``, ``_SUCCESS``) below its first wildcard, unless the
    pattern itself names such an entry there (``out/_errors/*.parquet`` reads what it says)."""
    base = _glob_base(path)
    if _hidden(posixpath.relpath(path, base)):
        return matched
    return [m for m in matched if not _hidden(posixpath.relpath(m.split("://", 1)[-1], base))]


def expand(source: FileSource) -> list[str]:
    """Every input file, in a stable order; a clear error when a path matches nothing."""
    files: list[str] = []
    checked: set[tuple[str, str | None]] = set()
    for uri in source.uris:
        if uri_scheme(uri) == "hf":
            repo, revision, _ = hf_dataset(uri)
            if (repo, revision) not in checked:
                hub.check_dataset(uri)
                checked.add((repo, revision))
        fs, path = filesystem_for(uri)
        scheme = uri_scheme(uri)
        prefix = "" if scheme == "file" else f"{scheme}://"
        if _has_glob(path):
            if scheme == "file":
                matched = sorted(p for p in globlib.glob(path, recursive=True) if os.path.isfile(p))
            else:
                base = path.split("*", 1)[0].rsplit("/", 1)[0]
                selector = pafs.FileSelector(base, recursive=True, allow_not_found=True)
                matched = sorted(
                    prefix + info.path
                    for info in fs.get_file_info(selector)
                    if info.type == pafs.FileType.File and fnmatch.fnmatch(info.path, path)
                )
            matched = _skip_hidden(matched, path)
            if not matched:
                raise JobError(f"source.uris: no file matches {uri!r}")
            files.extend(matched)
            continue
        try:
            info = fs.get_file_info(path)
        except Exception as exc:
            raise JobError(f"source.uris: cannot read {uri!r}: {exc}") from exc
        if info.type == pafs.FileType.NotFound:
            raise JobError(f"source.uris: {uri!r} does not exist")
        if info.type == pafs.FileType.Directory:
            # Hidden names, files or folders, are skipped as folder readers skip them: a published prefix
            # of ours reads as its output rows (not _errors/, _generations/, _manifest.json, _SUCCESS).
            selector = pafs.FileSelector(path, recursive=True)
            inner = sorted(
                prefix + i.path
                for i in fs.get_file_info(selector)
                if i.type == pafs.FileType.File and not _hidden(posixpath.relpath(i.path, path))
            )
            if not inner:
                raise JobError(f"source.uris: folder {uri!r} holds no data files")
            files.extend(inner)
        else:
            files.append(prefix + path if prefix else path)
    return files


def file_format(source: FileSource, files: list[str]) -> str:
    if source.format:
        return source.format
    formats = {format_from_uri(f) for f in files}
    if len(formats) != 1 or None in formats:
        shown = sorted(os.path.basename(f) for f in files)[:5]
        raise JobError(
            f"source.format: cannot infer one format from the files {shown!r}; "
            "set input_format to 'parquet', 'jsonl' or 'csv'"
        )
    return str(formats.pop())


def _head(uri: str, lines: int) -> bytes:
    """The file's first PROBE_BYTES, cut after its last whole line; read on while fewer than ``lines`` whole
    lines are in (a first row longer than PROBE_BYTES)."""
    fs, path = filesystem_for(uri)
    with fs.open_input_file(path) as handle:
        data = handle.read(PROBE_BYTES)
        while data.count(b"\n") < lines:
            more = handle.read(PROBE_BYTES)
            if not more:
                return data  # the whole file
            data += more
    return data[: data.rindex(b"\n") + 1]  # whole lines only


@functools.cache
def parquet_footer(uri: str) -> Any:
    """A Parquet file's footer, read once per job: the probe and the read tasks' pieces both need it."""
    import pyarrow.parquet as pq

    fs, path = filesystem_for(uri)
    with fs.open_input_file(path) as handle:
        return pq.ParquetFile(handle).metadata


def probe(fmt: str, files: list[str]) -> tuple[list[str], bool]:
    """(the input's columns, whether any file holds a row), read from file footers and heads only."""
    import pyarrow as pa

    columns: list[str] = []
    has_rows = False
    for uri in files:
        try:
            if fmt == "parquet":
                meta = parquet_footer(uri)
                names, rows = meta.schema.to_arrow_schema().names, meta.num_rows
            else:
                head = _head(uri, 1 if fmt == "jsonl" else 2)  # CSV: the header and a row
                if not head.strip():
                    continue
                block = min(max(len(head), 1), MAX_BLOCK_BYTES)  # the head in one block, however long its rows
                if fmt == "jsonl":
                    import pyarrow.json as pajson

                    table = pajson.read_json(pa.BufferReader(head), read_options=pajson.ReadOptions(block_size=block))
                else:
                    import pyarrow.csv as pacsv

                    table = pacsv.read_csv(pa.BufferReader(head), read_options=pacsv.ReadOptions(block_size=block))
                names, rows = table.column_names, table.num_rows
        except (pa.ArrowInvalid, OSError) as exc:
            raise JobError(f"source.uris: {uri!r} is not readable as {fmt}: {exc}") from None
        columns.extend(n for n in names if n not in columns)
        has_rows = has_rows or rows > 0
        if has_rows and fmt != "parquet":
            break  # the first file with rows tells the columns of a text format
    return columns, has_rows


# A Parquet read task reads row groups adding up to about this many rows (whole row groups; a larger one
# is a task of its own) and hands them on in batches of BATCH_ROWS.
PIECE_ROWS = 50_000
BATCH_ROWS = 5_000


def parquet_pieces(files: list[str]) -> list[dict[str, Any]]:
    """The Parquet input as read tasks of about PIECE_ROWS rows each: (file, row groups), from the footers.

    Ray Data holds back a read task that has not started while the stages after it are behind, but not one
    that is running: read as one task per file (Ray's Parquet reader), a large file was read far ahead of
    the engine, its rows filling the object store (4x10^6 rows: 417 MB of a 512 MiB store, with 0.6x10^6
    answered). Read as pieces, the rows in flight stay within Ray Data's object-store budget."""
    pieces: list[dict[str, Any]] = []
    for uri in files:
        meta = parquet_footer(uri)
        groups: list[int] = []
        rows = 0
        for index in range(meta.num_row_groups):
            groups.append(index)
            rows += meta.row_group(index).num_rows
            if rows >= PIECE_ROWS:
                pieces.append({"uri": uri, "row_groups": groups})
                groups, rows = [], 0
        if groups:
            pieces.append({"uri": uri, "row_groups": groups})
    return pieces


def read_pieces(batch: dict[str, Any], columns: list[str] | None) -> Iterator[Any]:
    """A read task: its pieces' row groups, BATCH_ROWS rows at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for uri, groups in zip(batch["uri"], batch["row_groups"]):
        fs, path = filesystem_for(str(uri))
        with fs.open_input_file(path) as handle:
            for part in pq.ParquetFile(handle).iter_batches(
                batch_size=BATCH_ROWS, row_groups=[int(g) for g in groups], columns=columns
            ):
                yield pa.Table.from_batches([part])


def csv_tables(uri: str, block_bytes: int = CSV_BLOCK_BYTES) -> Iterator[Any]:
    """One CSV file's rows, a block at a time, with pyarrow's streaming reader (as Ray's CSV reader does).
    A row longer than the block fails pyarrow's parse: the file is opened again with a block four times
    larger, past the rows already handed on, with the column types the first blocks had."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    done, types = 0, None
    while True:
        fs, path = filesystem_for(uri)
        read_options = pacsv.ReadOptions(use_threads=False, block_size=block_bytes, skip_rows_after_names=done)
        convert = pacsv.ConvertOptions(column_types=types) if types else None
        try:
            with fs.open_input_stream(path) as stream:  # a .gz is read through its codec
                for batch in pacsv.open_csv(stream, read_options=read_options, convert_options=convert):
                    if types is None:
                        types = {f.name: f.type for f in batch.schema if not pa.types.is_null(f.type)}
                    done += batch.num_rows
                    yield pa.Table.from_batches([batch])
            return
        except pa.ArrowInvalid as exc:
            if "Empty CSV file" in str(exc):
                return  # the probe passed it over as holding no rows
            if "straddl" not in str(exc) or block_bytes >= MAX_BLOCK_BYTES:
                raise JobError(f"source.uris: {uri!r} is not readable as csv: {exc}") from None
            block_bytes = min(block_bytes * 4, MAX_BLOCK_BYTES)


def read_csv_files(batch: dict[str, Any]) -> Iterator[Any]:
    """A read task: its CSV files' rows."""
    for uri in batch["uri"]:
        yield from csv_tables(str(uri))


def read(source: FileSource, files: list[str], fmt: str) -> Any:
    """A lazy Ray dataset over the given files."""
    import ray.data

    from airflow_provider_rayllm.job.stream import LIGHT

    # Reading is light work beside the engine: a whole CPU per read task would wait behind the engine's
    # actors on a small cluster.
    if fmt == "parquet":
        pieces = parquet_pieces(files)
        return ray.data.from_items(pieces, override_num_blocks=len(pieces)).map_batches(
            read_pieces, fn_kwargs={"columns": source.columns}, batch_size=1, **LIGHT
        )
    if fmt == "csv":
        # Our own reader: Ray's fails on a row longer than pyarrow's block, and takes no block size per row.
        ds = ray.data.from_items([{"uri": f} for f in files], override_num_blocks=len(files)).map_batches(
            read_csv_files, batch_size=1, **LIGHT
        )
        return ds.select_columns(source.columns) if source.columns else ds
    kwargs: dict[str, Any] = {"num_cpus": LIGHT["num_cpus"]}
    fs, _ = filesystem_for(files[0])
    if uri_scheme(files[0]) != "file":
        kwargs["filesystem"] = fs
        files = [filesystem_for(f)[1] for f in files]
    # Both JSON readers take rows of any length: pandas' line reader, and pyarrow's JSON reader, which Ray
    # retries with a doubled block up to DataContext.target_max_block_size.
    if "filesystem" in kwargs:
        # Ray 2.60's line reader takes no filesystem; pyarrow's JSON reader (the default one) reads
        # newline-delimited JSON and does.
        ds = ray.data.read_json(files, **kwargs)
    else:
        ds = ray.data.read_json(files, lines=True, num_cpus=LIGHT["num_cpus"])
    return ds.select_columns(source.columns) if source.columns else ds
