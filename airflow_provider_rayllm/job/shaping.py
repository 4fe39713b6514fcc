"""Answered rows -> output rows: each engine's ``Shaper`` (run by the sink, row by row) reads the engine's answer,
and the user's ``postprocess`` when there is one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from airflow_provider_rayllm.contract.names import OUTPUT_TOKENS_IN, OUTPUT_TOKENS_OUT, REQUEST_KEY_COLUMN
from airflow_provider_rayllm.contract.spec import JobSpec
from airflow_provider_rayllm.job.requests.callables import load_callable
from airflow_provider_rayllm.job.stream import ERROR, KEPT_INPUT, to_python


@dataclass
class Shaped:
    output: dict[str, Any] | None
    error: str
    tokens_in: int
    tokens_out: int


class Shaper:
    """An answered row -> the output row: ``{kept input columns, output_column, token counts, request key}``,
    or what the user's ``postprocess`` returns given the engine's view of the row: exactly that, as in the
    guide, but for the request key with ``id_column`` or incremental (saved rows are matched by it)."""

    def __init__(self, spec: JobSpec, package_dir: str):
        self.output_column = spec.prompt.output_column
        self.postprocess_ref = spec.prompt.postprocess
        self.resumable = spec.gated
        self.package_dir = package_dir
        self._postprocess: Callable[[dict], Any] | None = None

    def answer(self, row: dict[str, Any]) -> tuple[Any, int, int, dict[str, Any]]:
        """(value for output_column, tokens in, tokens out, extra output columns)."""
        raise NotImplementedError

    def view(self, row: dict[str, Any], kept: dict[str, Any], value: Any) -> dict[str, Any]:
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
        kept = dict(row.get(KEPT_INPUT) or {})
        key = {REQUEST_KEY_COLUMN: kept.pop(REQUEST_KEY_COLUMN, None)}
        try:
            value, tokens_in, tokens_out, extra = self.answer(row)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            return Shaped(None, f"unreadable answer: {type(exc).__name__}: {exc}", 0, 0)
        user = self.postprocess()
        if user is None:
            output = {
                **kept,
                self.output_column: value,
                **extra,
                OUTPUT_TOKENS_IN: tokens_in,
                OUTPUT_TOKENS_OUT: tokens_out,
                **key,
            }
            return Shaped(output, "", tokens_in, tokens_out)
        try:
            result = user(self.view(row, kept, value))
        except Exception as exc:  # one row's postprocess must not stop the job
            return Shaped(None, f"postprocess: {type(exc).__name__}: {exc}", tokens_in, tokens_out)
        if not isinstance(result, dict):
            return Shaped(None, f"postprocess: returned {type(result).__name__}, not a dict", tokens_in, tokens_out)
        return Shaped({**to_python(result), **(key if self.resumable else {})}, "", tokens_in, tokens_out)
