"""Row bookkeeping while the stream runs, and the progress line in the job log.

The stages report their counts: the request step the rows it reads (and the rows it skips because an earlier
attempt answered them), the step after the engine the rows answered, the error rows and the tokens, the sink
the files it wrote. Each report carries a key that is the same when Ray retries the same task, so a retry is
not counted twice. The reports go to Ray's GCS key-value store, each under a key of its own below the job's
prefix (``KVCounts``): no process of the job's own holds them (an actor for them was one more worker process
per job, about a CPU-second to start). A job with a budget reports to a ``StreamCounts`` actor instead
(``ActorCounts``), whose answer to each answered batch is the job's totals at once, so that the budget stops
the run within one batch. A thread in the driver tallies the reports every few seconds (``StreamCounts`` again,
in the driver) and prints ``RAYLLM_PROGRESS {json}`` when they changed; the operator turns those lines into
readable progress lines in the task log (the trigger does the same while the task is deferred).

The counts are for progress and for the job's own cross-check of its counts. The manifest's counts come
from what the sink reports for the files it wrote (Ray Data hands every write task's result to the
driver once, when the write completes).
"""

from __future__ import annotations

import _thread
import contextlib
import os
import pickle
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


# Where the stages' reports are kept in Ray's GCS key-value store: "<Ray job id>/<stream>/<kind>/<key>" (the
# stream: the driver's pid and start; the leftovers sweep removes an ended job's keys by its Ray job id).
COUNTS_NAMESPACE = "rayllm_counts"


class StreamCounts:
    """The tally of the stages' reports; a repeated key is counted once. In the driver (``KVCounts``' reports
    read back), or as a Ray actor with no CPU of its own for a job with a budget (``ActorCounts``)."""

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
        if self.first_write_at is None or at < self.first_write_at:
            self.first_write_at = at
        self.writes[key] = files

    def answered_series(self) -> list[tuple[float, int, int]]:
        """(time, rows, tokens out) of each answered batch, once per key."""
        return [(self.answer_times[k], rows, tokens) for k, (rows, _, tokens) in self.answers.items()]

    def answered_by(self, at: float | None) -> int | None:
        """Rows answered at or before ``at``: at the first file's write, fewer than all shows that the writing
        overlapped the engine."""
        if at is None:
            return None
        return sum(rows for key, (rows, _, _) in self.answers.items() if self.answer_times[key] <= at)

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
            "answered_at_first_write": self.answered_by(self.first_write_at),
        }

    def apply(self, kind: str, key: str, value: tuple[Any, ...]) -> None:
        """One report read back from the key-value store (see ``KVCounts``)."""
        if kind in ("saved", "unmatched"):
            getattr(self, kind)(*value)
        elif kind in ("read", "reuse", "answered", "wrote"):
            getattr(self, kind)(key, *value)


