"""The guide's OpenAI-compatible endpoint section: haikus from a deployed model, many calls in flight.

The endpoint (base URL and API key) is the Airflow connection `llm_endpoint_default`: an `openai` or
`http` connection whose host is e.g. http://127.0.0.1:8000/v1 and whose password is the API key. The
tests point it at vLLM's own OpenAI-compatible server running SmolLM2 on the CPU.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Param

from airflow_provider_rayllm.local.defaults import DEMO_INPUT
from airflow_provider_rayllm.operators.http_batch import HttpLLMBatchOperator

with DAG(
    dag_id="example_http_batch",
    start_date=datetime(2026, 1, 1),
    schedule=None,
    catchup=False,
    tags=["rayllm", "example", "http"],
    params={
        "model": Param("gpt-4o-mini", type="string", description="Model name the endpoint serves"),
        "input_uri": Param(str(DEMO_INPUT), type="string", description="Rows with a 'prompt' column"),
        "qps": Param(20, type="number", minimum=0.1, description="Requests per second for the whole job"),
    },
    render_template_as_native_obj=True,
) as dag:
    HttpLLMBatchOperator(
        task_id="haiku",
        http_conn_id="llm_endpoint_default",
        model="{{ params.model }}",
        input_uri="{{ params.input_uri }}",
        prompt_template="Write a haiku about this question: {prompt}",
        system_prompt="You are a bot that responds with haikus.",
        sampling_params={"temperature": 0.0, "max_tokens": 64},
        concurrency=1,
        max_in_flight=32,
        qps="{{ params.qps }}",
        price_per_1k_input_tokens=0.00015,
        price_per_1k_output_tokens=0.0006,
    )
