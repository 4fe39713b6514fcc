"""What the model's own config says (its longest sequence, a classifier's labels), read before any engine
starts; a bucket model's config files are copied to a temp folder for it."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from airflow_provider_rayllm.contract.spec import is_local_path, uri_scheme

log = logging.getLogger("airflow_provider_rayllm.job")


# Settings that decide how vLLM reads the model's config (and so its own limits).
_MODEL_CONFIG_KEYS = (
    "trust_remote_code",
    "revision",
    "code_revision",
    "tokenizer",
    "tokenizer_revision",
    "hf_overrides",
    "config_format",
    "hf_config_path",
)


def model_max_len(model_source: str, engine_kwargs: dict[str, Any]) -> int | None:
    """The longest sequence the model takes, as vLLM derives it from the model's config
    (``max_position_embeddings``, a sentence-transformers ``max_seq_length``, ...); None if unreadable."""
    if is_local_path(model_source) and not os.path.isdir(os.path.expanduser(model_source.removeprefix("file://"))):
        return None  # check_model_source names it
    from vllm.engine.arg_utils import EngineArgs

    args = {k: engine_kwargs[k] for k in _MODEL_CONFIG_KEYS if k in engine_kwargs}
    with _readable_config(model_source) as source:
        try:
            return int(EngineArgs(model=source, **args).create_model_config().max_model_len)
        except Exception as exc:  # the engine reports its own error later, if it has one
            log.warning(
                "could not read the model's limits from %s (%s: %s); max_model_len is not capped",
                model_source,
                type(exc).__name__,
                str(exc)[:200],
            )
            return None


def model_labels(model_source: str) -> list[str] | None:
    """A sequence-classification model's class names, in output order (its config's ``id2label``); None
    when the config has none or cannot be read."""
    with _readable_config(model_source) as source:
        path = os.path.join(os.path.expanduser(source.removeprefix("file://")), "config.json")
        try:
            with open(path, encoding="utf-8") as handle:
                id2label = json.load(handle).get("id2label") or {}
            return [str(id2label[str(i)]) for i in range(len(id2label))]
        except (OSError, ValueError, KeyError):
            return None


class _readable_config:
    """The model's config files where vLLM can read them: a bucket model's are copied to a temp folder."""

    FILES = ("config.json", "sentence_bert_config.json", "tokenizer_config.json", "generation_config.json")

    def __init__(self, model_source: str):
        self.model_source, self.tmp = model_source, None

    def __enter__(self) -> str:
        if uri_scheme(self.model_source) not in ("s3", "gs", "gcs"):
            return self.model_source
        import tempfile

        from airflow_provider_rayllm.job import filesystems

        self.tmp = tempfile.TemporaryDirectory(prefix="rayllm-config-")
        for name in self.FILES:
            fs, path = filesystems.filesystem_for(filesystems.join(self.model_source.rstrip("/"), name))
            try:
                with fs.open_input_stream(path) as src, open(os.path.join(self.tmp.name, name), "wb") as dst:
                    dst.write(src.read())
            except (OSError, FileNotFoundError):
                continue
        return self.tmp.name

    def __exit__(self, *exc: Any) -> None:
        if self.tmp is not None:
            self.tmp.cleanup()
