"""Row bookkeeping while the stream runs, and the progress line in the job log.

The stages report into one small actor, ``StreamCounts``: the request step counts the rows it reads (and the
rows it skips because an earlier attempt answered them), the sink counts the rows it wrote, the error
rows and the tokens. Each report carries a key that is the same when Ray retries the same task, so a
retry is not counted twice. A thread in the driver reads the actor every few seconds and prints
``RAYLLM_PROGRESS {json}`` when it changed; the operator turns those lines into readable progress lines
in the task log (the trigger does the same while the task is deferred).

The actor's counts are for progress and for the job's own cross-check of its counts. The manifest's counts come
from what the sink reports for the files it wrote (Ray Data hands every write task's result to the
driver once, when the write completes).
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import threading
import time
from collections import Counter
from typing import Any, Callable, Iterator

from airflow_provider_rayllm.contract.progress import Progress
from airflow_provider_rayllm.job import actor_table
from airflow_provider_rayllm.job.budget import Budget
from airflow_provider_rayllm.job.errors import JobError

INTERVAL_S = 10.0
# Points of the report's rows-over-time line at most, whatever the number of batches.
SERIES_POINTS = 60
# A line at least this often even when nothing changed (an engine starting, a slow first batch).
HEARTBEAT_S = 60.0


class StreamCounts:
    """Counts reported by the stages (a Ray actor with no CPU of its own); a repeated key is counted once."""

    def __init__(self) -> None:
        self.reads: dict[str, tuple[int, int]] = {}
        self.answers: dict[str, tuple[int, int, int]] = {}
        self.answer_times: dict[str, float] = {}
        self.tokens_in: dict[str, int] = {}
        self.writes: dict[str, int] = {}
        self.saved_rows = 0
        # Saved rows (by id) no input row claimed so far: the incremental base's rows dropped from the input.
        self.unmatched_rows = 0
        # (id, request key) of the rows skipped as saved, by the batch that skipped them.
        self.reused: dict[str, list[Any]] = {}
        self.first_answer_at: float | None = None
        self.last_answer_at: float | None = None
        self.first_write_at: float | None = None
        # Rows answered when the first file's report came: fewer than all shows the writing overlapped the engine.
        self.answered_at_first_write: int | None = None

    def read(self, key: str, rows: int, skipped: int) -> None:
        self.reads[key] = (rows, skipped)

    def saved(self, rows: int) -> None:
        self.saved_rows = rows

    def unmatched(self, rows: int) -> None:
        self.unmatched_rows = rows

    def reuse(self, key: str, pairs: list[Any]) -> None:
        if pairs:
            self.reused[key] = pairs

    def reused_pairs(self) -> list[Any]:
        """Every (id, request key) pair skipped as saved: the saved rows the adoption keeps."""
        return [pair for pairs in self.reused.values() for pair in pairs]

    def answered(
        self, key: str, rows: int, errored: int, tokens_out: int, at: float, tokens_in: int = 0
    ) -> tuple[int, int]:
        """Count one answered batch; returns the job's tokens (in, out) so far, for its budgets."""
        if self.first_answer_at is None or at < self.first_answer_at:
            self.first_answer_at = at
        if self.last_answer_at is None or at > self.last_answer_at:
            self.last_answer_at = at
        self.answers[key] = (rows, errored, tokens_out)
        self.answer_times[key] = at
        self.tokens_in[key] = tokens_in
        return sum(self.tokens_in.values()), sum(a[2] for a in self.answers.values())

    def wrote(self, key: str, files: int, at: float) -> None:
        if self.answered_at_first_write is None:
            self.answered_at_first_write = sum(a[0] for a in self.answers.values())
        if self.first_write_at is None or at < self.first_write_at:
            self.first_write_at = at
        self.writes[key] = files

    def answered_series(self) -> list[tuple[float, int, int]]:
        """(time, rows, tokens out) of each answered batch, once per key."""
        return [(self.answer_times[k], rows, tokens) for k, (rows, _, tokens) in self.answers.items()]

    def totals(self) -> dict[str, Any]:
        return {
            "rows_read": sum(r for r, _ in self.reads.values()),
            "rows_skipped": sum(s for _, s in self.reads.values()),
            "rows_saved": self.saved_rows,
            "rows_unmatched": self.unmatched_rows,
            "rows_answered": sum(a[0] for a in self.answers.values()),
            "rows_errored": sum(a[1] for a in self.answers.values()),
            "tokens_out": sum(a[2] for a in self.answers.values()),
            "tokens_in": sum(self.tokens_in.values()),
            "files_written": sum(self.writes.values()),
            "first_answer_at": self.first_answer_at,
            "last_answer_at": self.last_answer_at,
            "first_write_at": self.first_write_at,
            "answered_at_first_write": self.answered_at_first_write,
        }


