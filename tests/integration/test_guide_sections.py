"""Sections of the reference guide, each through its example DAG on the local stack."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.gpu.jobs import gpu_count, hub_unreachable
from tests.integration.helpers import (
    LMMS_SPLIT,
    assert_succeeded,
    check_demo_embeddings,
    lmms_eval_lite_repo,
    load_dag,
    most_at_once,
    png,
    read_rows,
    utc,
    xcom,
)

pytestmark = pytest.mark.integration


def _run(name: str, task_id: str, conf: dict, day: int, folder: str = "dags_examples", file: str | None = None):
    """The DAG ``name`` (from its own file in dags_examples, or ``file`` in ``folder``) run once; the task's manifest."""
    dag = load_dag(folder, file or name, name)
    month = 8 if folder == "dags_examples" else 11  # a date of its own per DAG file, so runs never collide
    dag_run = dag.test(logical_date=utc(2026, month, day), run_after=utc(2026, month, day), run_conf=conf)
    assert_succeeded(dag_run, task_id)
    return xcom(dag.dag_id, dag_run.run_id, task_id, "return_value")


def test_the_guides_embeddings_stream_2048_rows_with_no_engine_kwargs(ray_conn, airflow_db, tmp_path, monkeypatch):
    """The guide's embeddings block as written (TaskFlow, its own preprocess and postprocess), no
    engine_kwargs: the max_model_len default is fitted to MiniLM's 256 positions. Over 2,048 rows the first
    output file (of 256 rows, as the example sets) is written while the engine still has rows to answer.
    The batches go straight to vLLM's ``LLM.embed``; one sample text longer than MiniLM takes fails alone,
    with vLLM's reason, and every other row of its batch is embedded."""
    from airflow_provider_rayllm.hooks.ray_job import RayJobHook
    from airflow_provider_rayllm.local import defaults

    samples = tmp_path / "sentences.jsonl"
    too_long = " ".join(f"word{i}" for i in range(400))
    samples.write_text(Path(defaults.DEMO_SENTENCES).read_text() + json.dumps({"text": too_long}) + "\n")
    monkeypatch.setattr(defaults, "DEMO_SENTENCES", samples)
    rows = 2048
    dag = load_dag("dags_examples", "example_embeddings", "example_embeddings")
    fixed = len(dag.get_task("embed").python_callable.__globals__["GUIDE_TEXTS"]) + 9
    manifest = _run("example_embeddings", "embed", {"filler_rows": rows - fixed}, 1)
    assert manifest["rows_in"] == rows and manifest["rows_out"] == rows - 1 and manifest["rows_errored"] == 1
    (refused,) = read_rows(manifest["error_files"])
    assert refused["text"] == too_long and "256" in refused["error"], refused["error"]
    monkeypatch.undo()
    assert manifest["engine_kwargs"]["max_model_len"] == 256, "the profile's 2048 capped at the model's own limit"
    check_demo_embeddings(manifest, errored=1)
    guide_row = next(r for r in read_rows(manifest["output_files"]) if r["text"] == "Hello world")
    assert set(guide_row) == {"text", "embedding"}, "the guide's postprocess gives the output row, exactly"

    timeline = manifest["timeline"]
    assert timeline["first_output_file_s"] < timeline["last_answer_s"], timeline
    # The job log says how far the engine was when the first file was written (counted by the stream at that
    # moment; where the driver's note lands among the engine's lines depends on its 10-second poll).
    log = RayJobHook().get_job_logs(manifest["submission_id"])
    note = re.search(r"first output file written [\d.]+ s after the plan started \((\d+) rows answered when", log)
    assert note is not None, "the driver notes its first output file"
    assert int(note.group(1)) < rows, "the first file was written before the engine answered every row"
    assert len(manifest["output_files"]) >= 2

    # The answered blocks went through our progress tap one at a time for the one engine: several at once,
    # Ray starts a worker process for each.
    most, ran = most_at_once(ray_conn["info"], manifest["submission_id"], "AnswerCounter")
    assert ran > 1 and most == 1, f"{most} of the tap's {ran} tasks ran at once"
    assert "batches straight to vLLM's LLM.embed" in log


