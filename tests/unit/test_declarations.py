"""Each argument declared once: the operators' signatures, template fields and refusals come from the
declarations, and the Airflow half parses a DAG without loading the Ray half's libraries."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import Field

from airflow_provider_rayllm.contract import spec
from airflow_provider_rayllm.operators import arguments
from airflow_provider_rayllm.operators.http_batch import HttpLLMBatchOperator
from airflow_provider_rayllm.operators.model_upload import ModelUploadOperator
from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

REPO = Path(__file__).resolve().parents[2]
OPERATORS = {"vllm": VLLMBatchOperator, "http": HttpLLMBatchOperator, "upload": ModelUploadOperator}


@pytest.mark.parametrize("kind", sorted(OPERATORS))
def test_the_signature_and_template_fields_are_the_declarations(kind):
    cls, declared = OPERATORS[kind], arguments.operator_arguments(kind)
    params = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "kwargs")]
    assert params == [a.name for a in declared]
    assert set(cls.template_fields) == {a.attr for a in declared if a.templated}


def test_an_engine_argument_is_refused_by_the_http_operator_naming_it():
    with pytest.raises(TypeError) as err:
        HttpLLMBatchOperator(
            task_id="call", model="m", input_uri="/in.jsonl", prompt_column="q", engine_kwargs={"max_model_len": 64}
        )
    assert "HttpLLMBatchOperator got an unexpected argument 'engine_kwargs'" in str(err.value)
    assert "VLLMBatchOperator" in str(err.value)
    with pytest.raises(TypeError, match="'lora_column'"):
        HttpLLMBatchOperator(task_id="call", model="m", input_uri="/in.jsonl", prompt_column="q", lora_column="adapter")


@pytest.mark.parametrize("name", ["output_table", "max_rows", "prompt_column"])
def test_the_upload_operator_refuses_what_it_would_ignore(name):
    with pytest.raises(TypeError, match=f"ModelUploadOperator got an unexpected argument '{name}'"):
        ModelUploadOperator(task_id="upload", model_source="/m", bucket_uri="s3://b/m", **{name: "x"})


def test_default_args_reach_declared_arguments():
    op = VLLMBatchOperator(
        task_id="t", model_source="/m", input_uri="/in.jsonl", prompt_column="q", default_args={"poll_interval": 0.5}
    )
    assert op.poll_interval == 0.5 and "poll_interval" in op.arguments_given


def test_a_new_spec_field_is_an_argument_with_no_other_edit():
    class Widened(spec.PromptSpec):
        temperature_hint: float | None = Field(
            None, description="A field added to the spec.", json_schema_extra=spec.arg("hint", templated=True)
        )

    (added,) = [a for a in arguments.from_model(Widened, "prompt") if a.path == ("prompt", "temperature_hint")]
    assert (added.name, added.default, added.templated, added.description) == (
        "hint",
        None,
        True,
        "A field added to the spec.",
    )


def test_parsing_the_example_dags_loads_no_ray_half_library(tmp_path):
    """The Airflow half imports the contract only: no numpy, ray or vllm while the scheduler parses DAGs."""
    script = (
        "import runpy, sys, pathlib\n"
        f"for path in sorted(pathlib.Path({str(REPO / 'dags_examples')!r}).glob('*.py')):\n"
        "    runpy.run_path(str(path))\n"
        "print(sorted(m for m in ('numpy', 'ray', 'vllm', 'torch') if m in sys.modules))\n"
    )
    env = {"AIRFLOW_HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout[-500:]
