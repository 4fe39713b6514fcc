"""Structured output: every answer is constrained by a JSON schema, a list of choices or a regex.

The request for each row is built by a Python callable (the guide's `preprocess`), which picks the
constraint from the row's `task` column. vLLM's structured outputs enforce it while decoding.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Param

from airflow_provider_rayllm.local.defaults import DEMO_EXTRACTION, DEMO_MODEL
from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
SENTIMENTS = ["positive", "negative"]
ISO_DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"

INSTRUCTIONS = {
    "extract": ("Give the person's name and age as JSON.", {"json": PERSON_SCHEMA}),
    "sentiment": ("Is this review positive or negative?", {"choice": SENTIMENTS}),
    "date": ("Give the date as YYYY-MM-DD.", {"regex": ISO_DATE}),
}


def build_request(row: dict) -> dict:
    instruction, constraint = INSTRUCTIONS[row["task"]]
    return {
        "messages": [{"role": "user", "content": f"{instruction}\n\n{row['text']}"}],
        "sampling_params": {"temperature": 0, "max_tokens": 48, "structured_outputs": constraint},
    }


with DAG(
    dag_id="example_structured_output",
    start_date=datetime(2026, 1, 1),
    schedule=None,
    catchup=False,
    tags=["rayllm", "example", "structured-output"],
    params={
        "model_source": Param(str(DEMO_MODEL), type="string", description="HF id, cluster path or bucket URI"),
        "input_uri": Param(str(DEMO_EXTRACTION), type="string", description="Rows with 'task' and 'text'"),
    },
    render_template_as_native_obj=True,
) as dag:
    VLLMBatchOperator(
        task_id="extract",
        model_source="{{ params.model_source }}",
        input_uri="{{ params.input_uri }}",
        preprocess=build_request,
        engine_kwargs={"max_model_len": 1024},
        batch_size=16,
    )
