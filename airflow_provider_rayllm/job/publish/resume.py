"""Resume with ``prompt.id_column``: rows an earlier, unpublished attempt of this run already answered are
not sent again.

The output files an attempt writes as it goes are its checkpoints. The next attempt of the same task
instance and settings lists those files; the request step (one actor, see ``requests.ids.IdGate``) reads
their ids and drops the matching input rows; before the checks, the files are copied into the new
generation's outputs, and its publish moves them to the prefix with its own: the published output has
every row once. Error rows are not kept: a retry tries them
again. Copies carry the prefix ``ADOPTED`` and are never read as checkpoints themselves (their
originals are, for as long as those exist).
"""

from __future__ import annotations

import posixpath
from typing import Any

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


def rows_in_file(uri: str) -> int:
    """Rows of one output file: a Parquet footer, or the lines of a JSONL file."""
    import pyarrow.parquet as pq

    fs, path = filesystems.filesystem_for(uri)
    with fs.open_input_file(path) as handle:
        if uri.endswith(".parquet"):
            return pq.ParquetFile(handle).metadata.num_rows
        return sum(1 for line in handle.read().splitlines() if line.strip())


def adopt(files: list[str], generation_uri: str) -> list[dict[str, Any]]:
    """Copy the saved files into this generation's outputs; their entries for the manifest."""
    adopted = []
    for i, uri in enumerate(files):
        target = filesystems.join(generation_uri, OUTPUTS, f"{ADOPTED}{i:06d}-{posixpath.basename(uri)}")
        filesystems.copy_file(uri, target)
        adopted.append(target)
    sizes = {f["uri"]: f["bytes"] for f in filesystems.list_files(filesystems.join(generation_uri, OUTPUTS))}
    return [{"uri": uri, "rows": rows_in_file(uri), "bytes": sizes.get(uri, 0)} for uri in adopted]
