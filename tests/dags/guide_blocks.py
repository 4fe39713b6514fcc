"""The reference guide's code blocks as DAGs: each block's own preprocess and postprocess, unchanged, given
to our operators; its config's settings as operator arguments. Where the guide names a GPU-sized model,
the model is a Param whose default is the guide's; the CPU tests run the same DAG with a small model.

guide_quickstart        "Quickstart: vLLM batch inference" (from_items rows, the chat preprocess)
guide_vlm               "vision-language models" (vision_preprocess with a PIL image, vision_postprocess)
guide_vlm_config        the same section's "more comprehensive" create_vlm_config(), as processor_config
guide_openai_endpoint   "batch inference with an OpenAI-compatible endpoint" (payload / http_response)
guide_serve_chain       "batch inference with a Serve deployment" (processor2(processor1(ds)), completions)
"""

from __future__ import annotations

from datetime import datetime
from io import BytesIO

from airflow.sdk import DAG, Param
from PIL import Image

from airflow_provider_rayllm.operators.http_batch import HttpLLMBatchOperator
from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

START = datetime(2026, 1, 1)

# --- Quickstart ---------------------------------------------------------------------------------------------
with DAG(
    dag_id="guide_quickstart",
    start_date=START,
    schedule=None,
    params={"model_source": Param("unsloth/Llama-3.1-8B-Instruct", type="string")},
    render_template_as_native_obj=True,
) as guide_quickstart:
    VLLMBatchOperator(
        task_id="processor",
        model_source="{{ params.model_source }}",
        input_rows=[
            {"prompt": "What is machine learning?"},
            {"prompt": "Explain neural networks in one sentence."},
        ],
        concurrency=1,  # 1 vLLM engine replica
        batch_size=32,  # 32 samples per batch
        engine_kwargs={
            "max_model_len": 4096,  # Fit into test GPU memory
        },
        preprocess=lambda row: {
            "messages": [{"role": "user", "content": row["prompt"]}],
            "sampling_params": {"temperature": 0.7, "max_tokens": 100},
        },
        postprocess=lambda row: {
            "prompt": row["prompt"],
            "response": row["generated_text"],
        },
    )


# --- Vision-language models ---------------------------------------------------------------------------------
def vision_preprocess(row: dict) -> dict:
    """
    Preprocessing function for vision-language model inputs.
    Converts dataset rows into the format expected by the VLM:
    - System prompt for analysis instructions
    - User message with text and image content
    - Multiple choice formatting
    - Sampling parameters
    """
    choice_indices = ["A", "B", "C", "D", "E", "F", "G", "H"]
    return {
        "messages": [
            {
                "role": "system",
                "content": (
                    "Analyze the image and question carefully, using step-by-step reasoning. "
                    "First, describe any image provided in detail. Then, present your reasoning. "
                    "And finally your final answer in this format: Final Answer: <answer> "
                    "where <answer> is: The single correct letter choice A, B, C, D, E, F, etc. when options are provided. "
                    "Only include the letter. Your direct answer if no options are given, as a single phrase or number. "
                    "IMPORTANT: Remember, to end your answer with Final Answer: <answer>."
                ),
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": row["question"] + "\n\n"},
                    {
                        "type": "image",
                        # Ray Data accepts PIL Image or image URL
                        "image": Image.open(BytesIO(row["image"]["bytes"])),
                    },
                    {
                        "type": "text",
                        "text": "\n\nChoices:\n"
                        + "\n".join([f"{choice_indices[i]}. {choice}" for i, choice in enumerate(row["answer"])]),
                    },
                ],
            },
        ],
        "sampling_params": {
            "temperature": 0.3,
            "max_tokens": 150,
            "detokenize": False,
        },
        # Include original data for reference
        "original_data": {
            "question": row["question"],
            "answer_choices": row["answer"],
            "image_size": row["image"].get("width", 0) if row["image"] else 0,
        },
    }


def vision_postprocess(row: dict) -> dict:
    return {
        "resp": row["generated_text"],
    }


with DAG(
    dag_id="guide_vlm",
    start_date=START,
    schedule=None,
    params={
        "model_source": Param("Qwen/Qwen2.5-VL-3B-Instruct", type="string"),
        "input_uri": Param("hf://datasets/lmms-lab/LMMs-Eval-Lite/coco2017_cap_val/", type="string"),
        "max_model_len": Param(4096, type="integer"),
        "accelerator_type": Param("L4", type=["null", "string"]),
        # Where the job finds the Hub (HF_ENDPOINT: a private hub or a mirror); empty for huggingface.co.
        "job_runtime_env": Param({}, type="object"),
    },
    render_template_as_native_obj=True,
) as guide_vlm:
    VLLMBatchOperator(
        task_id="vision_processor",
        model_source="{{ params.model_source }}",
        input_uri="{{ params.input_uri }}",
        engine_kwargs=dict(
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            max_model_len="{{ params.max_model_len }}",
            enable_chunked_prefill=True,
            max_num_batched_tokens=2048,
        ),
        # Override Ray's runtime env to include the Hugging Face token. Ray Data uses Ray under the hood to orchestrate the inference pipeline.
        runtime_env=dict(
            env_vars=dict(
                # HF_TOKEN=HF_TOKEN, # Token not needed for public models
                VLLM_USE_V1="1",
            ),
        ),
        batch_size=16,
        accelerator_type="{{ params.accelerator_type }}",
        concurrency=1,
        has_image=True,
        preprocess=vision_preprocess,
        postprocess=vision_postprocess,
        job_runtime_env="{{ params.job_runtime_env }}",
    )


