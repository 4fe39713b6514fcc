"""The guide's "batch inference with a Serve deployment": two chained steps share one running engine.

An LLM application already runs on the cluster's Ray Serve (deploy one with
`python -m airflow_provider_rayllm.local.serve_app deploy --model-id smollm2 --model-source <weights>
--app chat_app --deployment chat_llm`, or your own `serve deploy` config). Neither task starts an engine:
the first asks each question, the second reads the first's output (its URI comes through XCom) and asks
a follow-up about each answer, as the guide chains `processor2(processor1(ds))`.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Param

from airflow_provider_rayllm.local.defaults import DEMO_INPUT
from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

with DAG(
    dag_id="example_serve_deployment",
    start_date=datetime(2026, 1, 1),
    schedule=None,
    catchup=False,
    tags=["rayllm", "example", "serve"],
    params={
        "model": Param("smollm2", type="string", description="Model id the Serve deployment serves"),
        "serve_app": Param("chat_app", type="string", description="Serve application on the cluster"),
        "serve_deployment": Param("chat_llm", type="string", description="LLM deployment in that application"),
        "input_uri": Param(str(DEMO_INPUT), type="string", description="Rows with a 'prompt' column"),
    },
    render_template_as_native_obj=True,
) as dag:
    first = VLLMBatchOperator(
        task_id="first_turn",
        model_source="{{ params.model }}",
        serve_app="{{ params.serve_app }}",
        serve_deployment="{{ params.serve_deployment }}",
        input_uri="{{ params.input_uri }}",
        prompt_column="prompt",
        system_prompt="Answer in one short sentence.",
        sampling_params={"temperature": 0, "max_tokens": 32},
        batch_size=8,
    )
    second = VLLMBatchOperator(
        task_id="second_turn",
        model_source="{{ params.model }}",
        serve_app="{{ params.serve_app }}",
        serve_deployment="{{ params.serve_deployment }}",
        input_uri="{{ ti.xcom_pull(task_ids='first_turn', key='outputs_folder') }}",
        prompt_template="Question: {prompt}\nAnswer: {response}\nIs the answer correct? Reply yes or no.",
        output_column="verdict",
        keep_columns=["id", "prompt", "response"],
        sampling_params={"temperature": 0, "max_tokens": 8},
        batch_size=8,
    )
    first >> second