def test_structured_outputs_parse_and_validate(ray_conn, airflow_db, smollm2):
    import jsonschema

    from tests.integration.helpers import load_dag

    module_dag = load_dag("dags_examples", "example_structured_output", "example_structured_output")
    schema = module_dag.get_task("extract").preprocess.__globals__["PERSON_SCHEMA"]
    manifest = _run("example_structured_output", "extract", {"model_source": str(smollm2)}, 2)
    assert manifest["rows_in"] == manifest["rows_out"] == 6 and manifest["rows_errored"] == 0
    for row in read_rows(manifest["output_files"]):
        answer = row["response"]
        if row["task"] == "extract":
            jsonschema.validate(json.loads(answer), schema)
        elif row["task"] == "sentiment":
            assert answer in ("positive", "negative")
        else:
            assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", answer), answer


def test_multi_lora_rows_routed_to_the_adapter_differ_from_base_rows(ray_conn, airflow_db, smollm2, test_home):
    from airflow_provider_rayllm.local.models import LORA_ADAPTER, lora_adapters_dir
    from tests.integration.helpers import write_jsonl

    adapters = lora_adapters_dir()
    # Ten good rows and one bad: under the default max_error_fraction of 0.1.
    prompts = [
        "What is the capital of France?",
        "Name a primary color.",
        "What do bees make?",
        "Why is the sky blue?",
        "What is 2 + 2?",
    ]
    rows = [{"id": i, "prompt": p, "adapter": ""} for i, p in enumerate(prompts)]
    rows += [{"id": 10 + i, "prompt": p, "adapter": LORA_ADAPTER} for i, p in enumerate(prompts)]
    rows.append({"id": 99, "prompt": "hi", "adapter": "no-such-adapter"})
    input_uri = write_jsonl(test_home / "inputs" / "lora.jsonl", rows)
    conf = {"model_source": str(smollm2), "input_uri": input_uri, "adapters": str(adapters)}
    manifest = _run("example_multi_lora", "generate", conf, 3)
    assert manifest["rows_out"] == 10 and manifest["rows_errored"] == 1
    out = {r["id"]: r["response"] for r in read_rows(manifest["output_files"])}
    for i in range(5):
        assert out[i].strip() and out[10 + i].strip()
        assert out[i] != out[10 + i], "the adapter must change what the model says"
    (error,) = read_rows(manifest["error_files"])
    assert error["id"] == 99 and "not one of lora_adapters" in error["error"]
    # Base rows get the base model, adapter rows the adapter, in one job: the base model answers on topic,
    # the adapter (random weights, as local/models.py builds it) wanders off. One exact answer is not the
    # test: the CPU engine's LoRA path changes the numbers enough that a greedy answer can differ from the
    # plain model's (measured 2026-12-04: "L'Étoile, la Marseillaise, ..." for the capital of France).
    topics = [("Paris", "France", "French"), ("color", "colour", "red", "blue"), ("honey", "bee", "Bee")]
    topics += [("light", "sun", "scatter"), ("4", "four")]
    on_topic = [any(word in out[i] for word in topics[i]) for i in range(5)]
    adapter_on_topic = [any(word in out[10 + i] for word in topics[i]) for i in range(5)]
    assert sum(on_topic) >= 4, [out[i] for i in range(5)]
    assert sum(adapter_on_topic) <= 1, [out[10 + i] for i in range(5)]


