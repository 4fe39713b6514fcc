"""Resume with ``prompt.id_column``: rows an earlier, unpublished attempt of this run already answered for
the same request are not sent again.

The output files an attempt writes as it goes are its checkpoints. The next attempt of the same task
instance and settings lists those files; the request step (one actor, see ``requests.ids.IdGate``) reads
their (id, request key) pairs and skips an input row only when both match: a row whose input, prompt,
model or sampling changed since is asked again. After the stream, the saved files are adopted into the
new generation's outputs holding only the rows that were skipped (each pair once): a stale saved row (its
request changed, or its id left the input) is dropped, so the published output has every id once, with
the current answer. Error rows are not kept: a retry tries them again. Adopted files carry the prefix
``ADOPTED`` and are never read as checkpoints themselves (their originals are, for as long as those exist).

An incremental run adopts the base run's files the same way (see ``incremental``); without an id column the
whole-row key is the id, and a pair may be wanted more than once (equal rows), so ``wanted`` is a multiset.
"""

from __future__ import annotations

import json
import posixpath
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Hashable

from airflow_provider_rayllm.contract.names import REQUEST_KEY_COLUMN
from airflow_provider_rayllm.job import filesystems
from airflow_provider_rayllm.job.publish import generations
from airflow_provider_rayllm.job.sinks.files import OUTPUTS

ADOPTED = "adopted-"


def saved_files(output_uri: str, current: generations.Generation, published: str | None) -> list[str]:
    """Output files of this run's earlier unpublished attempts, oldest attempt first."""
    files: list[str] = []
    for g in generations.unpublished_earlier(output_uri, current, published):
        folder = filesystems.join(generations.generation_uri(output_uri, g.name), OUTPUTS)
        files += [
            f["uri"] for f in filesystems.list_files(folder) if not posixpath.basename(f["uri"]).startswith(ADOPTED)
        ]
    return files


@dataclass
class Adoption:
    """The adopted files' entries for the manifest, and the saved rows left out as stale."""

    files: list[dict[str, Any]] = field(default_factory=list)
    stale_rows: int = 0

    @property
    def rows(self) -> int:
        return sum(f["rows"] for f in self.files)


Wanted = Counter[tuple[Hashable, Any]]


def _take(wanted: Wanted, pair: tuple[Hashable, Any]) -> bool:
    if wanted[pair] <= 0:
        return False
    wanted[pair] -= 1
    return True


def _kept_lines(data: bytes, id_column: str, wanted: Wanted) -> tuple[bytes, int, int]:
    """A JSONL file's lines whose (id, key) is wanted (each as often as wanted, taken from ``wanted``): (their
    bytes as written, rows kept, rows in the file)."""
    kept, total, rows = [], 0, 0
    for line in data.splitlines(keepends=True):
        if not line.strip():
            continue
        total += 1
        row = json.loads(line)
        pair = (row.get(id_column), row.get(REQUEST_KEY_COLUMN))
        if _take(wanted, pair):
            kept.append(line if line.endswith(b"\n") else line + b"\n")
            rows += 1
    return b"".join(kept), rows, total


def _kept_parquet(data: bytes, id_column: str, wanted: Wanted) -> tuple[bytes, int, int]:
    """A Parquet file's rows whose (id, key) is wanted (each as often as wanted), as a Parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(pa.BufferReader(data))
    ids = table.column(id_column).to_pylist()
    keys = (
        table.column(REQUEST_KEY_COLUMN).to_pylist()
        if REQUEST_KEY_COLUMN in table.column_names
        else [None] * table.num_rows
    )
    mask = [_take(wanted, pair) for pair in zip(ids, keys)]
    rows = sum(mask)
    if rows == table.num_rows:
        return data, rows, rows
    buffer = pa.BufferOutputStream()
    pq.write_table(table.filter(pa.array(mask, type=pa.bool_())), buffer)
    return buffer.getvalue().to_pybytes(), rows, table.num_rows


def adopt(
    files: list[str], generation_uri: str, id_column: str, reused: Counter[tuple[Hashable, Any]] | set[Any]
) -> Adoption:
    """The saved files into this generation's outputs, each holding only its rows whose (id, request key)
    the stream skipped as saved (``reused``, each pair as often as it was skipped): a file wholly reused is
    copied as it is, one with stale rows is written again without them, one with none is left out."""
    wanted: Wanted = Counter(reused)
    adoption = Adoption()
    for i, uri in enumerate(files):
        fs, path = filesystems.filesystem_for(uri)
        with fs.open_input_file(path) as handle:
            data = handle.read()
        pick = _kept_parquet if uri.endswith(".parquet") else _kept_lines
        body, rows, total = pick(data, id_column, wanted)
        adoption.stale_rows += total - rows
        if not rows:
            continue
        target = filesystems.join(generation_uri, OUTPUTS, f"{ADOPTED}{i:06d}-{posixpath.basename(uri)}")
        if rows == total:
            filesystems.copy_file(uri, target)  # a server-side copy on object stores
        else:
            filesystems.write_bytes_atomic(target, body)
        adoption.files.append({"uri": target, "rows": rows, "bytes": len(body)})
    return adoption
