"""The Ray Data stage that turns the stream's rows into requests."""

from __future__ import annotations

from typing import Any

from airflow_provider_rayllm.contract.spec import PromptSpec
from airflow_provider_rayllm.job.requests.ids import IdGate
from airflow_provider_rayllm.job.requests.lora import LoraRouting
from airflow_provider_rayllm.job.requests.prompts import RequestBuilder
from airflow_provider_rayllm.job.stream import KEPT_INPUT, PRE_ERROR, REQUEST


class RequestStage:
    """Ray Data stage: a batch of input rows -> their requests, counted into the job's ``StreamCounts`` as read.

    With ``id_column`` it also refuses a duplicate or missing id (the uniqueness check, done as the rows
    stream by) and drops the rows an earlier attempt of this run already answered (resume). Holding the
    ids needs one place that sees every row, so with ``id_column`` the stage runs as a single actor; the
    ids live there, never in the driver.
    """

    def __init__(
        self,
        prompt: PromptSpec,
        task_type: str,
        keep: list[str],
        package_dir: str,
        counts: Any,
        lora: LoraRouting | None = None,
        saved_files: list[str] | None = None,
    ):
        self.builder = RequestBuilder(prompt, task_type, keep, package_dir, lora)
        self.counts = counts
        self.ids = IdGate(prompt.id_column, saved_files or [], counts) if prompt.id_column else None
        self.calls: dict[str, int] = {}

    def __call__(self, batch: Any) -> dict[str, list[Any]]:
        rows = batch.to_pylist()
        from airflow_provider_rayllm.job.progress import call_key

        key = call_key(self.calls)
        if self.ids is not None:
            rows, skipped = self.ids.admit(rows)
        else:
            skipped = 0
        built = [self.builder(row) for row in rows]
        import ray

        ray.get(self.counts.read.remote(key, len(rows) + skipped, skipped))
        return {
            KEPT_INPUT: [b[KEPT_INPUT] for b in built],
            REQUEST: [b[REQUEST] for b in built],
            PRE_ERROR: [b[PRE_ERROR] for b in built],
        }
