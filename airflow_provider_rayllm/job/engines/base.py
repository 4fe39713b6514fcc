"""What every engine gives the driver: checks before anything starts, one lazy step over the stream, and
the shaper that turns an answered row into an output row (run by the sink, row by row)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from airflow_provider_rayllm.contract.names import OUTPUT_TOKENS_IN, OUTPUT_TOKENS_OUT
from airflow_provider_rayllm.contract.spec import JobSpec
from airflow_provider_rayllm.job.requests.callables import load_callable
from airflow_provider_rayllm.job.stream import STASH

# Ray's own column for a row that failed (its engine stages pass such rows through untouched); our
# request step and our HTTP callers use it too, so every engine's failed rows look alike.
ERROR = "__inference_error__"
# Our light stages (requests, callers, writes) take a fifth of a CPU: at a whole CPU each they would wait
# behind the engine's stage actors on a small cluster, and deadlock a 2-core one.
LIGHT: dict[str, Any] = {"num_cpus": 0.2}


@dataclass
class Shaped:
    output: dict[str, Any] | None
    error: str
    tokens_in: int
    tokens_out: int


def count(value: Any) -> int:
    """A token count from a row (None or NaN where a row has none) as an int."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return 0
    return int(number) if math.isfinite(number) else 0


def plain(value: Any) -> Any:
    """numpy values (what Ray's blocks hold) as plain Python, for files and user code."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


class Shaper:
    """An answered row -> the output row: ``{kept input columns, output_column, token counts}``, or what
    the user's ``postprocess`` returns (exactly that) given the engine's view of the row."""

    def __init__(self, spec: JobSpec, package_dir: str):
        self.output_column = spec.prompt.output_column
        self.postprocess_ref = spec.prompt.postprocess
        self.package_dir = package_dir
        self._postprocess: Callable[[dict], Any] | None = None

    def answer(self, row: dict[str, Any]) -> tuple[Any, int, int, dict[str, Any]]:
        """(value for output_column, tokens in, tokens out, extra output columns)."""
        raise NotImplementedError

    def view(self, row: dict[str, Any], stash: dict[str, Any], value: Any) -> dict[str, Any]:
        """What the user's postprocess sees: the engine's fields, as the guide names them, and the input."""
        raise NotImplementedError

    def postprocess(self) -> Callable[[dict], Any] | None:
        if self.postprocess_ref is not None and self._postprocess is None:
            self._postprocess = load_callable(self.postprocess_ref, self.package_dir)
        return self._postprocess

    def shape(self, row: dict[str, Any]) -> Shaped:
        error = row.get(ERROR) or ""
        if error:
            return Shaped(None, str(error), 0, 0)
        stash = dict(row.get(STASH) or {})
        try:
            value, tokens_in, tokens_out, extra = self.answer(row)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            return Shaped(None, f"unreadable answer: {type(exc).__name__}: {exc}", 0, 0)
        user = self.postprocess()
        if user is None:
            output = {
                **stash,
                self.output_column: value,
                **extra,
                OUTPUT_TOKENS_IN: tokens_in,
                OUTPUT_TOKENS_OUT: tokens_out,
            }
            return Shaped(output, "", tokens_in, tokens_out)
        try:
            result = user(self.view(row, stash, value))
        except Exception as exc:  # one row's postprocess must not stop the job
            return Shaped(None, f"postprocess: {type(exc).__name__}: {exc}", tokens_in, tokens_out)
        if not isinstance(result, dict):
            return Shaped(None, f"postprocess: returned {type(result).__name__}, not a dict", tokens_in, tokens_out)
        return Shaped(plain(result), "", tokens_in, tokens_out)


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

    def apply(self, ds: Any) -> Any:
        """Requests (``STASH``, ``REQUEST``, ``PRE_ERROR``) -> answered rows (``STASH``, ``ERROR``, answers)."""
        raise NotImplementedError

    def shaper(self) -> Shaper:
        raise NotImplementedError

    def block_rows(self) -> int:
        """Rows per block into the engine: one batch, so answers leave as each batch finishes."""
        raise NotImplementedError

    def tokens_out(self) -> Callable[[Any], int]:
        """Output tokens of a batch of answered rows (a pyarrow table), for the progress line."""
        raise NotImplementedError

    def actor_name(self) -> str:
        """Part of the class name of the engine's Ray actors (their start is the engine's start)."""
        raise NotImplementedError

    def reserved_cpus(self) -> float:
        """CPUs the engine's actors hold for the whole job."""
        raise NotImplementedError

    def details(self, totals: dict[str, Any]) -> dict[str, Any]:
        return {}

    def versions(self) -> dict[str, str]:
        return {}
