"""Progress of the rows through the engine or endpoint: a line in the job log every few seconds.

A light stage right after the engine (or the endpoint callers) counts each finished batch (rows, error
rows, generated tokens) into a small counter actor; a thread in the driver reads the counter and prints
``RAYLLM_PROGRESS {json}`` whenever it changed. The operator turns those lines into a readable progress
line in the task log (the trigger does the same while the task is deferred).

A stage sees a block only when the stage before it emits it, so the rows are cut into blocks of a few
batches (at most ``MAX_BLOCKS`` blocks) before the engine: progress moves in steps of one block.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from airflow_provider_rayllm.spec import PROGRESS_LOG_PREFIX

MAX_BLOCKS = 200
INTERVAL_S = 10.0


@dataclass
class Progress:
    rows_done: int
    rows_total: int
    rows_errored: int
    tokens_out: int
    elapsed_s: float
    tokens_per_s: float

    def line(self) -> str:
        return PROGRESS_LOG_PREFIX + json.dumps(asdict(self))


def parse(line: str) -> dict[str, Any] | None:
    """The payload of a progress line, or None for any other line."""
    if not line.startswith(PROGRESS_LOG_PREFIX):
        return None
    try:
        payload = json.loads(line[len(PROGRESS_LOG_PREFIX) :])
    except json.JSONDecodeError:
        return None
    return payload if isinstance(payload, dict) else None


def last_in(logs: str) -> dict[str, Any] | None:
    """The newest progress payload in a job log."""
    for line in reversed(logs.splitlines()):
        payload = parse(line)
        if payload is not None:
            return payload
    return None


def describe(p: dict[str, Any]) -> str:
    total = int(p.get("rows_total") or 0)
    done = int(p.get("rows_done") or 0)
    share = f" ({done / total:.0%})" if total else ""
    errored = int(p.get("rows_errored") or 0)
    return (
        f"{done}/{total} rows done{share}, {errored} error row(s), {int(p.get('tokens_out') or 0)} tokens out, "
        f"{float(p.get('tokens_per_s') or 0):.1f} tokens/s, {float(p.get('elapsed_s') or 0):.0f} s"
    )


def rows_per_block(rows: int, batch_size: int) -> int:
    """Whole batches per block, so that there are at most MAX_BLOCKS blocks."""
    batches = max(1, math.ceil(rows / batch_size))
    return batch_size * max(1, math.ceil(batches / MAX_BLOCKS))


class Counter:
    """Totals of the finished batches (a Ray actor with no CPU of its own)."""

    def __init__(self) -> None:
        self.rows = self.errored = self.tokens = 0

    def add(self, rows: int, errored: int, tokens: int) -> None:
        self.rows += rows
        self.errored += errored
        self.tokens += tokens

    def totals(self) -> tuple[int, int, int]:
        return self.rows, self.errored, self.tokens


def _count(value: Any) -> int:
    """A token count from a batch column (None or NaN where a row has none) as an int."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return 0
    return int(number) if math.isfinite(number) else 0


class FinishedBatches:
    """map_batches stage: count the batch, save its good rows when resuming, pass it on unchanged."""

    def __init__(self, counter: Any, error_column: str, tokens_column: str, save: Callable[[dict[str, Any]], Any] | None = None):
        self.counter, self.error_column, self.tokens_column, self.save = counter, error_column, tokens_column, save

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        n = len(next(iter(batch.values()))) if batch else 0
        errors = batch.get(self.error_column)
        failed = [bool(errors[i]) for i in range(n)] if errors is not None else [False] * n
        tokens = batch.get(self.tokens_column)
        generated = sum(_count(tokens[i]) for i in range(n) if not failed[i]) if tokens is not None else 0
        if self.save is not None:
            self.save(batch)
        self.counter.add.remote(n, sum(failed), generated)
        return batch


