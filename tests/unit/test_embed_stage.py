"""The embeddings stage's batch logic around vLLM's ``LLM.embed``: which rows reach it, how a refused row is
found, and the block it returns. The engine here is a stand-in that refuses as vLLM does (the whole call raises
for one bad prompt); the real engine runs in test_guide_sections' embeddings test."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pyarrow as pa

from airflow_provider_rayllm.job.engines.vllm.embed import VLLMEmbedStage
from airflow_provider_rayllm.job.stream import ERROR, KEPT_INPUT, PRE_ERROR, REQUEST


class RefusingEngine:
    """Embeds a prompt as [its length, 1.0]; a call with a prompt holding "TOO LONG" raises, as vLLM's does."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def embed(self, prompts, pooling_params=None, use_tqdm=True):
        self.calls.append(len(prompts))
        if any("TOO LONG" in p for p in prompts):
            raise ValueError("This model's maximum context length is 256 tokens")
        dims = [getattr(p, "dimensions", None) for p in pooling_params] if pooling_params else [None] * len(prompts)
        return [
            SimpleNamespace(
                outputs=SimpleNamespace(embedding=[float(len(p)), 1.0][: d or 2]), prompt_token_ids=[0] * len(p)
            )
            for p, d in zip(prompts, dims)
        ]


def stage(engine: RefusingEngine) -> VLLMEmbedStage:
    out = object.__new__(VLLMEmbedStage)
    out.llm = engine
    return out


def block(requests: list[dict | None], pre_errors: list[str] | None = None) -> pa.Table:
    n = len(requests)
    return pa.table(
        {
            KEPT_INPUT: [{"id": i} for i in range(n)],
            REQUEST: [json.dumps(r) if r is not None else "{}" for r in requests],
            PRE_ERROR: pre_errors or [""] * n,
        }
    )


def test_a_refused_row_fails_alone_and_the_rest_of_its_batch_is_embedded_in_few_calls():
    engine = RefusingEngine()
    prompts = [f"text {i}" for i in range(64)]
    prompts[37] = "TOO LONG " * 10
    out = stage(engine)(block([{"prompt": p} for p in prompts])).to_pylist()

    assert [r[ERROR] for r in out if r[ERROR]] == ["ValueError: This model's maximum context length is 256 tokens"]
    assert out[37][ERROR] and out[37]["embeddings"] is None and out[37]["num_input_tokens"] == 0
    assert all(r["embeddings"] == [float(len(p)), 1.0] for r, p in zip(out, prompts) if not r[ERROR])
    assert [r[KEPT_INPUT]["id"] for r in out] == list(range(64)), "rows keep their order and their input"
    assert out[0]["prompt"] == "text 0" and out[0]["num_input_tokens"] == len("text 0")
    # The whole batch first, then halves down to the refused row: 13 calls, not one per row.
    assert engine.calls[0] == 64 and len(engine.calls) == 13, engine.calls


def test_rows_without_a_request_never_reach_the_engine_and_bad_pooling_params_fail_their_row():
    engine = RefusingEngine()
    requests = [
        {"prompt": "a"},
        None,  # its request step failed
        {"prompt": "b", "pooling_params": {"normalize": False}},  # not a field of vLLM's PoolingParams
        {"prompt_token_ids": [5, 6, 7]},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"prompt": "c", "pooling_params": {"dimensions": 1}, "note": "kept"},
    ]
    pre = ["", "prompt: ValueError: column 'text' is empty", "", "", "", ""]
    table = stage(engine)(block(requests, pre))
    out = table.to_pylist()

    assert out[1][ERROR] == pre[1]
    assert out[2][ERROR].startswith("request: TypeError:") and "normalize" in out[2][ERROR]
    assert out[4][ERROR] == "request: ValueError: the request has no prompt text (prompt=None)"
    assert engine.calls == [3], "one call, with the three rows that have a prompt"
    assert out[0]["embeddings"] == [1.0, 1.0] and out[5]["embeddings"] == [1.0]
    assert out[5]["note"] == "kept", "a request's other fields stay on the row for postprocess"
    assert str(table.schema.field("embeddings").type) == "list<item: float>", "vectors of two lengths"
