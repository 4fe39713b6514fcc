"""Turning an input row into an engine request, declaratively or with the user's callable."""

from __future__ import annotations

import importlib
import json
import math
import os
from typing import Any, Callable

from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.spec import CallableRef, PromptSpec

# Columns the job carries through Ray's stages; input columns are stashed so the engine's own
# output columns (``prompt``, ``messages``...) cannot overwrite them.
STASH = "__rayllm_in"
REQUEST = "__rayllm_request"
PRE_ERROR = "__rayllm_pre_error"


def load_callable(ref: CallableRef, package_dir: str) -> Callable[[dict], dict]:
    if ref.import_path:
        module_name, _, attr = ref.import_path.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise JobError(f"cannot import callable {ref.import_path!r} on the cluster: {exc}") from exc
        return obj
    import cloudpickle

    path = os.path.join(package_dir, str(ref.pickled))
    try:
        with open(path, "rb") as handle:
            return cloudpickle.load(handle)
    except Exception as exc:
        raise JobError(
            f"cannot load the pickled callable {ref.pickled!r}: {exc}. Callables pickled by the Airflow "
            "worker need the same Python version and the modules they use on the cluster"
        ) from exc


def _is_empty(value: Any) -> bool:
    # A JSON null or an empty CSV cell can arrive as None or as NaN, depending on the reader.
    return value is None or (isinstance(value, float) and math.isnan(value))


def _jsonable(value: Any) -> Any:
    """Numpy values from Arrow rows become plain Python for the JSON request."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


class RequestBuilder:
    """Row -> {stash, request JSON, error}. A row that cannot be turned into a request becomes an error row."""

    def __init__(self, prompt: PromptSpec, task_type: str, keep: list[str], package_dir: str):
        self.prompt = prompt
        self.task_type = task_type
        self.keep = keep
        self.preprocess = load_callable(prompt.preprocess, package_dir) if prompt.preprocess else None

    def _text(self, row: dict[str, Any]) -> str:
        p = self.prompt
        if p.prompt_column is not None:
            value = row.get(p.prompt_column)
            if _is_empty(value):
                raise ValueError(f"column {p.prompt_column!r} is empty")
            if not isinstance(value, str):
                raise ValueError(f"column {p.prompt_column!r} holds {type(value).__name__}, not text")
            return value
        assert p.template is not None
        missing = [c for c in p.template_columns() if _is_empty(row.get(c))]
        if missing:
            raise ValueError(f"template column(s) {missing!r} are empty")
        return p.template.format(**row)

    def request(self, row: dict[str, Any]) -> dict[str, Any]:
        p = self.prompt
        if self.preprocess is not None:
            request = self.preprocess(dict(row))
            if not isinstance(request, dict):
                raise ValueError(f"preprocess returned {type(request).__name__}, not a dict")
            return request
        request: dict[str, Any] = {}
        if self.task_type == "generate":
            if p.messages_column is not None:
                messages = _jsonable(row.get(p.messages_column))
                if not isinstance(messages, list) or not messages:
                    raise ValueError(f"column {p.messages_column!r} holds no chat messages")
            else:
                messages = []
                if p.system_prompt:
                    messages.append({"role": "system", "content": p.system_prompt})
                messages.append({"role": "user", "content": self._text(row)})
            request["messages"] = messages
            request["sampling_params"] = dict(p.sampling_params)
        else:
            request["prompt"] = self._text(row)
            if p.pooling_params:
                request["pooling_params"] = dict(p.pooling_params)
        return request

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        stash = {name: row.get(name) for name in self.keep}
        try:
            request = json.dumps(_jsonable(self.request(row)))
            error = ""
        except Exception as exc:  # one bad row must not stop the job
            request, error = "{}", f"prompt: {type(exc).__name__}: {exc}"
        return {STASH: stash, REQUEST: request, PRE_ERROR: error}


def engine_request(row: dict[str, Any]) -> dict[str, Any]:
    """Ray's preprocess: unpack the request built above."""
    return json.loads(row[REQUEST])
