"""The id column: each id once, and the rows an earlier attempt of this run (resume) or the incremental base
answered for the same request skipped."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Hashable

from airflow_provider_rayllm.contract.names import REQUEST_KEY_COLUMN
from airflow_provider_rayllm.job import filesystems
from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.job.stream import is_empty

Pair = tuple[Hashable, Any]


def read_pairs(uri: str, id_column: str) -> list[Pair]:
    """(id, request key) of each row of one output file; the key is None in a file written without keys,
    so such a row is never reused."""
    import pyarrow.parquet as pq

    fs, path = filesystems.filesystem_for(uri)
    with fs.open_input_file(path) as handle:
        if not uri.endswith(".parquet"):  # JSON lines, parsed one by one: a row may be longer than any block
            rows = [json.loads(line) for line in handle.read().splitlines() if line.strip()]
            if any(id_column not in row for row in rows):
                raise JobError(f"saved rows in {uri!r} have no id column {id_column!r}")
            return [(row[id_column], row.get(REQUEST_KEY_COLUMN)) for row in rows]
        names = pq.ParquetFile(handle).schema_arrow.names
        if id_column not in names:
            raise JobError(f"saved rows in {uri!r} have no id column {id_column!r}; columns: {names!r}")
        # Without an id column the key is the id too: one column read.
        wanted = dict.fromkeys(c for c in (id_column, REQUEST_KEY_COLUMN) if c in names)
        table = pq.read_table(handle, columns=list(wanted))
    ids = table.column(id_column).to_pylist()
    if REQUEST_KEY_COLUMN not in table.column_names:
        return [(i, None) for i in ids]
    return list(zip(ids, table.column(REQUEST_KEY_COLUMN).to_pylist()))


def read_saved(files: list[str], id_column: str) -> tuple[Counter[Pair], int]:
    """The (id, request key) pairs in the given output files, each with the rows that hold it, and the rows
    in all."""
    pairs: Counter[Pair] = Counter()
    rows = 0
    for uri in files:
        found = read_pairs(uri, id_column)
        pairs.update(found)
        rows += len(found)
    return pairs, rows


class IdGate:
    """Each id once (a repeat fails the job, naming it); a row whose id and request key a saved row holds is
    skipped. A saved row whose request changed since is not matched: the row is asked again.

    Without an id column (incremental runs only) the whole-row key is the id (``keys.whole_row_key``): equal
    rows may repeat, and each saved row is reused at most once. ``unmatched`` counts the saved rows (by id)
    that no input row has claimed so far: once the stream is done, the base's rows dropped from the input."""

    def __init__(self, id_column: str | None, saved_files: list[str]):
        self.column = id_column
        self.saved, self.saved_rows = read_saved(saved_files, id_column or REQUEST_KEY_COLUMN)
        self.saved_ids = {i for i, _ in self.saved} if id_column else set()
        self.unmatched = len(self.saved_ids) if id_column else self.saved_rows
        self.seen: set[Any] = set()

    def _take(self, pair: Pair) -> bool:
        if pair[1] is None or self.saved[pair] <= 0:
            return False
        self.saved[pair] -= 1
        return True

    def admit(self, rows: list[dict[str, Any]], keys: list[Any]) -> tuple[list[int], list[Pair]]:
        """(the positions of the rows to ask, the (id, key) pairs of the rows skipped as saved)."""
        kept: list[int] = []
        reused: list[Pair] = []
        for position, (row, key) in enumerate(zip(rows, keys)):
            if self.column is None:
                if self._take((key, key)):
                    reused.append((key, key))
                    self.unmatched -= 1
                else:
                    kept.append(position)
                continue
            value = row.get(self.column)
            if is_empty(value):
                raise JobError(
                    f"id_column {self.column!r}: a row has no id (value {value!r}); ids must be set and unique"
                )
            if value in self.seen:
                raise JobError(f"id_column {self.column!r} must be unique per row: {value!r} appears more than once")
            self.seen.add(value)
            if value in self.saved_ids:
                self.unmatched -= 1
            if self._take((value, key)):
                reused.append((value, key))
            else:
                kept.append(position)
        return kept, reused
