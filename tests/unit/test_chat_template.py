"""The chat template applied in the request step renders what Ray's chat-template stage renders (transformers'
``apply_chat_template`` with the stage's arguments), and is used only where it can be."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import pytest

from airflow_provider_rayllm.contract.spec import VLLMProcessorSpec
from airflow_provider_rayllm.job.engines.vllm import chat_template
from airflow_provider_rayllm.job.engines.vllm.processor import unpack_request
from airflow_provider_rayllm.job.stream import ERROR, REQUEST
from airflow_provider_rayllm.local.models import smollm2_path

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Name a colour."}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": 'Tell me a joke about "quotes" & <tags>. Ünïcödé too.'},
    ],
    # An assistant's prefill: Ray's stage continues it instead of opening a new turn.
    [{"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "Autumn moonlight -  "}],
    [{"role": "user", "content": "Spaces at the end   "}, {"role": "assistant", "content": "Sure"}],
]

# Templates a model folder may carry, each exercising a part of transformers' Jinja environment.
TEMPLATES = {
    "chatml_with_system_default": (
        "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "bos_roles_raise_tojson_loopcontrols_generation": (
        "{{ bos_token }}{% for message in messages %}"
        "{% if message['role'] not in ('system', 'user', 'assistant') %}"
        "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
        "{% if message['role'] == 'assistant' %}{% generation %}[A]{{ message['content'] | trim }}{{ eos_token }}"
        "{% endgeneration %}{% else %}[{{ message['role'] | upper }}] {{ message['content'] | tojson }}\n{% endif %}"
        "{% if loop.index > 8 %}{% break %}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}[A]{% endif %}{% if style is defined %}<{{ style }}>{% endif %}"
    ),
    # Block tags on lines of their own, indented: trim_blocks and lstrip_blocks decide every newline here.
    "line_blocks": (
        "{% for message in messages %}\n"
        "  {% if message['role'] == 'system' %}\n"
        "SYSTEM: {{ message['content'] }}\n"
        "  {% else %}\n"
        "{{ message['role'] }}: {{ message['content'] }}\n"
        "  {% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}\n"
        "assistant:\n"
        "{% endif %}"
    ),
}


def _rays_render(tokenizer, conversation, template=None, kwargs=None):
    """What Ray 2.60's ChatTemplateUDF.udf asks of transformers for one row."""
    add_generation_prompt = conversation[-1]["role"] == "user"
    return tokenizer.apply_chat_template(
        conversation,
        tokenize=False,
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=not add_generation_prompt,
        **(kwargs or {}),
    )


def _folder_with(tmp_path: Path, name: str, template) -> Path:
    """SmolLM2's tokenizer files with another template in its tokenizer_config.json (and no .jinja file)."""
    folder = tmp_path / name
    shutil.copytree(smollm2_path(), folder, ignore=shutil.ignore_patterns("*.safetensors", "chat_template.jinja"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _spec(model: Path | str, **settings) -> VLLMProcessorSpec:
    return VLLMProcessorSpec(model_source=str(model), **settings)


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_smollm2s_own_template_renders_as_rays_stage_renders_it(conversation):
    from transformers import AutoTokenizer

    found = chat_template.find(_spec(smollm2_path()), {})
    assert found is not None, "SmolLM2's chat_template.jinja should be applied in the request step"
    assert found.render(conversation) == _rays_render(AutoTokenizer.from_pretrained(smollm2_path()), conversation)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_other_templates_render_as_transformers_renders_them(name, tmp_path):
    from transformers import AutoTokenizer

    folder = _folder_with(tmp_path, name, TEMPLATES[name])
    tokenizer = AutoTokenizer.from_pretrained(folder)
    kwargs = {"style": "terse"}
    found = chat_template.find(_spec(folder, chat_template_kwargs=kwargs), {})
    assert found is not None
    for conversation in CONVERSATIONS:
        assert found.render(conversation) == _rays_render(tokenizer, conversation, kwargs=kwargs), conversation
    if "raise" in name:
        bad = [{"role": "robot", "content": "beep"}]
        with pytest.raises(jinja2.TemplateError, match="unknown role robot"):
            _rays_render(tokenizer, bad)
        with pytest.raises(jinja2.TemplateError, match="unknown role robot"):
            found.render(bad)


def test_named_templates_and_a_given_one_are_chosen_as_transformers_chooses(tmp_path):
    from transformers import AutoTokenizer

    named = [
        {"name": "default", "template": TEMPLATES["chatml_with_system_default"]},
        {"name": "tagged", "template": TEMPLATES["bos_roles_raise_tojson_loopcontrols_generation"]},
    ]
    folder = _folder_with(tmp_path, "named", named)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    conversation = CONVERSATIONS[1]
    by_default = chat_template.find(_spec(folder), {})
    by_name = chat_template.find(_spec(folder, chat_template_stage={"chat_template": "tagged", "batch_size": 8}), {})
    given = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    by_text = chat_template.find(_spec(folder, chat_template_stage={"chat_template": given}), {})
    assert by_default.render(conversation) == _rays_render(tokenizer, conversation)
    assert by_name.render(conversation) == _rays_render(tokenizer, conversation, template="tagged")
    assert by_text.render(conversation) == _rays_render(tokenizer, conversation, template=given)
    assert len({by_default.source, by_name.source, by_text.source}) == 3


def test_rays_stage_stays_where_the_request_step_cannot_render_alike(tmp_path):
    """An image stage, remote code, settings of the stage this step does not know, no template, a template
    naming a special token no file gives (the tokenizer's class may default it), or a template Jinja cannot
    parse: Ray's stage applies it. Embeddings have no chat template at all."""
    model = smollm2_path()
    assert chat_template.find(_spec(model), {}) is not None
    assert chat_template.find(_spec(model, prepare_multimodal_stage=True), {}) is None
    assert chat_template.find(_spec(model), {"trust_remote_code": True}) is None
    assert chat_template.find(_spec(model, chat_template_stage={"some_new_setting": 1}), {}) is None
    assert chat_template.find(_spec(model, chat_template_stage=False), {}) is None
    assert chat_template.find(_spec(model, chat_template_stage={"enabled": False}), {}) is None
    assert chat_template.find(_spec(model, task_type="embed"), {}) is None
    no_template = _folder_with(tmp_path, "none", None)
    assert chat_template.find(_spec(no_template), {}) is None
    unknown_token = _folder_with(tmp_path, "sep", "{{ sep_token }}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert chat_template.find(_spec(unknown_token), {}) is None
    broken = _folder_with(tmp_path, "broken", "{% for m in messages %}{{ m.content }}")
    assert chat_template.find(_spec(broken), {}) is None


def test_the_preprocess_renders_the_prompt_and_a_refused_conversation_is_its_rows_error(tmp_path):
    folder = _folder_with(tmp_path, "raises", TEMPLATES["bos_roles_raise_tojson_loopcontrols_generation"])
    template = chat_template.find(_spec(folder), {})
    good = {"messages": CONVERSATIONS[0], "sampling_params": {"max_tokens": 4}}
    row = unpack_request({REQUEST: json.dumps(good)}, template=template)
    assert row["prompt"] == template.render(CONVERSATIONS[0]) and "messages" not in row and row[ERROR] == ""
    bad = {"messages": [{"role": "robot", "content": "beep"}]}
    assert unpack_request({REQUEST: json.dumps(bad)}, template=template) == {
        ERROR: "chat template: TemplateError: unknown role robot"
    }
    # Without a template (Ray's stage applies it) the messages travel on untouched.
    assert unpack_request({REQUEST: json.dumps(good)})["messages"] == CONVERSATIONS[0]