def rows_over_time(
    batches: list[tuple[float, int, int]], origin: float, points: int = SERIES_POINTS
) -> list[dict[str, float]]:
    """Rows and tokens answered so far, at most ``points`` samples: the batches in time order, summed, and of
    each of ``points`` equal slices of the time they span, the last sample. Seconds count from ``origin``."""
    if not batches:
        return []
    ordered = sorted(batches)
    first, last = ordered[0][0], ordered[-1][0]
    width = (last - first) / points or 1.0
    samples: dict[int, dict[str, float]] = {}
    rows = tokens = 0
    for at, batch_rows, batch_tokens in ordered:
        rows, tokens = rows + batch_rows, tokens + batch_tokens
        # The last slice is closed, so the final batch lands in slice points - 1, not its own.
        slot = min(int((at - first) / width), points - 1)
        samples[slot] = {"t_s": round(at - origin, 3), "rows": rows, "tokens_out": tokens}
    return [samples[k] for k in sorted(samples)]


def call_key(calls: dict[str, int]) -> str:
    """Task id and the batch's place in the task: the same key for the same batch of a retried task, so
    ``StreamCounts`` counts it once."""
    import ray

    task = ray.get_runtime_context().get_task_id() or "driver"
    calls[task] = calls.get(task, 0) + 1
    return f"{task}:{calls[task]}"


class AnswerCounter:
    """A stage right after the engine: counts each answered batch (rows, error rows, tokens in and out) into
    ``StreamCounts``, stops the run when the job's totals pass a budget (``budget.Budget``), and passes the
    batch on unchanged."""

    def __init__(
        self,
        counts: Any,
        error_column: str,
        tokens_out: Callable[[Any], int],
        tokens_in: Callable[[Any], int] | None = None,
        budget: Budget | None = None,
    ):
        self.counts, self.error_column, self.tokens_out = counts, error_column, tokens_out
        self.tokens_in, self.budget = tokens_in, budget
        self.calls: dict[str, int] = {}

    def __call__(self, batch: Any) -> Any:
        import pyarrow.compute as pc
        import ray

        errored = 0
        if self.error_column in batch.column_names:
            column = pc.fill_null(batch.column(self.error_column).cast("string"), "")
            errored = int(pc.sum(pc.not_equal(column, "")).as_py() or 0)
        tokens = self.tokens_out(batch)
        tokens_in = self.tokens_in(batch) if self.tokens_in is not None else 0
        now = time.time()
        spent_in, spent_out = ray.get(
            self.counts.answered.remote(call_key(self.calls), batch.num_rows, errored, tokens, now, tokens_in)
        )
        if self.budget is not None:
            self.budget.check(spent_in, spent_out, now)
        return batch


def column_sum(column: str) -> Callable[[Any], int]:
    """tokens_out for an AnswerCounter: the sum of a numeric column of the batch (missing or null counts 0)."""
    return _ColumnSum(column)


class _ColumnSum:
    def __init__(self, column: str):
        self.column = column

    def __call__(self, batch: Any) -> int:
        import pyarrow.compute as pc

        if self.column not in batch.column_names:
            return 0
        return int(pc.sum(batch.column(self.column)).as_py() or 0)


class StreamStalled(JobError):
    """No row was answered for ``stall_timeout_s``; the stream was interrupted (a job error like any other: the
    driver fails the job with its message, and a retry may run)."""


