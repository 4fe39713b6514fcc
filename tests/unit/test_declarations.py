"""The operators' typed signatures in the source agree with the declarations (template fields, docs and
refusals come from those), a type checker catches a misspelled argument, and the Airflow half parses a DAG
without loading the Ray half's libraries."""

from __future__ import annotations

import inspect
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from airflow.sdk import BaseOperator
from pydantic import Field, TypeAdapter

from airflow_provider_rayllm.contract import spec
from airflow_provider_rayllm.operators import arguments
from airflow_provider_rayllm.operators.base import RayJobOperator
from airflow_provider_rayllm.operators.http_batch import HttpLLMBatchOperator
from airflow_provider_rayllm.operators.model_upload import ModelUploadOperator
from airflow_provider_rayllm.operators.task_args import BaseOperatorArgs, RayJobArgs
from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

REPO = Path(__file__).resolve().parents[2]
OPERATORS = {"vllm": VLLMBatchOperator, "http": HttpLLMBatchOperator, "upload": ModelUploadOperator}


STAGES = ("chat_template_stage", "tokenize_stage", "detokenize_stage", "prepare_multimodal_stage")


def _keyword_parameters(init: object) -> dict[str, inspect.Parameter]:
    return {
        name: p for name, p in inspect.signature(init).parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


@pytest.mark.parametrize("kind", sorted(OPERATORS))
def test_each_operator_writes_its_declared_parameters_typed_in_the_source(kind):
    """The signature an editor shows is the operator's own source, and it agrees with the declarations: the same
    names, the same defaults (None where the spec makes a fresh default or a stage takes the spec's), each
    parameter typed, and each default of its own type."""
    cls, declared = OPERATORS[kind], {a.name: a for a in arguments.operator_arguments(kind)}
    init = cls.__init__
    assert "__signature__" not in vars(init) and "__signature__" not in vars(inspect.unwrap(init))
    own, job = _keyword_parameters(init), _keyword_parameters(RayJobOperator.__init__)
    assert not set(own) & set(job)
    assert set(own) | set(job) == set(declared)
    hints = {
        **typing.get_type_hints(inspect.unwrap(RayJobOperator.__init__)),
        **typing.get_type_hints(inspect.unwrap(init)),
    }
    for name, param in {**own, **job}.items():
        argument = declared[name]
        assert param.annotation is not inspect.Parameter.empty, f"{cls.__name__}.{name} has no type"
        if argument.required:
            assert param.default is inspect.Parameter.empty, name
            continue
        if callable(argument.default) or name in STAGES:
            assert param.default is None, name
        else:
            assert param.default == argument.default, (name, param.default, argument.default)
        TypeAdapter(hints[name]).validate_python(param.default, strict=True)


def test_the_kwargs_typed_dicts_are_airflows_and_the_jobs_parameters():
    base = {n for n in inspect.signature(BaseOperator.__init__).parameters if n not in ("self", "kwargs")}
    assert set(typing.get_type_hints(BaseOperatorArgs)) == base
    job = set(_keyword_parameters(RayJobOperator.__init__))
    assert set(typing.get_type_hints(RayJobArgs)) == base | job


@pytest.mark.parametrize("kind", sorted(OPERATORS))
def test_template_fields_are_the_declared_templated_arguments(kind):
    cls, declared = OPERATORS[kind], arguments.operator_arguments(kind)
    assert set(cls.template_fields) == {a.attr for a in declared if a.templated}


def test_mypy_passes_the_example_dags_and_names_a_misspelled_argument(tmp_path):
    """What `make test` runs on dags_examples/, and the same DAG with one argument misspelled."""
    source = (REPO / "dags_examples" / "example_vllm_batch.py").read_text()
    assert "prompt_column=" in source
    (tmp_path / "good.py").write_text(source)
    (tmp_path / "typo.py").write_text(source.replace("prompt_column=", "promt_column=", 1))
    command = [sys.executable, "-m", "mypy", "--follow-imports=silent", "--ignore-missing-imports"]
    command += ["--cache-dir", str(REPO / ".mypy_cache")]
    good = subprocess.run([*command, str(tmp_path / "good.py")], capture_output=True, text=True, cwd=REPO)
    assert good.returncode == 0, good.stdout[-2000:]
    typo = subprocess.run([*command, str(tmp_path / "typo.py")], capture_output=True, text=True, cwd=REPO)
    assert typo.returncode == 1, typo.stdout[-2000:]
    assert 'Unexpected keyword argument "promt_column" for "VLLMBatchOperator"' in typo.stdout, typo.stdout


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
    assert op.poll_interval == 0.5


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


def test_the_package_a_job_receives_leaves_out_the_embedded_stack(tmp_path):
    """The operator's runtime_env, zipped by Ray's own packaging as a submission does: the job half and the
    contract are in it, local/ (the embedded dev stack) is not."""
    import zipfile

    from ray._private.runtime_env.packaging import create_package

    from airflow_provider_rayllm.operators.base import PACKAGE_DIR

    op = VLLMBatchOperator(task_id="t", model_source="/m", input_uri="/in.jsonl", prompt_column="q")
    env = op._runtime_env(tmp_path)
    assert str(PACKAGE_DIR) in env["py_modules"]
    target = tmp_path / "package.zip"
    create_package(str(PACKAGE_DIR), target, include_gitignore=True, include_parent_dir=True, excludes=env["excludes"])
    names = zipfile.ZipFile(target).namelist()
    assert "airflow_provider_rayllm/job/driver.py" in names
    assert "airflow_provider_rayllm/contract/spec.py" in names
    assert not [n for n in names if n.startswith("airflow_provider_rayllm/local/")]
    assert not [n for n in names if "__pycache__" in n]


def test_the_guides_processor_config_fills_the_arguments_of_the_same_names(tmp_path):
    """The guide's vLLMEngineProcessorConfig, as a user already has it, builds the same spec as the same
    settings given as keywords; a field given both ways with two values is refused, naming it."""
    from ray.data.llm import vLLMEngineProcessorConfig

    config = vLLMEngineProcessorConfig(
        model_source="/models/m",
        engine_kwargs={"max_model_len": 256, "enable_chunked_prefill": True},
        concurrency=2,
        batch_size=16,
        chat_template_stage=False,
    )
    keywords = dict(
        model_source="/models/m",
        engine_kwargs={"max_model_len": 256, "enable_chunked_prefill": True},
        concurrency=2,
        batch_size=16,
        apply_chat_template=False,
    )
    common = dict(input_uri="/in.jsonl", prompt_column="q", output_uri=str(tmp_path / "out"))

    def processor(op: VLLMBatchOperator) -> dict:
        return op.processor_body()

    from_config = VLLMBatchOperator(task_id="a", processor_config=config, **common)
    as_dict = VLLMBatchOperator(task_id="b", processor_config=config.model_dump(exclude_unset=True), **common)
    from_keywords = VLLMBatchOperator(task_id="c", **keywords, **common)
    assert processor(from_config) == processor(from_keywords) == processor(as_dict)
    assert processor(from_config)["chat_template_stage"] is False and processor(from_config)["concurrency"] == 2

    with pytest.raises(TypeError, match=r"batch_size is given both as an argument \(8\) and in processor_config"):
        VLLMBatchOperator(task_id="d", processor_config=config, batch_size=8, **common)
    with pytest.raises(TypeError, match="missing argument 'model_source'"):
        VLLMBatchOperator(task_id="e", **common)


def test_the_guides_http_config_fills_its_settings_and_its_url_is_refused():
    from ray.data.llm import HttpRequestProcessorConfig

    common = dict(task_id="h", model="m", input_uri="/in.jsonl", prompt_column="q")
    op = HttpLLMBatchOperator(processor_config={"qps": 5, "concurrency": 3, "base_retry_wait_time_in_s": 2}, **common)
    assert (op.qps, op.concurrency, op.backoff_base_s) == (5, 3, 2)
    guide = HttpRequestProcessorConfig(url="https://api.openai.com/v1/chat/completions", qps=1)
    with pytest.raises(TypeError, match=r"processor_config.url is not taken here: .*http_conn_id"):
        HttpLLMBatchOperator(processor_config=guide, **common)