def watched(
    good: Any,
    rows: int,
    batch_size: int,
    infer: Callable[[Any], Any],
    progress: ProgressLog,
    error_column: str,
    tokens_column: str,
    save: Callable[[dict[str, Any]], Any] | None,
    light: dict[str, Any],
) -> Any:
    """``infer(good)`` with each finished batch counted (and saved, with ``save``) as it finishes."""
    # Only too-big blocks are cut; blocks that are already small enough are left as they are (merging
    # them would change which rows share an engine batch, and nothing is gained). Materialized before the
    # engine starts: the repartition task asks for a whole CPU, which a small cluster no longer has once
    # the engine and its stages hold theirs.
    per_block = rows_per_block(rows, batch_size)
    blocks = good
    if good.num_blocks() < math.ceil(rows / per_block):
        blocks = good.repartition(target_num_rows_per_block=per_block).materialize()
    stage = progress.stage(error_column, tokens_column, save)
    return infer(blocks).map_batches(stage, batch_format="numpy", batch_size=None, **light)


def infer_rows(
    good: Any,
    rows: int,
    batch_size: int,
    infer: Callable[[Any], Any],
    progress: ProgressLog,
    error_column: str,
    tokens_column: str,
    shape: Callable[[dict[str, Any]], dict[str, Any]],
    light: dict[str, Any],
    checkpoint_uri: str | None = None,
) -> tuple[Any, Any]:
    """(output rows shaped by ``shape``, error rows) of ``infer(good)``, each pipeline's engine or callers;
    with ``checkpoint_uri``, finished rows are saved as they finish (resume)."""
    from airflow_provider_rayllm.job.checkpoint import CheckpointStage
    from airflow_provider_rayllm.job.prompts import error_row

    def failed(row: dict[str, Any]) -> bool:
        return bool(row.get(error_column))

    save = CheckpointStage(checkpoint_uri, shape, failed) if checkpoint_uri else None
    raw = watched(good, rows, batch_size, infer, progress, error_column, tokens_column, save, light).materialize()
    outputs = raw.filter(lambda r: not failed(r), **light).map(shape, **light).materialize()
    errors = raw.filter(failed, **light).map(lambda r: error_row(r, error_column), **light)
    return outputs, errors


class ProgressLog:
    """Driver side: the counter actor and the thread that prints progress lines while the rows run."""

    def __init__(self, rows_total: int, say: Callable[[str], None], interval_s: float = INTERVAL_S):
        self.rows_total, self.say, self.interval_s = rows_total, say, interval_s
        self._stop = threading.Event()
        self._last: tuple[int, int, int] | None = None
        self._last_at = 0.0

    def __enter__(self) -> ProgressLog:
        import ray

        self.counter = ray.remote(num_cpus=0)(Counter).remote()
        self.started = self._last_at = time.time()
        self._thread = threading.Thread(target=self._loop, name="rayllm-progress", daemon=True)
        self._thread.start()
        return self

    def stage(self, error_column: str, tokens_column: str, save: Callable[[dict[str, Any]], Any] | None = None) -> FinishedBatches:
        return FinishedBatches(self.counter, error_column, tokens_column, save)

    def _report(self, final: bool = False) -> None:
        import ray

        totals = ray.get(self.counter.totals.remote(), timeout=30)
        if totals == self._last and not final:
            return
        now = time.time()
        before = self._last or (0, 0, 0)
        rate = (totals[2] - before[2]) / max(now - self._last_at, 1e-6)
        if final:
            rate = totals[2] / max(now - self.started, 1e-6)
        self._last, self._last_at = totals, now
        rows, errored, tokens = totals
        self.say(Progress(rows, self.rows_total, errored, tokens, round(now - self.started, 1), round(rate, 1)).line())

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._report()
            except Exception:  # progress is a courtesy; the pipeline decides the outcome
                continue

    def __exit__(self, *exc: Any) -> None:
        import ray

        self._stop.set()
        self._thread.join(timeout=5)
        try:
            if exc[0] is None:
                self._report(final=True)
        finally:
            ray.kill(self.counter)
