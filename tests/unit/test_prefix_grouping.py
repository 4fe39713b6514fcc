"""Prefix grouping (job/requests/prefix.py): which requests share a prefix, and the order a window leaves in."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from airflow_provider_rayllm.job.requests.prefix import PrefixGrouping, grouped_order, prefix_key, window_rows
from airflow_provider_rayllm.job.stream import KEPT_INPUT, REQUEST


def chat(*contents: str, system: str | None = None, model: str | None = None) -> str:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": c} for c in contents
    ]
    return json.dumps(
        {"messages": messages, "sampling_params": {"max_tokens": 8}, **({"model": model} if model else {})}
    )


DOC_A, DOC_B = "Document A.\n\nIt has two paragraphs.", "Document B."


@pytest.mark.parametrize(
    "left, right, same",
    [
        # A document asked two questions: the text up to the last blank line is the prefix.
        (chat(f"{DOC_A}\n\nQuestion: who?"), chat(f"{DOC_A}\n\nQuestion: why?"), True),
        (chat(f"{DOC_A}\n\nQuestion: who?"), chat(f"{DOC_B}\n\nQuestion: who?"), False),
        # One system prompt (few-shot examples) before one user message each: grouped by the system prompt.
        (chat("What is 2+2?", system="Answer briefly."), chat("Name a river.", system="Answer briefly."), True),
        (chat("What is 2+2?", system="Answer briefly."), chat("What is 2+2?", system="Answer at length."), False),
        # Earlier turns are prefix; the last message without a blank line adds nothing to it.
        (chat("Hi", "Tell me more"), chat("Hi", "Something else"), True),
        (chat("Hi", "Tell me more"), chat("Hello", "Tell me more"), False),
        # A LoRA adapter's cache is its own.
        (chat(f"{DOC_A}\n\nQ1", model="a"), chat(f"{DOC_A}\n\nQ2", model="b"), False),
        # Prompts (completions, embeddings) and the guide's HTTP payload.
        (json.dumps({"prompt": f"{DOC_A}\n\nQ1"}), json.dumps({"prompt": f"{DOC_A}\n\nQ2"}), True),
        (json.dumps({"prompt": f"{DOC_A}\n\nQ1"}), json.dumps({"prompt": f"{DOC_B}\n\nQ1"}), False),
        (
            json.dumps({"payload": {"messages": [{"role": "user", "content": f"{DOC_B}\n\nQ1"}]}}),
            json.dumps({"payload": {"messages": [{"role": "user", "content": f"{DOC_B}\n\nQ2"}]}}),
            True,
        ),
    ],
)
def test_which_requests_share_a_prefix(left, right, same):
    assert prefix_key(left) is not None and prefix_key(right) is not None
    assert (prefix_key(left) == prefix_key(right)) is same


def test_an_image_part_is_prefix_and_the_last_texts_lead_too():
    def vlm(image: str, text: str) -> str:
        content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": text}]
        return json.dumps({"messages": [{"role": "user", "content": content}]})

    assert prefix_key(vlm("data:1", "Describe.\n\nQ1")) == prefix_key(vlm("data:1", "Describe.\n\nQ2"))
    assert prefix_key(vlm("data:1", "Describe.\n\nQ1")) != prefix_key(vlm("data:2", "Describe.\n\nQ1"))


@pytest.mark.parametrize("request_json", ["{}", "not json", "[1, 2]", json.dumps({"custom": "shape"})])
def test_a_request_without_a_known_prompt_has_no_prefix(request_json):
    assert prefix_key(request_json) is None


@pytest.mark.parametrize(
    "keys, order",
    [
        ([], []),
        (["a", "b", "a", "b"], [0, 2, 1, 3]),
        (["a", "b", "c", "a", "b", "c"], [0, 3, 1, 4, 2, 5]),
        (["a", "a", "b", "b"], [0, 1, 2, 3]),  # already grouped: unchanged
        (["x", "x", "x"], [0, 1, 2]),  # one prefix: unchanged
        ([None, "a", None, "a"], [0, 1, 3, 2]),  # no key: its own place among the groups
    ],
)
def test_grouped_order(keys, order):
    assert grouped_order(keys) == order


@pytest.mark.parametrize(
    "setting, task_type, images, rows",
    [
        (None, "generate", False, 2048),
        (None, "embed", False, 0),
        (None, "classify", False, 0),
        (None, "generate", True, 0),  # each row carries its image: no default window of thousands
        (0, "generate", False, 0),
        (64, "embed", False, 64),
        (16, "generate", True, 16),
    ],
)
def test_the_window_in_effect(setting, task_type, images, rows):
    assert window_rows(setting, task_type, images) == rows


def test_the_stage_keeps_every_row_and_column_and_puts_each_documents_rows_together():
    docs = [f"Document {d}." for d in range(3)]
    rows = [(d, q) for q in range(4) for d in range(3)]  # question-major: the documents interleaved
    batch = pa.table(
        {
            KEPT_INPUT: [{"id": i, "doc": d} for i, (d, _) in enumerate(rows)],
            REQUEST: [chat(f"{docs[d]}\n\nQuestion {q}?") for d, q in rows],
            "__rayllm_pre_error": [""] * len(rows),
        }
    )
    out = PrefixGrouping()(batch)
    assert out.column_names == batch.column_names
    kept = out.column(KEPT_INPUT).to_pylist()
    assert sorted(k["id"] for k in kept) == list(range(len(rows)))
    assert [k["doc"] for k in kept] == [0] * 4 + [1] * 4 + [2] * 4
    # Each row still carries its own request.
    assert all(f"Document {k['doc']}." in r for k, r in zip(kept, out.column(REQUEST).to_pylist()))
