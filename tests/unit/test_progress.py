"""Progress lines: counted per finished batch on a real (in-process) Ray, read back by the operator side."""

from __future__ import annotations

import numpy as np
import pytest

from airflow_provider_rayllm.job import progress


def test_blocks_are_whole_batches_and_at_most_max_blocks():
    assert progress.rows_per_block(96, 8) == 8
    assert progress.rows_per_block(5, 16) == 16
    per_block = progress.rows_per_block(1_000_000, 64)
    assert per_block % 64 == 0 and -(-1_000_000 // per_block) <= progress.MAX_BLOCKS


def test_lines_round_trip_and_read_well():
    line = progress.Progress(48, 96, 2, 768, 40.0, 123.45).line()
    assert progress.parse("(MapWorker pid=3) " + line) is None, "only a line that starts with the prefix counts"
    assert progress.last_in(f"noise\n{progress.Progress(8, 96, 0, 64, 5.0, 12.8).line()}\n{line}\nmore noise") == progress.parse(line)
    assert progress.describe(progress.parse(line)) == "48/96 rows done (50%), 2 error row(s), 768 tokens out, 123.5 tokens/s, 40 s"
    assert progress.parse("RAYLLM_PROGRESS {not json") is None
    assert progress.last_in("no progress yet") is None


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_every_finished_row_is_counted_with_its_tokens_and_errors(local_ray):
    import ray

    lines: list[str] = []

    def engine(ds):
        def answer(batch):
            ids = batch["id"]
            return {
                "id": ids,
                "num_generated_tokens": ids % 5,
                "err": np.array(["too long" if i % 10 == 3 else "" for i in ids]),
            }

        return ds.map_batches(answer, batch_format="numpy", batch_size=8, num_cpus=0.2)

    rows = ray.data.range(100).materialize()
    with progress.ProgressLog(100, lines.append, interval_s=0.05) as watch:
        out = progress.watched(
            rows, 100, 8, engine, watch, "err", "num_generated_tokens", None, {"num_cpus": 0.2}
        ).materialize()
    assert out.count() == 100
    payloads = [progress.parse(line) for line in lines]
    assert all(payloads), lines
    final = payloads[-1]
    expected_tokens = sum(i % 5 for i in range(100) if i % 10 != 3)
    assert (final["rows_done"], final["rows_total"], final["rows_errored"], final["tokens_out"]) == (100, 100, 10, expected_tokens)
    done = [p["rows_done"] for p in payloads]
    assert done == sorted(done), "progress never goes back"