class KVCounts:
    """The stages' side of the counts: each report a key of its own in Ray's GCS key-value store, under the
    job's prefix; the same key again when Ray retries the task, so it is counted once. Picklable, handed to
    every stage; the driver reads the reports back with ``read_back``."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def _put(self, kind: str, key: str, value: tuple[Any, ...]) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        _internal_kv_put(f"{self.prefix}{kind}/{key}", pickle.dumps(value), namespace=COUNTS_NAMESPACE)

    def read(self, key: str, rows: int, skipped: int) -> None:
        self._put("read", key, (rows, skipped))

    def saved(self, rows: int) -> None:
        self._put("saved", "", (rows,))

    def unmatched(self, rows: int) -> None:
        self._put("unmatched", "", (rows,))

    def reuse(self, key: str, pairs: list[Any]) -> None:
        self._put("reuse", key, (pairs,))

    def answered(
        self, key: str, rows: int, errored: int, tokens_out: int, at: float, tokens_in: int = 0
    ) -> tuple[int, int] | None:
        """Count one answered batch; no totals come back (a job with a budget uses ``ActorCounts``)."""
        self._put("answered", key, (rows, errored, tokens_out, at, tokens_in))
        return None

    def wrote(self, key: str, files: int, at: float) -> None:
        self._put("wrote", key, (files, at))

    def read_back(self, tally: StreamCounts, seen: set[bytes]) -> StreamCounts:
        """Adds to ``tally`` the reports not in ``seen`` (each key once: a report's key is fixed by its batch),
        and the latest of the ones kept whole (``saved``, ``unmatched``)."""
        from ray.experimental.internal_kv import internal_kv_get_gcs_client

        client = internal_kv_get_gcs_client()
        namespace = COUNTS_NAMESPACE.encode()
        keys = client.internal_kv_keys(self.prefix.encode(), namespace=namespace)
        new = [k for k in keys if k not in seen or k.endswith(b"/")]
        if new:
            for raw, value in client.internal_kv_multi_get(new, namespace=namespace).items():
                kind, _, key = raw.decode()[len(self.prefix) :].partition("/")
                tally.apply(kind, key, pickle.loads(value))
                seen.add(raw)
        return tally

    def remove(self) -> None:
        from ray.experimental.internal_kv import _internal_kv_del

        _internal_kv_del(self.prefix, del_by_prefix=True, namespace=COUNTS_NAMESPACE)


class ActorCounts:
    """The stages' side of the counts for a job with a budget: each report a call to a ``StreamCounts`` actor,
    whose answer to an answered batch is the job's tokens so far, for the budget's check at once."""

    def __init__(self, actor: Any):
        self.actor = actor

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self.actor, method).remote(*args))

    def read(self, key: str, rows: int, skipped: int) -> None:
        self._call("read", key, rows, skipped)

    def saved(self, rows: int) -> None:
        self._call("saved", rows)

    def unmatched(self, rows: int) -> None:
        self._call("unmatched", rows)

    def reuse(self, key: str, pairs: list[Any]) -> None:
        self._call("reuse", key, pairs)

    def answered(
        self, key: str, rows: int, errored: int, tokens_out: int, at: float, tokens_in: int = 0
    ) -> tuple[int, int] | None:
        spent_in, spent_out = self._call("answered", key, rows, errored, tokens_out, at, tokens_in)
        return int(spent_in), int(spent_out)

    def wrote(self, key: str, files: int, at: float) -> None:
        self._call("wrote", key, files, at)


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
    """Task id and the batch's place in the task: the same key for the same batch of a retried task, so the
    counts count it once."""
    import ray

    task = ray.get_runtime_context().get_task_id() or "driver"
    calls[task] = calls.get(task, 0) + 1
    return f"{task}:{calls[task]}"


class AnswerCounter:
    """A stage right after the engine (or, through ``count``, the engine's own actors): reports each answered
    batch (rows, error rows, tokens in and out) to the job's counts, stops the run when the job's totals pass a
    budget (``budget.Budget``), and passes the batch on unchanged."""

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

        errored = 0
        if self.error_column in batch.column_names:
            column = pc.fill_null(batch.column(self.error_column).cast("string"), "")
            errored = int(pc.sum(pc.not_equal(column, "")).as_py() or 0)
        tokens = self.tokens_out(batch)
        tokens_in = self.tokens_in(batch) if self.tokens_in is not None else 0
        self.count(batch.num_rows, errored, tokens, tokens_in)
        return batch

    def count(self, rows: int, errored: int, tokens_out: int, tokens_in: int = 0) -> None:
        """Report one answered batch and hold the run to its budget: what ``__call__`` does with a batch's
        columns, for an engine stage that counts its own answers as it gives them (``HttpCaller``)."""
        now = time.time()
        spent = self.counts.answered(call_key(self.calls), rows, errored, tokens_out, now, tokens_in)
        if self.budget is not None:
            if spent is None:
                raise RuntimeError("a budget needs the job's totals with each answer (ActorCounts)")
            self.budget.check(spent[0], spent[1], now)


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
    """Driver side: the job's counts (``KVCounts``, or ``ActorCounts`` with ``totals_per_answer``), and a thread
    that prints a progress line when they change."""

    def __init__(
        self,
        print_line: Callable[[str], None],
        note: Callable[[str], None],
        engine_actor: str | None = None,
        interval_s: float = INTERVAL_S,
        stall_timeout_s: float | None = None,
        totals_per_answer: bool = False,
    ):
        self.print_line, self.note = print_line, note
        # A budget needs the job's totals back with each answered batch: the counts go to an actor then.
        self.totals_per_answer = totals_per_answer
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

        self._actor: Any = None
        if self.totals_per_answer:
            self._actor = ray.remote(num_cpus=0)(StreamCounts).remote()
            self.counts: KVCounts | ActorCounts = ActorCounts(self._actor)
        else:
            self.counts = KVCounts(f"{ray.get_runtime_context().get_job_id()}/{os.getpid()}-{time.time_ns()}/")
            self._tally, self._seen = StreamCounts(), set()
            self._reading = threading.Lock()
        self.started = time.time()
        self._thread = threading.Thread(target=self._loop, name="rayllm-progress", daemon=True)
        self._thread.start()
        return self

    def _ask(self, question: str, timeout: float = 60) -> Any:
        """One of ``StreamCounts``' answers (``totals``, ``reused_pairs``, ``answered_series``) over the reports so far."""
        import ray

        if self._actor is not None:
            return ray.get(getattr(self._actor, question).remote(), timeout=timeout)
        assert isinstance(self.counts, KVCounts)
        with self._reading:
            return getattr(self.counts.read_back(self._tally, self._seen), question)()

    def totals(self) -> dict[str, Any]:
        return dict(self._ask("totals"))

    def reused_pairs(self) -> Counter[Any]:
        """The (id, request key) pairs the request step skipped as saved, each with the rows it skipped."""
        return Counter(tuple(pair) for pair in self._ask("reused_pairs", timeout=600))

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
        return rows_over_time(self._ask("answered_series"), origin)

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
        if self._actor is not None:
            ray.kill(self._actor)
        elif isinstance(self.counts, KVCounts):
            self.counts.remove()
