"""The Ray Data stage that turns the stream's rows into requests."""

from __future__ import annotations

from typing import Any, Callable

from airflow_provider_rayllm.contract.names import REQUEST_KEY_COLUMN
from airflow_provider_rayllm.contract.spec import PromptSpec
from airflow_provider_rayllm.job.requests.ids import IdGate
from airflow_provider_rayllm.job.requests.lora import LoraRouting
from airflow_provider_rayllm.job.requests.prompts import RequestBuilder
from airflow_provider_rayllm.job.stream import KEPT_INPUT, PRE_ERROR, REQUEST


class RequestStage:
    """Ray Data stage: a batch of input rows -> their requests, reported to the job's counts as read.

    With ``id_column`` (or incremental, see ``ids.IdGate``) it also refuses a duplicate or missing id (the uniqueness check, done as the rows
    stream by) and drops the rows an earlier attempt of this run already answered for the same request
    (resume: the request is built first, as its key decides). Holding the ids needs one place that sees
    every row, so with ``id_column`` the stage runs as a single actor; the ids live there, never in the
    driver, and the stage reports the skipped rows' (id, key) pairs to the job's counts for the adoption.
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
        identity: dict[str, Any] | None = None,
        gated: bool = False,
        wire: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ):
        self.builder = RequestBuilder(prompt, task_type, keep, package_dir, lora, identity, wire)
        self.counts = counts
        self.ids = IdGate(prompt.id_column, saved_files or []) if gated or prompt.id_column else None
        if self.ids is not None:
            counts.saved(self.ids.saved_rows)
            counts.unmatched(self.ids.unmatched)
        self.calls: dict[str, int] = {}

    def __call__(self, batch: Any) -> dict[str, list[Any]]:
        from airflow_provider_rayllm.job.progress import call_key

        rows = batch.to_pylist()
        key = call_key(self.calls)
        built = [self.builder(row) for row in rows]
        skipped = 0
        if self.ids is not None:
            asked, reused = self.ids.admit(rows, [b[KEPT_INPUT][REQUEST_KEY_COLUMN] for b in built])
            built, skipped = [built[i] for i in asked], len(reused)
            if reused:
                self.counts.reuse(key, reused)
            self.counts.unmatched(self.ids.unmatched)
        self.counts.read(key, len(rows), skipped)
        return {
            KEPT_INPUT: [b[KEPT_INPUT] for b in built],
            REQUEST: [b[REQUEST] for b in built],
            PRE_ERROR: [b[PRE_ERROR] for b in built],
        }