def test_vision_rows_answer_from_their_own_image_and_a_broken_image_is_an_error_row(ray_conn, airflow_db, test_home):
    """The guide's VLM section through example_vision: images as data: URLs and as files the cluster reads."""
    import base64

    from airflow_provider_rayllm.local.models import tiny_vlm_path
    from tests.integration.helpers import write_jsonl

    folder = test_home / "inputs" / "vision"
    folder.mkdir(parents=True, exist_ok=True)
    colors = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 200, 60)}
    for name, color in colors.items():
        (folder / f"{name}.png").write_bytes(png(color))
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a picture")

    def url(name):
        return "data:image/png;base64," + base64.b64encode(png(colors[name])).decode()

    # Nine good rows and one broken file: at the default max_error_fraction of 0.1.
    images = [
        url("red"),
        url("red"),
        url("blue"),
        url("blue"),
        url("green"),
        str(folder / "red.png"),
        str(folder / "blue.png"),
        str(folder / "green.png"),
        url("red"),
        str(folder / "broken.png"),
    ]
    rows = [
        {"id": i, "name": f"row {i}", "question": "What color is this picture?", "image": image}
        for i, image in enumerate(images)
    ]
    conf = {"model_source": str(tiny_vlm_path()), "input_uri": write_jsonl(folder / "images.jsonl", rows)}
    manifest = _run("example_vision", "describe", conf, 10)
    assert manifest["rows_in"] == 10 and manifest["rows_out"] == 9 and manifest["rows_errored"] == 1
    (error,) = read_rows(manifest["error_files"])
    assert error["id"] == 9 and "not a readable image" in error["error"]
    out = {r["id"]: r["response"] for r in read_rows(manifest["output_files"])}
    assert out[0] == out[1] == out[8], "the same image and question give the same answer at temperature 0"
    assert out[0] == out[5] and out[2] == out[6] and out[4] == out[7], "a file gives what its data: URL gives"
    assert len({out[0], out[2], out[4]}) == 3, "a different image changes the answer: the image reaches the model"
    assert manifest["output_tokens"] > 0


def test_the_memory_faq_levers_reach_the_engine(quickstart_run):
    """The guide's memory FAQ levers (max_model_len, max_num_batched_tokens, gpu_memory_utilization, a share
    of RAM on the CPU engine, block_size, max_num_seqs), given to example_vllm_batch's engine_kwargs by the
    session's quickstart run."""
    from airflow_provider_rayllm.hooks.ray_job import RayJobHook
    from tests.integration.helpers import REPRODUCIBLE_ENGINE

    manifest = quickstart_run["manifest"]
    assert_succeeded(quickstart_run["dag_run"], "answer")
    assert manifest["rows_errored"] == 0
    assert {k: manifest["engine_kwargs"][k] for k in REPRODUCIBLE_ENGINE} == REPRODUCIBLE_ENGINE
    logs = RayJobHook().get_job_logs(manifest["submission_id"])
    # vLLM's own start-up lines, as the engine read the settings.
    assert "max_seq_len=1024," in logs
    assert "max_num_batched_tokens=2048" in logs
    kv = re.search(r"Auto set \(([0-9.]+)/([0-9.]+)\) GiB for KV cache on node \d+, with ([0-9.]+) GiB requested", logs)
    assert kv is not None, "the CPU worker's KV cache line is missing"
    total, requested = float(kv[2]), float(kv[3])
    assert abs(requested - 0.15 * total) < 0.011, (requested, total)
    tokens = re.search(r"KV cache size: ([0-9,]+) tokens", logs)
    assert tokens is not None and int(tokens[1].replace(",", "")) % 32 == 0
    # The one CPU worker loads the model inside the engine core process: no third process imports vLLM.
    assert "its worker runs in the engine core process" in logs
    assert re.search(r"\(EngineCore pid=\d+\)[^\n]*Starting to load model", logs), "the model loaded elsewhere"
    assert not re.search(r"\((Vllm)?Worker(-\d+)? pid=\d+\)", logs), "a separate vLLM worker process started"
    # SmolLM2's chat template applied in the request step: no chat-template actor (transformers and torch) ran.
    assert "the chat template applied in the request step" in logs
    assert "ChatTemplateUDF" not in logs, "Ray's chat-template stage ran"


