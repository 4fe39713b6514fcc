"""Requests that share a long prompt prefix, put next to each other before batching, so an engine's prefix
cache hits (a system prompt with few-shot examples, or one document asked many questions).

The stream stays a stream: rows are grouped inside a window of ``prefix_window_rows`` rows (one Ray Data batch),
never across the whole input (a global sort would be an all-to-all barrier that reads everything first). The
window comes before the repartition into engine-sized blocks, which cuts it in order: a group fills
consecutive blocks, so an engine batch holds one prefix's rows except where one group ends and the next
begins, and a replica that takes a block computes its prefix once for the block's rows.

A request's prefix: its model (a LoRA adapter's cache is its own), every chat message but the last, and the
last message's leading text up to and including its last blank line (``"\\n\\n"``); for a prompt, the
prompt's text up to its last blank line. So ``"{document}\\n\\nQuestion: {question}"`` groups by document,
and a system prompt before one user message groups by the system prompt. A request with neither
(a preprocess's own shape) keeps its place.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from airflow_provider_rayllm.job.stream import REQUEST

BOUNDARY = "\n\n"
# Rows grouped at once when the task does not say: a few thousand rows of a few kB each stay small in the
# object store, and cover 64 questions to each of 32 documents read in any order.
DEFAULT_WINDOW_ROWS = 2048


def window_rows(setting: int | None, task_type: str, images: bool = False) -> int:
    """The window in effect: the task's; else the default for generation without image_column (pooling tasks
    run no prefix cache, so grouping buys them nothing; an image_column row carries its image in its request,
    up to image_max_bytes, so a window of thousands could hold gigabytes); 0 is off."""
    if setting is not None:
        return setting
    return DEFAULT_WINDOW_ROWS if task_type == "generate" and not images else 0


def leading(text: str) -> str:
    """The text up to and including its last blank line ("" when it has none)."""
    end = text.rfind(BOUNDARY)
    return text[: end + len(BOUNDARY)] if end >= 0 else ""


def _last_content_lead(content: Any) -> Any:
    if isinstance(content, str):
        return leading(content)
    if isinstance(content, list) and content:
        last = content[-1]
        tail = leading(last.get("text", "")) if isinstance(last, dict) and last.get("type") == "text" else ""
        return [*content[:-1], tail]
    return ""


def prefix_key(request_json: str) -> str | None:
    """A short hash of a request's prefix (see the module's docstring); None when it has no prompt we know."""
    try:
        request = json.loads(request_json)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    body = request.get("payload") if isinstance(request.get("payload"), dict) else request
    model = body.get("model", request.get("model"))
    messages, prompt = body.get("messages"), body.get("prompt")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        last = messages[-1]
        parts: Any = [model, messages[:-1], last.get("role"), _last_content_lead(last.get("content"))]
    elif isinstance(prompt, str):
        parts = [model, leading(prompt)]
    else:
        return None
    text = json.dumps(parts, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.blake2b(text.encode("utf-8"), digest_size=8).hexdigest()


def grouped_order(keys: list[str | None]) -> list[int]:
    """Row positions with each key's rows together, groups in the order their first row came, rows of a
    group in their own order; a row without a key keeps its place among the groups."""
    groups: dict[Any, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key if key is not None else ("row", i), []).append(i)
    return [i for rows in groups.values() for i in rows]


class PrefixGrouping:
    """Ray Data stage: a window of requests -> the same rows (every column), same-prefix rows together."""

    def __call__(self, batch: Any) -> Any:
        keys = [prefix_key(r) for r in batch.column(REQUEST).to_pylist()]
        return batch.take(grouped_order(keys))
