"""The guide's vision-language model section: each row's image and question go to a VLM.

`image_column` names the column holding the image (bytes, a path or bucket URI the cluster reads, or an
http(s) / data: URL); the operator turns on Ray's multimodal stage (the guide's `has_image=True`) and puts
the image into the user message before the text. A cell that is not a readable image becomes an error
row. The embedded default model is a small random Idefics3 the setup builds (its answers are noise that
depends on the image); on a GPU cluster point `model_source` at a real VLM, e.g. HuggingFaceTB/SmolVLM-256M-Instruct.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Param

from airflow_provider_rayllm.local.defaults import DEMO_IMAGES, DEMO_VLM
from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

with DAG(
    dag_id="example_vision",
    start_date=datetime(2026, 1, 1),
    schedule=None,
    catchup=False,
    tags=["rayllm", "example", "vision"],
    params={
        "model_source": Param(
            str(DEMO_VLM), type="string", description="A vision-language model: HF id, cluster path or bucket URI"
        ),
        "input_uri": Param(str(DEMO_IMAGES), type="string", description="Rows with 'question' and 'image' columns"),
    },
    render_template_as_native_obj=True,
) as dag:
    VLLMBatchOperator(
        task_id="describe",
        model_source="{{ params.model_source }}",
        input_uri="{{ params.input_uri }}",
        prompt_column="question",
        image_column="image",
        keep_columns=["id", "name"],
        sampling_params={"temperature": 0, "max_tokens": 8},
        engine_kwargs={"max_model_len": 512, "limit_mm_per_prompt": {"image": 1}},
        batch_size=8,
    )
