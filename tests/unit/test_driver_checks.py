"""The driver's checks read the model's config files and vLLM's source instead of importing vLLM; each is held
to vLLM's own judgement of the same settings (vLLM imported here, in the test, once)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from airflow_provider_rayllm.job.engines.vllm import checks, declared, model_config
from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.local import models

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "num_hidden_layers": 1,
    "vocab_size": 128,
    "max_position_embeddings": 1024,
}
CONFIGS = {
    "plain": (LLAMA, None),
    "linear rope": ({**LLAMA, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}, None),
    "yarn rope (already scaled)": ({**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, None),
    "tokenizer shorter (generative: ignored)": (LLAMA, {"model_max_length": 512}),
    "gpt-2 key": ({k: v for k, v in LLAMA.items() if k != "max_position_embeddings"} | {"n_positions": 300}, None),
}


def _vllm_max_len(folder: str) -> int:
    from vllm.engine.arg_utils import EngineArgs

    return int(EngineArgs(model=folder).create_model_config().max_model_len)


def _local_models() -> dict[str, str]:
    found = {}
    for name in ("SmolLM2-135M-Instruct", "tiny-idefics3", "minilm-sentiment"):
        if (models.MODELS_DIR / name / "config.json").exists():
            found[name] = str(models.MODELS_DIR / name)
    try:
        found["all-MiniLM-L6-v2"] = str(models.minilm_path())
    except Exception:  # not installed here
        pass
    return found


def test_the_longest_sequence_read_from_config_files_is_the_one_vllm_derives(tmp_path):
    folders = {}
    for name, (config, tokenizer) in CONFIGS.items():
        folder = tmp_path / name.replace(" ", "_")
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        if tokenizer:
            (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer))
        folders[name] = str(folder)
    folders.update(_local_models())
    assert "SmolLM2-135M-Instruct" in folders, "the embedded demo model is prepared by scripts/setup.sh"
    ours = {name: model_config.model_max_len(folder, {}) for name, folder in folders.items()}
    theirs = {name: _vllm_max_len(folder) for name, folder in folders.items()}
    assert ours == theirs
    assert len(set(theirs.values())) >= 4, "the cases should tell the rules apart"


def test_a_config_without_a_length_leaves_the_judgement_to_the_engine(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert model_config.model_max_len(str(tmp_path), {}) is None
    assert model_config.model_max_len(str(tmp_path / "absent"), {}) is None


def test_the_engine_argument_names_read_from_source_are_vllms_fields():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams

    public = {f.name for f in dataclasses.fields(EngineArgs) if not f.name.startswith("_")}
    assert declared.engine_arg_names() == public
    assert declared.sampling_param_names() == {n for n in SamplingParams.__struct_fields__ if not n.startswith("_")}


SAMPLING = [
    {"max_tokens": 4},
    {"temperature": 0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "seed": 3, "stop": ["\n"]},
    {"temperature": -1},
    {"temperature": 2.5},
    {"temperature": float("nan")},
    {"top_p": 0},
    {"top_k": -2},
    {"min_p": 1.5},
    {"max_tokens": 0},
    {"min_tokens": 5, "max_tokens": 2},
    {"presence_penalty": 3},
    {"frequency_penalty": -2.5},
    {"repetition_penalty": 0},
    {"logprobs": -2},
    {"prompt_logprobs": -3},
    {"stop": [""]},
    {"stop": ["x"], "detokenize": False},
    {"stop_token_ids": [1, "2"]},
    {"max_tokenz": 4},
    {"n": 0},
]


@pytest.mark.parametrize("params", SAMPLING, ids=lambda p: json.dumps(p))
def test_sampling_params_are_refused_exactly_when_vllm_refuses_them(params):
    import vllm.exceptions
    from vllm.sampling_params import SamplingParams

    try:
        SamplingParams(**params)
        vllm_refuses = False
    except (TypeError, ValueError, vllm.exceptions.VLLMError):
        vllm_refuses = True
    if vllm_refuses:
        with pytest.raises(JobError, match=r"^sampling_params "):
            checks.check_sampling_params(params)
    else:
        checks.check_sampling_params(params)


def test_unknown_engine_arguments_are_refused_without_vllm_and_nested_configs_by_vllm():
    with pytest.raises(JobError, match=r"unknown vLLM engine argument\(s\) \['max_modle_len'\]"):
        checks.check_engine_kwargs("/m", {"max_modle_len": 256})
    checks.check_engine_kwargs("/m", {"max_model_len": 256, "enforce_eager": True, "task_type": "generate"})
    with pytest.raises(JobError, match=r"engine_kwargs: vLLM refuses .*compilation_config"):
        checks.check_engine_kwargs("/m", {"compilation_config": {"no_such_option": 1}})


HUB_CHECKS = """
import sys
from airflow_provider_rayllm.contract.spec import VLLMProcessorSpec
from airflow_provider_rayllm.job.engines.vllm import chat_template, model_config

repo = sys.argv[1]
print(model_config.model_max_len(repo, {}))
print(model_config.model_labels(repo))
print(chat_template.find(VLLMProcessorSpec(model_source=repo), {}) is not None)
"""


def test_the_drivers_checks_fetch_each_config_file_of_a_hub_model_once(tmp_path):
    """The driver's checks (the longest sequence, a classifier's labels, the chat template) each read the model's
    config files; a Hub (or bucket) model's are fetched once for all of them. The Hub is the tests' loopback one,
    gated, and it logs every request."""
    import secrets
    import shutil
    import subprocess
    import sys
    from collections import Counter

    from airflow_provider_rayllm.local.models import smollm2_path
    from tests.integration.services import hf_hub_server

    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_path() / name, folder / name)
    token = f"hf_{secrets.token_hex(8)}"
    logs = tmp_path / "logs"
    logs.mkdir()
    with hf_hub_server(logs, "rayllm-test/checks", folder, token) as (hub_url, requests_log):
        env = {**os.environ, "HF_ENDPOINT": hub_url, "HF_TOKEN": token, "HF_HOME": str(tmp_path / "hf-home")}
        out = subprocess.run(
            [sys.executable, "-c", HUB_CHECKS, "rayllm-test/checks"], env=env, capture_output=True, text=True
        )
        requests = [json.loads(line) for line in requests_log.read_text().splitlines()]
    assert out.returncode == 0, out.stderr[-3000:]
    length, labels, template = out.stdout.split()
    # The answers are those read from the files (SmolLM2's config and its template), so the fetch worked.
    assert int(length) == json.loads((folder / "config.json").read_text())["max_position_embeddings"]
    assert (labels, template) == ("[]", "True")
    downloads = Counter(
        r["path"].rsplit("/", 1)[-1] for r in requests if r["method"] == "GET" and "/resolve/" in r["path"]
    )
    assert downloads["config.json"] == 1 and downloads["tokenizer_config.json"] == 1, downloads
    assert max(downloads.values()) == 1, downloads