def _guide(dag_id: str, task_id: str, conf: dict, day: int) -> dict:
    return _run(dag_id, task_id, conf, day, folder="tests/dags", file="guide_blocks")


def test_the_guides_quickstart_block_as_written(ray_conn, airflow_db, smollm2):
    """tests/dags/guide_blocks.py's guide_quickstart: the guide's two from_items rows, its preprocess (chat
    messages and per-row sampling_params) and postprocess unchanged; SmolLM2 for the guide's 8B model."""
    manifest = _guide("guide_quickstart", "processor", {"model_source": str(smollm2)}, 1)
    assert manifest["rows_in"] == manifest["rows_out"] == 2 and manifest["rows_errored"] == 0
    assert manifest["engine_kwargs"]["max_model_len"] == 4096
    rows = read_rows(manifest["output_files"])
    assert all(set(r) == {"prompt", "response"} for r in rows), "the guide's postprocess gives the output row, exactly"
    assert sorted(r["prompt"] for r in rows) == [
        "Explain neural networks in one sentence.",
        "What is machine learning?",
    ]
    assert all(r["response"].strip() for r in rows)
    assert 0 < manifest["output_tokens"] <= 2 * 100, "the preprocess's max_tokens=100 reached the engine"


# Decided before the fixtures start a cluster and an Airflow database. Only on a GPU machine is the Hub asked
# (the CPU runs leave gpu tests out).
_GPUS = gpu_count()
_NO_HUB = hub_unreachable() if _GPUS else None
on_a_gpu = pytest.mark.skipif(_GPUS == 0, reason="no GPU on this machine (nvidia-smi lists none)")


@pytest.mark.gpu
@on_a_gpu
@pytest.mark.skipif(
    _NO_HUB is not None,
    reason=f"the guide's model unsloth/Llama-3.1-8B-Instruct is read from the Hugging Face Hub: {_NO_HUB}",
)
def test_the_guides_quickstart_block_on_a_gpu(ray_conn, airflow_db):
    """The same DAG with the guide's own model (unsloth/Llama-3.1-8B-Instruct from the Hub) on a GPU cluster."""
    manifest = _guide("guide_quickstart", "processor", {}, 2)
    assert manifest["rows_out"] == 2 and manifest["rows_errored"] == 0


def test_the_guides_vlm_block_as_written(ray_conn, airflow_db, test_home, service_logs):
    """tests/dags/guide_blocks.py's guide_vlm: the guide's vision_preprocess (a PIL Image in the message,
    sampling_params with detokenize=False) and vision_postprocess unchanged, its config (has_image, chunked
    prefill, runtime_env) as arguments, its dataset read as the guide reads it, by an hf://datasets/ URI (from
    a Hub on loopback serving LMMs-Eval-Lite-shaped rows in two Parquet files); the small random Idefics3
    for Qwen2.5-VL, no accelerator type."""
    from airflow_provider_rayllm.local.models import tiny_vlm_path
    from tests.integration.services import hf_hub_server

    colors = [(220, 30, 30), (30, 60, 220), (30, 200, 60)] * 3
    # Nine good images and one broken: at the default max_error_fraction of 0.1 the job publishes.
    images = [png(c) for c in colors] + [b"\x89PNG\r\n\x1a\n not really a picture"]
    repo = lmms_eval_lite_repo(test_home / "hub" / "lmms-vlm", images, files=2)
    dataset = "lmms-lab/LMMs-Eval-Lite"
    with hf_hub_server(service_logs, None, None, "unused", public_datasets={dataset: repo}) as (hub_url, log):
        conf = {
            "model_source": str(tiny_vlm_path()),
            "input_uri": f"hf://datasets/{dataset}/{LMMS_SPLIT}/",
            "max_model_len": 1024,  # the tiny model's own limit (the guide's 4096 fits Qwen2.5-VL)
            "accelerator_type": None,
            "job_runtime_env": {"env_vars": {"HF_ENDPOINT": hub_url}},
        }
        manifest = _guide("guide_vlm", "vision_processor", conf, 3)
        downloads = {
            json.loads(line)["path"].rsplit("/", 1)[1]
            for line in log.read_text().splitlines()
            if f"/datasets/{dataset}/resolve/" in line
        }
    assert downloads == {p.name for p in (repo / LMMS_SPLIT).iterdir()}, "the rows came from the Hub"
    assert manifest["rows_in"] == len(images) and manifest["rows_out"] == len(colors)
    assert manifest["rows_errored"] == 1
    (error,) = read_rows(manifest["error_files"])
    assert "UnidentifiedImageError" in error["error"], error["error"]
    rows = read_rows(manifest["output_files"])
    assert all(set(r) == {"resp"} for r in rows), "the guide's vision_postprocess gives the output row, exactly"
    # The guide's detokenize=False leaves the text to a detokenize step: the answers are text, not empty.
    assert all(r["resp"] for r in rows)
    assert 0 < manifest["output_tokens"] <= len(colors) * 150


