"""Progress: the stream's stages count into StreamCounts (a retried batch once), the driver prints lines the
operator reads back."""

from __future__ import annotations

import time

import pyarrow as pa
import pytest

from airflow_provider_rayllm.contract.progress import Progress, describe_progress, last_progress, parse_progress
from airflow_provider_rayllm.job import progress


def test_lines_round_trip_and_read_well():
    line = Progress(48, 96, 2, 768, 40.0, 123.45, files_written=3).line()
    assert parse_progress("(MapWorker pid=3) " + line) is None, "only a line that starts with the prefix counts"
    assert last_progress(f"noise\n{Progress(8, 96, 0, 64, 5.0, 12.8).line()}\n{line}\nmore noise") == parse_progress(
        line
    )
    assert describe_progress(parse_progress(line)) == (
        "48/96 rows done (50% of the rows read so far), 2 error row(s), 768 tokens out, 123.5 tokens/s, 3 file(s) written, 40 s"
    )
    assert parse_progress("RAYLLM_PROGRESS {not json") is None
    assert last_progress("no progress yet") is None


def test_the_first_and_last_lines_of_a_short_job_say_something_true():
    """Before any row is read there is no '0/0 rows'; a job whose answers all came within one period shows its
    rate over the whole run, not 0.0 tokens/s."""
    first = describe_progress(parse_progress(Progress(0, 0, 0, 0, 2.0, 0.0).line()))
    assert first == "starting: no input row read yet, 2 s" and "0/0" not in first
    last = describe_progress(parse_progress(Progress(16, 16, 0, 155, 31.0, 0.0).line()))
    assert " 0.0 tokens/s" not in last and f"{155 / 31.0:.1f} tokens/s" in last
    unanswered = describe_progress(parse_progress(Progress(0, 16, 0, 0, 5.0, 0.0).line()))
    assert "tokens/s" not in unanswered and unanswered.startswith("0/16 rows done")


def test_a_key_reported_twice_counts_once():
    counts = progress.StreamCounts()
    counts.read("t1:1", 10, 2)
    counts.read("t1:1", 10, 2)  # the same batch of a retried task
    counts.read("t2:1", 5, 0)
    counts.answered("t3:1", 8, 1, 40, at=100.0)
    counts.answered("t3:1", 8, 1, 40, at=101.0)
    counts.wrote("write-0", 2, at=102.0)
    totals = counts.totals()
    assert (totals["rows_read"], totals["rows_skipped"], totals["rows_answered"], totals["rows_errored"]) == (
        15,
        2,
        8,
        1,
    )
    assert (totals["tokens_out"], totals["files_written"], totals["first_answer_at"]) == (40, 2, 100.0)


def test_the_first_file_keeps_the_rows_answered_when_it_came():
    """The first output file's report keeps the count of that moment: later answers do not move it."""
    counts = progress.StreamCounts()
    counts.answered("a1", 8, 0, 40, at=100.0)
    assert counts.totals()["answered_at_first_write"] is None
    counts.wrote("write-0", 1, at=101.0)
    counts.answered("a2", 8, 0, 40, at=102.0)
    counts.wrote("write-1", 1, at=103.0)
    totals = counts.totals()
    assert totals["rows_answered"] == 16 and totals["answered_at_first_write"] == 8
    assert totals["first_write_at"] == 101.0


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_the_tap_counts_answered_rows_errors_and_tokens_as_they_pass(local_ray):
    import ray

    lines: list[str] = []
    notes: list[str] = []
    table = pa.table(
        {
            "id": list(range(100)),
            "__inference_error__": ["too long" if i % 10 == 3 else "" for i in range(100)],
            "num_generated_tokens": [i % 5 for i in range(100)],
        }
    )
    with progress.ProgressLog(lines.append, notes.append, interval_s=0.05) as watch:
        tap = progress.AnswerCounter(watch.counts, "__inference_error__", progress.column_sum("num_generated_tokens"))
        out = (
            ray.data.from_arrow(table)
            .repartition(target_num_rows_per_block=8)
            .map_batches(tap, batch_format="pyarrow", batch_size=None, num_cpus=0.2)
            .materialize()
        )
        final = watch.finish()
    assert out.count() == 100, "the tap passes every row on"
    assert (final["rows_answered"], final["rows_errored"], final["tokens_out"]) == (
        100,
        10,
        sum(i % 5 for i in range(100)),
    )
    payloads = [parse_progress(line) for line in lines]
    assert all(payloads), lines
    done = [p["rows_done"] for p in payloads]
    assert done == sorted(done) and done[-1] == 100, "progress never goes back and ends complete"


class _Hangs:
    """A stage that stopped answering: each batch takes 45 s (not for ever, so that without the watch the
    test fails instead of hanging)."""

    def __call__(self, batch):
        time.sleep(45)
        return batch