class ProgressLog:
    """Driver side: the ``StreamCounts`` actor, and a thread that prints a progress line when the counts change."""

    def __init__(
        self,
        print_line: Callable[[str], None],
        note: Callable[[str], None],
        engine_actor: str | None = None,
        interval_s: float = INTERVAL_S,
        stall_timeout_s: float | None = None,
    ):
        self.print_line, self.note = print_line, note
        # A stall is seen within a quarter of its limit, however long the progress interval.
        self.interval_s = min(interval_s, stall_timeout_s / 4) if stall_timeout_s else interval_s
        self.engine_actor = engine_actor
        self.stall_timeout_s = stall_timeout_s
        self.stalled: str | None = None
        self.ready_at: float | None = None
        self._stop = threading.Event()
        self._last: dict[str, Any] | None = None
        self._said_at = 0.0
        self._first_noted = False
        # When the stream in ``stoppable`` began (0: none is running).
        self._streaming = 0.0

    def __enter__(self) -> ProgressLog:
        import ray

        self.counts = ray.remote(num_cpus=0)(StreamCounts).remote()
        self.started = time.time()
        self._thread = threading.Thread(target=self._loop, name="rayllm-progress", daemon=True)
        self._thread.start()
        return self

    def totals(self) -> dict[str, Any]:
        import ray

        return ray.get(self.counts.totals.remote(), timeout=60)

    def reused_pairs(self) -> Counter[Any]:
        """The (id, request key) pairs the request step skipped as saved, each with the rows it skipped."""
        import ray

        return Counter(tuple(pair) for pair in ray.get(self.counts.reused_pairs.remote(), timeout=600))

    def _report(self, final: bool = False) -> None:
        totals = self.totals()
        now = time.time()
        self._watch_engine(now)
        if not final:
            self._watch_stall(totals, now)
        if totals == self._last and not final and now - self._said_at < HEARTBEAT_S:
            return
        self._last, self._said_at = totals, now
        first_write, first_answer = totals["first_write_at"], totals["first_answer_at"]
        if first_write is not None and not self._first_noted:
            self._first_noted = True
            self.note(
                f"first output file written {first_write - self.started:.1f} s after the plan started "
                f"({totals['answered_at_first_write']} rows answered when it was written; "
                f"{totals['rows_read']} read by this report)"
            )
        since = self.ready_at or first_answer
        rate = totals["tokens_out"] / (now - since) if since is not None and now - since >= 1.0 else 0.0
        self.print_line(
            Progress(
                rows_done=totals["rows_answered"] + totals["rows_skipped"],
                rows_total=totals["rows_read"],
                rows_errored=totals["rows_errored"],
                tokens_out=totals["tokens_out"],
                elapsed_s=round(now - self.started, 1),
                tokens_per_s=round(rate, 1),
                files_written=totals["files_written"],
                first_output_s=None if first_write is None else round(first_write - self.started, 1),
            ).line()
        )

    def _watch_engine(self, now: float) -> None:
        """When the engine's first actor is up (its constructor, which starts the engine, has returned; the time
        is the GCS actor table's, not this poll's): the tokens/s of the progress line count from then, not from
        the job's start, and the timeline's ``engine_ready_s`` is that moment."""
        if self.ready_at is not None or not self.engine_actor:
            return
        try:
            ready_at = actor_table.first_ready_at(actor_table.job_actors(self.engine_actor))
        except Exception:  # the actor table is a courtesy here
            return
        if ready_at is None:
            return
        # Clocks of other nodes may differ a little from the driver's: keep the moment within what was seen.
        self.ready_at = min(max(ready_at, self.started), now)
        self.note(f"engine ready {self.ready_at - self.started:.1f} s after the plan started")

    def _watch_stall(self, totals: dict[str, Any], now: float) -> None:
        """No row answered for ``stall_timeout_s`` since the stream started or its last answer: the stream is
        interrupted (see ``stoppable``) and the job ends with ``stalled`` as its error."""
        if not self.stall_timeout_s or self.stalled is not None or not self._streaming:
            return
        last = max(self._streaming, totals["last_answer_at"] or 0.0)
        if now - last < self.stall_timeout_s:
            return
        answered = totals["rows_answered"]
        self.stalled = (
            f"no row answered for {now - last:.0f} s (stall_timeout_s={self.stall_timeout_s:g}): the engine or "
            f"endpoint stopped answering after {answered} row(s); the job was ended and nothing was published"
        )
        self.note(self.stalled)
        _thread.interrupt_main()

    @contextlib.contextmanager
    def stoppable(self) -> Iterator[None]:
        """The stream runs here (in the main thread): a stall interrupts it as Ctrl-C would, and it ends as
        ``StreamStalled``. Python's own SIGINT handler is in place meanwhile (Ray may leave another)."""
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        self._streaming = time.time()
        try:
            yield
        except KeyboardInterrupt:
            if self.stalled is None:
                raise
            raise StreamStalled(self.stalled) from None
        finally:
            self._streaming = 0.0
            signal.signal(signal.SIGINT, previous)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._report()
            except Exception:  # progress is a courtesy; the stream decides the outcome
                continue

    def finish(self) -> dict[str, Any]:
        """Stop the thread, print the last line, and return the final totals."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._report(final=True)
        return self._last or self.totals()

    def series(self, origin: float) -> list[dict[str, float]]:
        """The report's rows-over-time samples, in seconds from ``origin`` (the driver's start)."""
        import ray

        return rows_over_time(ray.get(self.counts.answered_series.remote(), timeout=60), origin)

    def timeline(self, totals: dict[str, Any], origin: float) -> dict[str, float | None]:
        """Seconds from ``origin`` to each step the stream reported (None where it has none)."""

        def since(at: float | None) -> float | None:
            return None if at is None else round(at - origin, 3)

        return {
            "plan_started_s": since(self.started),
            "engine_ready_s": since(self.ready_at),
            "first_answer_s": since(totals["first_answer_at"]),
            "first_output_file_s": since(totals["first_write_at"]),
            "last_answer_s": since(totals["last_answer_at"]),
        }

    def __exit__(self, *exc: Any) -> None:
        import ray

        self._stop.set()
        self._thread.join(timeout=5)
        ray.kill(self.counts)
