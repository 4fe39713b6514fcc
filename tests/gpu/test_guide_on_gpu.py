"""The guide's sections on a real GPU with real small models, through the job half (no Airflow: the lent GPU
machine has none): the quickstart (chat generation), structured output (a JSON schema, a choice, a regex),
multi-LoRA and embeddings. SmolLM2-135M-Instruct (bf16) stands for the guide's 8B model, its local-stack LoRA
adapter for the guide's adapter, all-MiniLM-L6-v2 for its embedding model.

Settings (go.sh's gputests phase sets them): RAYLLM_GPU_DASHBOARD, RAYLLM_GPU_CHAT_MODEL (SmolLM2's folder),
RAYLLM_GPU_LORA_DIR (a folder of adapters for it), RAYLLM_GPU_EMBED_MODEL (MiniLM's folder);
RAYLLM_GPU_ANSWERS names a JSON file that keeps a few answer rows of each section.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.gpu.jobs import dashboard, keep_answers, rows_of, setting, submit

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, body_parts: dict, callables: dict | None = None, name: str = "guide") -> dict:
    from airflow_provider_rayllm.contract.storage import read_manifest

    out = tmp_path / "out"
    body = {
        "version": 1,
        "kind": "vllm",
        "sink": {"uri": str(out), "format": "parquet"},
        "run": {"dag_id": "gpu_guide", "run_id": tmp_path.name, "task_id": name},
        **body_parts,
    }
    status, log = submit(dashboard(), body, tmp_path / "package", callables)
    assert status == "SUCCEEDED", log[-4000:]
    manifest = read_manifest(str(out))
    assert manifest["resource_profile"] == "gpu", "the GPU profile picked itself"
    return manifest


def _rows_source(tmp_path: Path, rows: list[dict]) -> dict:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"uris": [str(path)], "format": "jsonl"}


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z]{2,}", text)


# --- Quickstart ---------------------------------------------------------------------------------------------
QUICKSTART_PROMPTS = ["What is machine learning?", "Explain neural networks in one sentence."]
TOPICS = {QUICKSTART_PROMPTS[0]: "learn", QUICKSTART_PROMPTS[1]: "neur"}


def quickstart_preprocess(row: dict) -> dict:  # the guide's, as written
    return {
        "messages": [{"role": "user", "content": row["prompt"]}],
        "sampling_params": {"temperature": 0.7, "max_tokens": 100},
    }


def quickstart_postprocess(row: dict) -> dict:  # the guide's, as written
    return {"prompt": row["prompt"], "response": row["generated_text"]}


def test_the_guides_quickstart_answers_in_sentences_on_a_gpu(tmp_path):
    model = setting("RAYLLM_GPU_CHAT_MODEL", "SmolLM2-135M-Instruct's folder")
    manifest = _run(
        tmp_path,
        {
            "source": _rows_source(tmp_path, [{"prompt": p} for p in QUICKSTART_PROMPTS]),
            "prompt": {},
            "processor": {
                "model_source": model,
                "engine_kwargs": {"max_model_len": 4096},
                "concurrency": 1,
                "batch_size": 32,
            },
        },
        {"preprocess": quickstart_preprocess, "postprocess": quickstart_postprocess},
        "quickstart",
    )
    rows = rows_of(manifest)
    keep_answers("quickstart", manifest, rows)
    assert manifest["rows_out"] == len(QUICKSTART_PROMPTS) and manifest["rows_errored"] == 0
    assert all(set(r) == {"prompt", "response"} for r in rows), "the guide's postprocess gives the output row"
    assert 0 < manifest["output_tokens"] <= len(QUICKSTART_PROMPTS) * 100, "max_tokens=100 reached the engine"
    for r in rows:  # sentences, not noise: a real model, not random weights
        assert len(_words(r["response"])) >= 5, r
    on_topic = [r for r in rows if TOPICS[r["prompt"]] in r["response"].lower()]
    assert on_topic, f"no answer speaks of its question's topic: {rows}"


# --- Structured output ---------------------------------------------------------------------------------------
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
SENTIMENTS = ["positive", "negative"]
ISO_DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
INSTRUCTIONS = {  # dags_examples/example_structured_output.py's
    "extract": ("Give the person's name and age as JSON.", {"json": PERSON_SCHEMA}),
    "sentiment": ("Is this review positive or negative?", {"choice": SENTIMENTS}),
    "date": ("Give the date as YYYY-MM-DD.", {"regex": ISO_DATE}),
}


def structured_request(row: dict) -> dict:
    instruction, constraint = INSTRUCTIONS[row["task"]]
    return {
        "messages": [{"role": "user", "content": f"{instruction}\n\n{row['text']}"}],
        "sampling_params": {"temperature": 0, "max_tokens": 48, "structured_outputs": constraint},
    }


def test_the_guides_structured_output_holds_to_its_schema_on_a_gpu(tmp_path):
    import jsonschema

    model = setting("RAYLLM_GPU_CHAT_MODEL", "SmolLM2-135M-Instruct's folder")
    data = REPO / "airflow_provider_rayllm" / "local" / "data" / "extraction.jsonl"
    inputs = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    manifest = _run(
        tmp_path,
        {
            "source": {"uris": [str(data)], "format": "jsonl"},
            "prompt": {"id_column": "id"},
            "processor": {"model_source": model, "engine_kwargs": {"max_model_len": 1024}, "batch_size": 16},
        },
        {"preprocess": structured_request},
        "structured",
    )
    rows = sorted(rows_of(manifest), key=lambda r: r["id"])
    keep_answers("structured_output", manifest, [{k: r[k] for k in ("id", "task", "text", "response")} for r in rows])
    assert manifest["rows_out"] == len(inputs) and manifest["rows_errored"] == 0
    for r in rows:
        if r["task"] == "extract":
            person = json.loads(r["response"])
            jsonschema.validate(person, PERSON_SCHEMA)
            assert person["name"].split()[0] in r["text"], r  # the name is the text's, not made up
        elif r["task"] == "sentiment":
            assert r["response"] in SENTIMENTS, r
        else:
            assert re.fullmatch(ISO_DATE, r["response"]), r


# --- Multi-LoRA ----------------------------------------------------------------------------------------------
LORA_PROMPTS = ["Name a fruit that is yellow.", "What is the capital of France?", "Write one word about the sea."]


def test_the_guides_multi_lora_rows_answer_through_their_adapter_on_a_gpu(tmp_path):
    model = setting("RAYLLM_GPU_CHAT_MODEL", "SmolLM2-135M-Instruct's folder")
    lora_dir = Path(setting("RAYLLM_GPU_LORA_DIR", "a folder of LoRA adapters for SmolLM2"))
    (adapter,) = [p.name for p in lora_dir.iterdir() if (p / "adapter_config.json").exists()]
    rows = [{"id": i, "prompt": p, "adapter": ""} for i, p in enumerate(LORA_PROMPTS)]
    rows += [{"id": len(LORA_PROMPTS) + i, "prompt": p, "adapter": adapter} for i, p in enumerate(LORA_PROMPTS)]
    manifest = _run(
        tmp_path,
        {
            "source": _rows_source(tmp_path, rows),
            "prompt": {
                "prompt_column": "prompt",
                "lora_column": "adapter",
                "id_column": "id",
                "sampling_params": {"temperature": 0, "max_tokens": 24},
            },
            "processor": {
                "model_source": model,
                "lora_adapters": [adapter],
                "dynamic_lora_loading_path": str(lora_dir),
                "engine_kwargs": {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1, "max_model_len": 512},
                "batch_size": 16,
            },
        },
        name="lora",
    )
    out = sorted(rows_of(manifest), key=lambda r: r["id"])
    keep_answers("multi_lora", manifest, [{k: r[k] for k in ("id", "prompt", "adapter", "response")} for r in out])
    assert manifest["rows_out"] == len(rows) and manifest["rows_errored"] == 0
    base = {r["prompt"]: r["response"] for r in out if not r["adapter"]}
    tuned = {r["prompt"]: r["response"] for r in out if r["adapter"]}
    assert all(len(_words(base[p])) >= 1 for p in LORA_PROMPTS), base
    # Greedy both ways: the adapter's random B matrices change what the model says, row by row.
    assert all(tuned[p] != base[p] for p in LORA_PROMPTS), (base, tuned)


# --- Embeddings ----------------------------------------------------------------------------------------------
GUIDE_TEXTS = ["Hello world", "This is a test sentence", "Embedding models convert text to vectors"]


def embed_preprocess(row: dict) -> dict:  # the guide's, as written
    return dict(prompt=row["text"])


def embed_postprocess(row: dict) -> dict:  # the guide's, as written
    return {"text": row["prompt"], "embedding": row["embeddings"]}


def test_the_guides_embeddings_match_sentence_transformers_on_a_gpu(tmp_path):
    import numpy as np

    from airflow_provider_rayllm.local.defaults import DEMO_SENTENCES

    model = setting("RAYLLM_GPU_EMBED_MODEL", "all-MiniLM-L6-v2's folder")
    samples = [json.loads(line)["text"] for line in DEMO_SENTENCES.read_text().splitlines() if line.strip()]
    texts = GUIDE_TEXTS + samples
    manifest = _run(
        tmp_path,
        {
            "source": _rows_source(tmp_path, [{"text": t} for t in texts]),
            "prompt": {},
            "processor": {
                "model_source": model,
                "task_type": "embed",
                "batch_size": 32,
                "chat_template_stage": False,
                "detokenize_stage": False,
            },
        },
        {"preprocess": embed_preprocess, "postprocess": embed_postprocess},
        "embeddings",
    )
    rows = rows_of(manifest)
    keep_answers("embeddings", manifest, [{"text": r["text"], "embedding_head": r["embedding"][:6]} for r in rows])
    assert manifest["rows_out"] == len(texts) and manifest["rows_errored"] == 0
    ours = {r["text"]: np.asarray(r["embedding"], dtype=np.float64) for r in rows}
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        pytest.skip("sentence-transformers is not installed here (the reference the vectors are checked against)")
    reference = SentenceTransformer(model, device="cpu").encode(texts, convert_to_numpy=True)
    for text, ref in zip(texts, reference, strict=True):
        cos = ours[text] @ ref / (np.linalg.norm(ours[text]) * np.linalg.norm(ref))
        assert cos > 0.99, (text, cos)
    # Paraphrase pairs of the sample sentences are closer than unrelated ones (as on the CPU).
    unit = {t: v / np.linalg.norm(v) for t, v in ours.items()}
    for first, second in ((0, 1), (2, 3), (4, 5)):
        for unrelated in (6, 7):
            a, b, c = unit[samples[first]], unit[samples[second]], unit[samples[unrelated]]
            assert a @ b > a @ c + 0.1, (samples[first], samples[second], samples[unrelated])