class _Slow:
    """A stage that answers each batch after ``seconds``: slow, but answering."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self, batch):
        time.sleep(self.seconds)
        return batch


def test_a_stream_with_no_answer_for_its_stall_timeout_ends_and_says_so(local_ray):
    import ray

    notes: list[str] = []
    table = pa.table({"id": list(range(16)), "__inference_error__": [""] * 16, "num_generated_tokens": [1] * 16})
    with progress.ProgressLog(lambda line: None, notes.append, interval_s=10, stall_timeout_s=2) as watch:
        tap = progress.AnswerCounter(watch.counts, "__inference_error__", progress.column_sum("num_generated_tokens"))
        started = time.monotonic()
        with pytest.raises(progress.StreamStalled) as stalled:
            with watch.stoppable():
                ray.data.from_arrow(table).repartition(target_num_rows_per_block=4).map_batches(
                    _Hangs, batch_format="pyarrow", batch_size=None, num_cpus=0.2, concurrency=1
                ).map_batches(tap, batch_format="pyarrow", batch_size=None, num_cpus=0.2).materialize()
        seconds = time.monotonic() - started
    assert 2 <= seconds < 30, f"ended after {seconds:.1f} s"
    assert "no row answered for" in str(stalled.value) and "stall_timeout_s=2" in str(stalled.value)
    assert "after 0 row(s)" in str(stalled.value)
    assert any("stall_timeout_s=2" in note for note in notes), "the job log says why it ended"


def test_a_slow_stream_that_keeps_answering_is_not_a_stall(local_ray):
    import ray

    rows = 40
    table = pa.table({"id": list(range(rows)), "__inference_error__": [""] * rows, "num_generated_tokens": [1] * rows})
    # Ten batches of 3.5 s: the stream outlasts the 30 s limit, and no gap between answers comes near it, the
    # first included (the stage's actor and the counting task's worker start in it: over 10 s on a loaded CI).
    with progress.ProgressLog(lambda line: None, lambda note: None, stall_timeout_s=30) as watch:
        tap = progress.AnswerCounter(watch.counts, "__inference_error__", progress.column_sum("num_generated_tokens"))
        with watch.stoppable():
            out = (
                ray.data.from_arrow(table)
                .repartition(target_num_rows_per_block=4)
                .map_batches(
                    _Slow,
                    fn_constructor_args=(3.5,),
                    batch_format="pyarrow",
                    batch_size=None,
                    num_cpus=0.2,
                    concurrency=1,
                )
                .map_batches(tap, batch_format="pyarrow", batch_size=None, num_cpus=0.2)
                .materialize()
            )
        final = watch.finish()
    assert out.count() == rows and final["rows_answered"] == rows and watch.stalled is None


class _Resent:
    """A stage that reports each batch twice under one key, as a retried task would."""

    def __init__(self, counts):
        self.counts, self.calls = counts, {}

    def __call__(self, batch):
        key = progress.call_key(self.calls)
        for _ in range(2):
            self.counts.read(key, batch.num_rows, 1)
        return batch


def test_the_stages_reports_are_read_back_once_each_and_removed_when_the_stream_ends(local_ray):
    """Without a budget the stages report into Ray's key-value store under the job's prefix (no actor): each
    report's key counted once however often it came, and nothing of the job's left there after it."""
    import ray
    from ray.experimental.internal_kv import _internal_kv_list

    table = pa.table({"id": list(range(40)), "__inference_error__": [""] * 40, "num_generated_tokens": [2] * 40})
    with progress.ProgressLog(lambda line: None, lambda note: None) as watch:
        assert isinstance(watch.counts, progress.KVCounts)
        tap = progress.AnswerCounter(watch.counts, "__inference_error__", progress.column_sum("num_generated_tokens"))
        ray.data.from_arrow(table).repartition(target_num_rows_per_block=8).map_batches(
            _Resent, fn_constructor_args=(watch.counts,), batch_format="pyarrow", batch_size=None, num_cpus=0.2
        ).map_batches(tap, batch_format="pyarrow", batch_size=None, num_cpus=0.2).materialize()
        watch.counts.wrote("write-0", 2, time.time())
        final = watch.finish()
        assert _internal_kv_list(watch.counts.prefix, namespace=progress.COUNTS_NAMESPACE)
    assert (final["rows_read"], final["rows_skipped"], final["rows_answered"], final["tokens_out"]) == (40, 5, 40, 80)
    assert final["files_written"] == 2 and final["answered_at_first_write"] == 40
    assert _internal_kv_list(watch.counts.prefix, namespace=progress.COUNTS_NAMESPACE) == []


def test_a_budget_gets_the_jobs_totals_with_each_answer_and_stops_the_stream(local_ray):
    """With a budget the counts go to an actor whose answer is the job's totals: the run stops within a
    batch of passing it."""
    import ray

    from airflow_provider_rayllm.job.budget import Budget, BudgetExceeded, Prices

    table = pa.table({"id": list(range(64)), "__inference_error__": [""] * 64, "num_generated_tokens": [1] * 64})
    budget = Budget(max_tokens=20, max_cost=None, prices=Prices())
    with progress.ProgressLog(lambda line: None, lambda note: None, totals_per_answer=True) as watch:
        assert isinstance(watch.counts, progress.ActorCounts)
        tap = progress.AnswerCounter(
            watch.counts, "__inference_error__", progress.column_sum("num_generated_tokens"), budget=budget
        )
        with pytest.raises(Exception) as stopped:
            ray.data.from_arrow(table).repartition(target_num_rows_per_block=8).map_batches(
                tap, batch_format="pyarrow", batch_size=None, num_cpus=0.2, concurrency=1
            ).materialize()
        answered = watch.finish()["rows_answered"]
    assert "passed max_tokens_budget=20" in str(stopped.value), stopped.value
    assert isinstance(stopped.value, BudgetExceeded) or "BudgetExceeded" in str(stopped.value)
    assert answered == 24, "the third batch of 8 passed 20 tokens and stopped the run"
    with pytest.raises(RuntimeError, match="budget needs the job's totals"):
        progress.AnswerCounter(progress.KVCounts("unused/"), "e", progress.column_sum("n"), budget=budget)(
            pa.table({"e": [""], "n": [1]})
        )