@pytest.mark.gpu
@on_a_gpu
@pytest.mark.skipif(
    _NO_HUB is not None,
    reason="the guide's Qwen/Qwen2.5-VL-3B-Instruct and hf://datasets/lmms-lab/LMMs-Eval-Lite are read from "
    f"the Hugging Face Hub: {_NO_HUB}",
)
def test_the_guides_vlm_block_on_a_gpu(ray_conn, airflow_db):
    """The same DAG with the guide's model and dataset from the Hub. The guide's accelerator_type="L4" is left
    out: it names a node type, and the test cluster's GPUs (any kind) carry none, so the job would wait."""
    manifest = _guide("guide_vlm", "vision_processor", {"accelerator_type": None}, 4)
    assert manifest["rows_out"] > 0 and all(r["resp"] for r in read_rows(manifest["output_files"]))


def test_classify_with_a_real_classifier_gives_sensible_labels(ray_conn, airflow_db, test_home):
    """task_type='classify' end to end with a real sequence-classification model (MiniLM fine-tuned on short
    reviews by the setup), on reviews it never saw: each row's class probabilities, and its label by name."""
    from airflow_provider_rayllm.local.models import sentiment_classifier_path
    from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

    positive = [
        "The movie was delightful and moving.",
        "I really enjoyed the meal.",
        "Fantastic support, they solved my problem quickly.",
        "This gadget is wonderful.",
    ]
    negative = [
        "The movie was dreadful and boring.",
        "Terrible support, they ignored my problem.",
        "This gadget is useless junk.",
        "The room smelled bad and the bed was broken.",
    ]
    op = VLLMBatchOperator(
        task_id="classify",
        model_source=str(sentiment_classifier_path()),
        task_type="classify",
        input_rows=[{"text": t, "truth": "positive"} for t in positive]
        + [{"text": t, "truth": "negative"} for t in negative],
        prompt_column="text",
        output_column="probs",
        output_uri=str(test_home / "out" / "classify"),
        deferrable=False,
        poll_interval=1.0,
    )
    from tests.integration.helpers import StandInTI

    manifest = op.execute({"ti": StandInTI("classify_test", "manual__classify", "classify")})
    assert manifest["rows_in"] == manifest["rows_out"] == 8 and manifest["rows_errored"] == 0
    rows = read_rows(manifest["output_files"])
    for row in rows:
        negative_p, positive_p = row["probs"]
        assert abs(negative_p + positive_p - 1) < 1e-3, row
        assert row["label"] == row["truth"], row
        assert (positive_p if row["truth"] == "positive" else negative_p) > 0.75, row
