"""Request keys: a short hash of everything that decides a row's answer, written beside the row.

The key covers the request as rendered (the prompt or chat messages after the template, the system prompt
and any image, the sampling or pooling params, a LoRA adapter's name) and what the spec says about the
model that answers it (the engine's kind, the model or the endpoint's model name, the endpoint, the task
type) and the code that shapes it (the preprocess and postprocess callables, by their source's digest or
import path). An earlier attempt's or the incremental base's saved answer is reused only for a row whose
id and key both match (see ``ids``): a row whose text, prompt, model, sampling or code changed is asked
again. Incremental without an id column keys the whole row (``whole_row_key``): the output row a reused
answer brings back then holds exactly the input row's columns.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from airflow_provider_rayllm.contract.spec import JobSpec

# Hex digits kept of the sha256: 128 bits, far from any chance collision at any table's size.
KEY_CHARS = 32


def request_identity(spec: JobSpec) -> dict[str, Any]:
    """The spec's part of every key: who answers and how (not where: an endpoint's URL may carry a secret
    and a moved endpoint serving the same model answers the same)."""
    identity: dict[str, Any] = {"kind": spec.kind, "model": spec.model_name, "task_type": spec.task_type}
    if spec.http is not None:
        identity["endpoint"] = spec.http.endpoint
    if spec.serve is not None:
        identity.update(endpoint=spec.serve.endpoint, deployment=spec.serve.deployment_name, app=spec.serve.app_name)
    for name in ("preprocess", "postprocess"):
        ref = getattr(spec.prompt, name)
        if ref is not None:
            identity[name] = ref.digest or ref.import_path or ref.pickled
    if spec.is_incremental and spec.prompt.id_column is None:
        identity["whole_row"] = True
    return identity


def request_key(identity: dict[str, Any], request: dict[str, Any]) -> str:
    """The key of one request (the JSON-ready body the engine is sent), under the spec's identity. Keys
    are canonical JSON hashed, so the order of a dict's keys (a preprocess's output) does not matter."""
    text = json.dumps([identity, request], sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:KEY_CHARS]


def whole_row_key(identity: dict[str, Any], request: dict[str, Any], kept: dict[str, Any]) -> str:
    """The key of a request together with the input columns its output row keeps (incremental without
    ``id_column``: the key is the row's id too)."""
    return request_key(identity, {"request": request, "row": kept})
