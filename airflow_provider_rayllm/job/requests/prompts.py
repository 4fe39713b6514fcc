"""One row -> its request: a template or a prompt column, chat messages, an image, or the user's preprocess."""

from __future__ import annotations

import json
from typing import Any, Callable

from airflow_provider_rayllm.contract.names import REQUEST_KEY_COLUMN
from airflow_provider_rayllm.contract.spec import PromptSpec
from airflow_provider_rayllm.job.requests.callables import load_callable
from airflow_provider_rayllm.job.requests.images import guide_image_parts, image_data_url, image_url, is_image
from airflow_provider_rayllm.job.requests.keys import request_key, whole_row_key
from airflow_provider_rayllm.job.requests.lora import LoraRouting
from airflow_provider_rayllm.job.requests.sampling import normalize_sampling_params
from airflow_provider_rayllm.job.stream import KEPT_INPUT, PRE_ERROR, REQUEST, is_empty


def _jsonable(value: Any) -> Any:
    """Numpy values from Arrow rows become plain Python for the JSON request, and images data: URLs."""
    if is_image(value):
        return image_data_url(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


class RequestBuilder:
    """Row -> {kept input columns and the request's key, request JSON, error}. A row that cannot be turned
    into a request becomes an error row (with no key: it has no request)."""

    def __init__(
        self,
        prompt: PromptSpec,
        task_type: str,
        keep: list[str],
        package_dir: str,
        lora: LoraRouting | None = None,
        identity: dict[str, Any] | None = None,
        wire: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ):
        self.prompt = prompt
        self.wire = wire
        self.task_type = task_type
        self.keep = keep
        self.lora = lora
        self.identity = identity or {"task_type": task_type}
        self.preprocess = load_callable(prompt.preprocess, package_dir) if prompt.preprocess else None
        self.sampling_params = normalize_sampling_params(prompt.sampling_params)
        self.pooling_params = dict(prompt.pooling_params) if prompt.pooling_params else None

    def _text(self, row: dict[str, Any]) -> str:
        p = self.prompt
        if p.prompt_column is not None:
            value = row.get(p.prompt_column)
            if is_empty(value):
                raise ValueError(f"column {p.prompt_column!r} is empty")
            if isinstance(value, (bytes, bytearray)):
                try:
                    return bytes(value).decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise ValueError(
                        f"column {p.prompt_column!r} holds bytes that are not UTF-8 text ({bytes(value)[:40]!r}: "
                        f"{exc.reason} at offset {exc.start}); re-encode the input as UTF-8"
                    ) from None
            if not isinstance(value, str):
                raise ValueError(f"column {p.prompt_column!r} holds {type(value).__name__}, not text")
            return value
        assert p.template is not None
        missing = [c for c in p.template_columns() if is_empty(row.get(c))]
        if missing:
            raise ValueError(f"template column(s) {missing!r} are empty")
        return p.template.format(**row)

    def request(self, row: dict[str, Any]) -> dict[str, Any]:
        p = self.prompt
        if self.preprocess is not None:
            request = self.preprocess(dict(row))
            if not isinstance(request, dict):
                raise ValueError(f"preprocess returned {type(request).__name__}, not a dict")
            if isinstance(request.get("sampling_params"), dict):
                request["sampling_params"] = normalize_sampling_params(request["sampling_params"])
            guide_image_parts(request)
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
                text = self._text(row)
                if p.image_column is not None:
                    url = image_url(
                        row.get(p.image_column),
                        p.image_max_bytes,
                        p.image_allow_private_hosts,
                        p.image_path_prefixes if p.image_path_prefixes is not None else [],
                    )
                    messages.append(
                        {
                            "role": "user",
                            "content": [
                                {"type": "image_url", "image_url": {"url": url}},
                                {"type": "text", "text": text},
                            ],
                        }
                    )
                else:
                    messages.append({"role": "user", "content": text})
            request["messages"] = messages
            request["sampling_params"] = self.sampling_params
        else:
            request["prompt"] = self._text(row)
            if self.pooling_params:
                request["pooling_params"] = self.pooling_params
        return request

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        kept = {name: row.get(name) for name in self.keep}
        try:
            body = self.request(row)
            if self.lora is not None:
                body["model"] = self.lora.model_for(row.get(self.prompt.lora_column or ""))
            body = _jsonable(body)
            request = json.dumps(self.wire(body) if self.wire is not None else body)
            key = (
                whole_row_key(self.identity, body, kept)
                if self.identity.get("whole_row")
                else request_key(self.identity, body)
            )
            error = ""
        except Exception as exc:  # one bad row must not stop the job
            request, key, error = "{}", None, f"prompt: {type(exc).__name__}: {exc}"
        # Inside the kept columns, the key travels through every engine untouched, as they do.
        kept[REQUEST_KEY_COLUMN] = key
        return {KEPT_INPUT: kept, REQUEST: request, PRE_ERROR: error}