# The section's second config ("for more comprehensive VLM configuration"), as the guide writes it, but as a
# dict of its fields: Ray 2.60's vLLMEngineProcessorConfig no longer takes has_image (the operator does).
def create_vlm_config():
    """Create VLM configuration."""
    return dict(
        model_source="Qwen/Qwen2.5-VL-3B-Instruct",
        engine_kwargs=dict(
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            max_model_len=4096,
            trust_remote_code=True,
            limit_mm_per_prompt={"image": 1},
        ),
        runtime_env={
            # "env_vars": {"HF_TOKEN": "your-hf-token-here"} # Token not needed for public models
        },
        batch_size=1,
        accelerator_type="L4",
        concurrency=1,
        has_image=True,
    )


# The guide's run_vlm_example: config = create_vlm_config(), its dataset, build_processor(config, preprocess=...,
# postprocess=...).
with DAG(dag_id="guide_vlm_config", start_date=START, schedule=None) as guide_vlm_config:
    VLLMBatchOperator(
        task_id="vision_processor",
        processor_config=create_vlm_config(),
        input_uri="hf://datasets/lmms-lab/LMMs-Eval-Lite/coco2017_cap_val/",
        preprocess=vision_preprocess,
        postprocess=vision_postprocess,
    )


# --- An OpenAI-compatible endpoint --------------------------------------------------------------------------
# The guide's url and "Authorization: Bearer <OPENAI_API_KEY>" header are the `openai_endpoint` connection's
# host and password: the key travels as a job secret.
with DAG(dag_id="guide_openai_endpoint", start_date=START, schedule=None) as guide_openai_endpoint:
    HttpLLMBatchOperator(
        task_id="processor",
        http_conn_id="openai_endpoint",
        model="gpt-4o-mini",
        input_rows=["Hand me a haiku."],
        qps=1,
        preprocess=lambda row: dict(
            payload=dict(
                model="gpt-4o-mini",
                messages=[
                    {
                        "role": "system",
                        "content": "You are a bot that responds with haikus.",
                    },
                    {"role": "user", "content": row["item"]},
                ],
                temperature=0.0,
                max_tokens=150,
            ),
        ),
        postprocess=lambda row: dict(response=row["http_response"]["choices"][0]["message"]["content"]),
    )


# --- A Serve deployment, two chained processors -------------------------------------------------------------
# The guide's app (APP_NAME, DEPLOYMENT_NAME, model id facebook/opt-1.3b) runs on the cluster's Serve;
# `python -m airflow_provider_rayllm.local.serve_app deploy --model-id facebook/opt-1.3b --app demo_app
# --deployment demo_deployment --model-source <weights>` deploys it. The second processor reads the first's
# output through XCom, as the guide's processor2(processor1(ds)).
APP_NAME = "demo_app"
DEPLOYMENT_NAME = "demo_deployment"

with DAG(dag_id="guide_serve_chain", start_date=START, schedule=None) as guide_serve_chain:
    processor1 = VLLMBatchOperator(
        task_id="processor1",
        model_source="facebook/opt-1.3b",
        serve_deployment=DEPLOYMENT_NAME,
        serve_app=APP_NAME,
        input_rows=[{"id": i} for i in range(10)],  # ray.data.range(10)
        concurrency=1,
        batch_size=64,
        preprocess=lambda row: dict(
            method="completions",
            dtype="CompletionRequest",
            request_kwargs=dict(
                model="facebook/opt-1.3b",
                prompt=f"This is a prompt for {row['id']}",
                stream=False,
            ),
        ),
        postprocess=lambda row: dict(
            prompt=row["choices"][0]["text"],
        ),
    )
    processor2 = VLLMBatchOperator(
        task_id="processor2",
        model_source="facebook/opt-1.3b",
        serve_deployment=DEPLOYMENT_NAME,
        serve_app=APP_NAME,
        input_uri="{{ ti.xcom_pull(task_ids='processor1', key='outputs_folder') }}",
        concurrency=1,
        batch_size=64,
        preprocess=lambda row: dict(
            method="completions",
            dtype="CompletionRequest",
            request_kwargs=dict(
                model="facebook/opt-1.3b",
                prompt=row["prompt"],
                stream=False,
            ),
        ),
        postprocess=lambda row: row,
    )
    processor1 >> processor2
