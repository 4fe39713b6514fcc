"""The sink at the end of the stream: each write task shapes its answered rows and writes them as one
output file and (if any failed) one error file, while the engine is still answering later rows.

Ray Data launches a write task as soon as ``rows_per_file`` answered rows are ready, and hands each
task's result (its files, row counts, tokens, error reasons) to the driver once, when the write
completes: the manifest's counts are the counts of the files written, with no second pass over the rows.
A file is written whole (a rename on local disks, a single PUT on object stores), under a name that a
retry of the same task reuses, so a retried task replaces its file instead of adding one.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Iterable

from ray.data import Datasink
from ray.data.block import BlockAccessor

from airflow_provider_rayllm.contract.names import ERROR_COLUMN
from airflow_provider_rayllm.job import filesystems
from airflow_provider_rayllm.job.shaping import Shaper
from airflow_provider_rayllm.job.stream import KEPT_INPUT, to_python

OUTPUTS = "outputs"
ERRORS = "errors"
EXTENSIONS = {"parquet": ".parquet", "jsonl": ".jsonl"}


def encode(rows: list[dict[str, Any]], fmt: str) -> bytes:
    """Rows as one whole file's bytes; every key of any row becomes a column."""
    if fmt == "jsonl":
        return "".join(json.dumps(to_python(r), default=str) + "\n" for r in rows).encode()
    import pyarrow as pa
    import pyarrow.parquet as pq

    keys = list(dict.fromkeys(k for r in rows for k in r))
    table = pa.table({k: [to_python(r.get(k)) for r in rows] for k in keys})
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    return buffer.getvalue().to_pybytes()


def write_file(uri: str, rows: list[dict[str, Any]], fmt: str) -> dict[str, Any]:
    data = encode(rows, fmt)
    filesystems.write_bytes_atomic(uri, data)
    return {"uri": uri, "rows": len(rows), "bytes": len(data)}


def reason_of(error: str) -> str:
    """A short class for an error message: 'prompt', 'HTTP 429', 'ValueError', 'postprocess'..."""
    head = error.split(":", 1)[0].strip()
    return head[:60] or "unknown"


class ResultSink(Datasink):
    def __init__(self, generation_uri: str, fmt: str, rows_per_file: int, shaper: Shaper, counts: Any):
        self.generation_uri, self.fmt, self.rows_per_file = generation_uri, fmt, rows_per_file
        self.shaper, self.counts = shaper, counts
        self.results: list[dict[str, Any]] = []

    @property
    def min_rows_per_write(self) -> int:
        return self.rows_per_file

    def get_name(self) -> str:
        return "WriteAnswers"

    def write(self, blocks: Iterable[Any], ctx: Any) -> dict[str, Any]:
        outputs: list[dict[str, Any]] = []
        errors: list[dict[str, Any]] = []
        tokens_in = tokens_out = 0
        reasons: Counter[str] = Counter()
        for block in blocks:
            for row in BlockAccessor.for_block(block).to_arrow().to_pylist():
                shaped = self.shaper.shape(row)
                tokens_in += shaped.tokens_in
                tokens_out += shaped.tokens_out
                if shaped.output is not None:
                    outputs.append(shaped.output)
                else:
                    errors.append({**to_python(dict(row.get(KEPT_INPUT) or {})), ERROR_COLUMN: shaped.error})
                    reasons[reason_of(shaped.error)] += 1
        name = f"part-{ctx.task_idx:06d}{EXTENSIONS[self.fmt]}"
        result: dict[str, Any] = {
            "task": ctx.task_idx,
            "output_file": write_file(filesystems.join(self.generation_uri, OUTPUTS, name), outputs, self.fmt)
            if outputs
            else None,
            "error_file": write_file(filesystems.join(self.generation_uri, ERRORS, name), errors, self.fmt)
            if errors
            else None,
            "tokens_in": tokens_in,
            "tokens_out": tokens_out,
            "error_reasons": dict(reasons),
            "error_example": errors[0][ERROR_COLUMN] if errors else None,
        }
        import time

        self.counts.wrote(f"write-{ctx.task_idx}", int(bool(outputs)) + int(bool(errors)), time.time())
        return result

    def on_write_complete(self, write_result: Any) -> None:
        self.results = [r for r in write_result.write_returns if r]


def totals(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The write tasks' results added up: files, rows, tokens, error reasons."""
    outputs = sorted((r["output_file"] for r in results if r["output_file"]), key=lambda f: f["uri"])
    errors = sorted((r["error_file"] for r in results if r["error_file"]), key=lambda f: f["uri"])
    reasons: Counter[str] = Counter()
    for r in results:
        reasons.update(r["error_reasons"])
    return {
        "output_files": outputs,
        "error_files": errors,
        "rows_out": sum(f["rows"] for f in outputs),
        "rows_errored": sum(f["rows"] for f in errors),
        "input_tokens": sum(r["tokens_in"] for r in results),
        "output_tokens": sum(r["tokens_out"] for r in results),
        "errors_by_reason": dict(reasons),
        "error_examples": [r["error_example"] for r in results if r["error_example"]][:3],
    }
