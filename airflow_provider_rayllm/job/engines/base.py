"""What every engine gives the driver: checks before anything starts, one lazy step over the stream, and
the shaper that turns an answered row into an output row (``job.shaping``, run by the sink, row by row)."""

from __future__ import annotations

from typing import Any, Callable

from airflow_provider_rayllm.contract.spec import JobSpec
from airflow_provider_rayllm.job.budget import Prices
from airflow_provider_rayllm.job.progress import AnswerCounter
from airflow_provider_rayllm.job.shaping import Shaper
from airflow_provider_rayllm.job.stream import light_tasks


class Engine:
    """One way of answering requests (a vLLM engine, an HTTP endpoint, a Serve deployment)."""

    def __init__(self, spec: JobSpec, package_dir: str):
        self.spec, self.package_dir = spec, package_dir

    def check(self) -> None:
        """Everything that can be judged before an engine starts or a request is sent."""

    def describe(self) -> str:
        raise NotImplementedError

    def lora(self) -> Any:
        return None

    def wire_body(self) -> Callable[[dict[str, Any]], dict[str, Any]] | None:
        """Our request -> the body the engine sends, applied in the request step (which runs beside the engine,
        in task processes of its own), so the engine's stage does no JSON work of its own per row; None: the
        request as it is."""
        return None

    def apply(self, ds: Any) -> Any:
        """Requests (``KEPT_INPUT``, ``REQUEST``, ``PRE_ERROR``) -> answered rows (``KEPT_INPUT``, ``ERROR``, answers)."""
        raise NotImplementedError

    def answer(self, ds: Any, tap: AnswerCounter) -> Any:
        """``apply``, each answered batch counted (and held to the budgets) by ``tap`` as it leaves the engine:
        a light task stage after it, as many at once as the engine has replicas (answers come from no more
        places than that; the engine's own light last step, such as Ray's postprocess, fuses with it)."""
        return self.apply(ds).map_batches(
            tap, batch_format="pyarrow", batch_size=None, zero_copy_batch=True, **light_tasks(self.replicas())
        )

    def shaper(self) -> Shaper:
        raise NotImplementedError

    def block_rows(self) -> int:
        """Rows per block into the engine: one batch, so answers leave as each batch finishes."""
        raise NotImplementedError

    def tokens_out(self) -> Callable[[Any], int]:
        """Output tokens of a batch of answered rows (a pyarrow table), for the progress line."""
        raise NotImplementedError

    def tokens_in(self) -> Callable[[Any], int] | None:
        """Input tokens of a batch of answered rows, for the budgets; None where the answers do not say."""
        return None

    def prices(self) -> Prices:
        """How the run's estimated cost grows as it runs (for ``max_cost``); nothing without a price."""
        return Prices()

    def actor_name(self) -> str:
        """Part of the class name of the engine's Ray actors (their start is the engine's start)."""
        raise NotImplementedError

    def reserved_cpus(self) -> float:
        """CPUs the engine's actors hold for the whole job."""
        raise NotImplementedError

    def replicas(self) -> int:
        """The most engine actors the job runs at once: answered batches come from at most this many places."""
        raise NotImplementedError

    def details(self, totals: dict[str, Any]) -> dict[str, Any]:
        return {}

    def versions(self) -> dict[str, str]:
        return {}
