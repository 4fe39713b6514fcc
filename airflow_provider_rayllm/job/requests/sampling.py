"""Sampling params in vLLM's current form."""

from __future__ import annotations

import json
from typing import Any

# Older names of the structured-output settings, still common in user code and docs.
_GUIDED_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def normalize_sampling_params(params: dict[str, Any]) -> dict[str, Any]:
    """Structured outputs in vLLM's current form, with a JSON schema as text.

    A schema travels as a string so rows with different schemas can share one Arrow column.
    """
    params = dict(params)
    structured = dict(params.pop("structured_outputs", None) or params.pop("guided_decoding", None) or {})
    for old, new in _GUIDED_KEYS.items():
        if old in params:
            structured[new] = params.pop(old)
    if isinstance(structured.get("json"), dict):
        structured["json"] = json.dumps(structured["json"])
    if structured:
        params["structured_outputs"] = structured
    return params
