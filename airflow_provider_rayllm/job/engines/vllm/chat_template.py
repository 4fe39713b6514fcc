"""The model's chat template applied in the request step, where Ray's chat-template stage would start an actor
for it: that actor imports transformers (and torch with it) to render a Jinja template, about 10 CPU-s and a
share of a CPU for the whole job, for microseconds of work a row.

Used for text generation from a model whose folder (local, in a bucket or on the Hub) holds its template as
text: ``chat_template.jinja``, or ``chat_template`` in ``tokenizer_config.json`` (one template, or named ones
with a ``default``), or a template the job gives (``chat_template_stage={"chat_template": ...}``, the guide's
``chat_template``). It renders the way transformers' ``apply_chat_template`` does: Jinja's immutable sandbox
with ``trim_blocks`` and ``lstrip_blocks``, loop controls and the ``generation`` block, ``raise_exception``,
``strftime_now`` and transformers' ``tojson``; the tokenizer's named special tokens and the job's
``chat_template_kwargs`` as variables. As Ray's stage asks, a conversation that ends with the user's message
gets the generation prompt, any other has its last message continued.

Anything else keeps Ray's stage: an image stage, ``trust_remote_code``, a template only a processor file
holds, settings of the stage this module does not know, or no template found.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

from airflow_provider_rayllm.contract.spec import VLLMProcessorSpec
from airflow_provider_rayllm.job.engines.vllm.model_config import read_json, readable_config

# The named special tokens transformers gives a template (its tokenizers' SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Settings of Ray's chat-template stage that mean nothing without its actor (its resources and batching).
ACTOR_SETTINGS = frozenset(
    {"enabled", "batch_size", "concurrency", "num_cpus", "num_gpus", "memory", "runtime_env", "resources"}
)
# What transformers appends to a continued message to find where it ends once rendered.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A chat template and the variables it renders with."""

    source: str
    variables: dict[str, Any]

    def render(self, messages: list[dict[str, Any]]) -> str:
        """The prompt for one conversation (a ``ValueError`` or Jinja's ``TemplateError`` if it cannot be)."""
        if not messages:
            raise ValueError("the conversation has no message")
        template = _compiled(self.source)
        if messages[-1].get("role") == "user":
            return template.render(messages=messages, add_generation_prompt=True, **self.variables)
        return self._continued(template, messages)

    def _continued(self, template: Any, messages: list[dict[str, Any]]) -> str:
        """The conversation rendered with its last message left open (an assistant's prefill, continued)."""
        if "content" not in self.source:
            raise ValueError("the last message is to be continued, but the chat template never reads a content")
        last = dict(messages[-1])
        content = last.get("content")
        if content is None:
            raise ValueError('the last message is to be continued, but it has no "content"')
        if isinstance(content, (list, tuple)):
            parts = [dict(part) for part in content]
            for part in reversed(parts):
                if "text" in part:
                    text = part["text"]
                    part["text"] = text + _CONTINUE_TAG
                    break
            else:
                raise ValueError("the last message is to be continued, but it has no text")
            last["content"] = parts
        else:
            text = content
            last["content"] = content + _CONTINUE_TAG
        rendered = template.render(messages=[*messages[:-1], last], add_generation_prompt=False, **self.variables)
        tag = _CONTINUE_TAG.strip()
        if text.strip() not in rendered or tag not in rendered:
            raise ValueError("the chat template drops part of the last message, which is to be continued")
        at = rendered.rindex(tag)
        if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            return rendered[:at]
        return rendered[:at].rstrip()


@functools.lru_cache(maxsize=8)
def _compiled(source: str) -> Any:
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (which marks the assistant's text for training masks):
        its body, rendered as it is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _token(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])  # a serialized AddedToken
    return None


def special_tokens(folder: str, config: dict[str, Any]) -> dict[str, str]:
    """The tokenizer's named special tokens as transformers reads them: ``config`` (its ``tokenizer_config.json``)'s,
    and where that file lists no ``added_tokens_decoder`` (the older layout), ``special_tokens_map.json``'s over them."""
    layers = [config] if "added_tokens_decoder" in config else [config, read_json(folder, "special_tokens_map.json")]
    tokens: dict[str, str] = {}
    for layer in layers:
        for key in SPECIAL_TOKENS:
            token = _token((layer or {}).get(key))
            if token is not None:
                tokens[key] = token
    return tokens


def model_templates(folder: str, config: dict[str, Any]) -> str | dict[str, str] | None:
    """The folder's chat template(s): ``chat_template.jinja``, else ``config`` (its ``tokenizer_config.json``)'s
    (a string, or named templates)."""
    try:
        with open(os.path.join(folder, "chat_template.jinja"), encoding="utf-8") as handle:
            return handle.read()
    except OSError:
        pass
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if all(isinstance(k, str) and isinstance(v, str) for k, v in named.items()):
            return named  # type: ignore[return-value]
    return None


def choose(templates: str | dict[str, str] | None, given: str | None) -> str | None:
    """transformers' choice: a given template (or the name of one of the model's), else the model's own
    (its ``default`` among named ones)."""
    if isinstance(templates, dict):
        if given is not None:
            return templates.get(given, given)
        return templates.get("default")
    return given if given is not None else templates


def find(spec: VLLMProcessorSpec, engine_kwargs: dict[str, Any]) -> ChatTemplate | None:
    """The job's chat template, to apply in the request step; None where Ray's stage must apply it (see the
    module's docstring)."""
    stage = spec.chat_template_stage
    if spec.task_type != "generate" or stage is False or spec.prepare_multimodal_stage is not False:
        return None
    if engine_kwargs.get("trust_remote_code"):
        return None
    settings = dict(stage) if isinstance(stage, dict) else {}
    if settings.get("enabled", True) is False:
        return None
    given = settings.pop("chat_template", None)
    model = settings.pop("model_source", None) or spec.model_source
    if set(settings) - ACTOR_SETTINGS or not (given is None or isinstance(given, str)):
        return None
    with readable_config(model, engine_kwargs, extra=("special_tokens_map.json", "chat_template.jinja")) as folder:
        if folder is None:
            return None
        config = read_json(folder, "tokenizer_config.json") or {}
        source = choose(model_templates(folder, config), given)
        if source is None:
            return None
        # What transformers gives every template besides the conversation; the job's kwargs over them.
        variables = {"tools": None, "documents": None, **special_tokens(folder, config)}
        variables.update(spec.chat_template_kwargs or {})
    try:
        _compiled(source)
        names = _variables_read(source)
    except Exception:  # a template this Jinja cannot parse: Ray's stage says why, row by row
        return None
    if any(name in names and name not in variables for name in SPECIAL_TOKENS):
        return None  # a token the tokenizer's class may default (no file names it): transformers knows it
    return ChatTemplate(source=source, variables=variables)


def _variables_read(source: str) -> set[str]:
    import jinja2.meta

    return set(jinja2.meta.find_undeclared_variables(_compiled(source).environment.parse(source)))
