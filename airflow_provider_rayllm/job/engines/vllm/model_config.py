"""What the model's own config files say (its longest sequence, a classifier's labels), read as JSON before
any engine starts, the way vLLM reads them, without importing vLLM or torch (tens of seconds in the driver);
a bucket model's files are copied to a temp folder for it, a Hub model's are fetched."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from airflow_provider_rayllm.contract.spec import is_local_path, uri_scheme

log = logging.getLogger("airflow_provider_rayllm.job")


# vLLM's keys for a model's longest sequence, the smallest present winning (its
# ``derive_max_model_len_and_key``); ``model_max_length`` (Command-R) wins outright when set.
LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# Architectures vLLM runs as generative models; the others (BertModel, ...ForSequenceClassification) pool.
GENERATIVE = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")
# RoPE types whose max_position_embeddings is already scaled; vLLM applies no factor for them.
SCALED_ROPE_TYPES = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def model_max_len(model_source: str, engine_kwargs: dict[str, Any]) -> int | None:
    """The longest sequence the model takes, derived from its config files as vLLM derives it
    (``max_position_embeddings`` and kin, RoPE scaling, the tokenizer's ``model_max_length``, a
    sentence-transformers ``max_seq_length``); None when the files say nothing about it or cannot be read:
    the engine then judges ``max_model_len`` itself."""
    if is_local_path(model_source) and not os.path.isdir(os.path.expanduser(model_source.removeprefix("file://"))):
        return None  # check_model_source names it
    with readable_config(model_source, engine_kwargs) as folder:
        config = read_json(folder, "config.json")
        if config is None:
            log.warning("could not read %s's config.json; max_model_len is not capped", model_source)
            return None
        overrides = engine_kwargs.get("hf_overrides")
        if isinstance(overrides, dict):
            config = {**config, **overrides}
        return derive_max_len(
            config,
            read_json(folder, "tokenizer_config.json"),
            read_json(folder, "sentence_bert_config.json"),
            sliding_window_off=bool(engine_kwargs.get("disable_sliding_window")),
        )


def derive_max_len(
    config: dict[str, Any],
    tokenizer_config: dict[str, Any] | None = None,
    encoder_config: dict[str, Any] | None = None,
    sliding_window_off: bool = False,
) -> int | None:
    """vLLM's ``_get_and_verify_max_len`` (0.32) over plain dicts, for a model whose config names a length."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    found = [float(text[k]) for k in LENGTH_KEYS if isinstance(text.get(k), (int, float))]
    if isinstance(text.get("model_max_length"), (int, float)) and text["model_max_length"]:
        found = [float(text["model_max_length"])]
    length = min(found) if found else float("inf")
    window = text.get("sliding_window")
    if sliding_window_off and isinstance(window, int) and window < length:
        length = float(window)
    # vLLM reads the tokenizer's limit only for pooling models with absolute position embeddings.
    pooling = not any(str(a).endswith(GENERATIVE) for a in config.get("architectures") or [])
    absolute = config.get("position_embedding_type") == "absolute"
    if pooling and absolute and tokenizer_config and isinstance(tokenizer_config.get("model_max_length"), (int, float)):
        length = min(length, float(tokenizer_config["model_max_length"]))
    if length == float("inf"):
        return None  # vLLM would assume 2,048 and warn; leave the judgement to it
    rope = [p for p in _rope_parameters(config) if p]
    if rope and "gemma3" not in str(config.get("model_type", "")):
        factor = 1.0
        for params in rope:
            kind = params.get("rope_type", params.get("type"))
            if kind not in SCALED_ROPE_TYPES:
                factor = params.get("factor", factor)
        length *= factor if factor is not None else 1.0
    if encoder_config and "max_seq_length" in encoder_config:
        length = float(encoder_config["max_seq_length"])
    return int(length)


def _rope_parameters(config: dict[str, Any]) -> list[dict[str, Any]]:
    """A config's RoPE settings, one dict per layer type when nested; the older ``rope_scaling`` key too."""
    params = config.get("rope_parameters") or config.get("rope_scaling")
    if not isinstance(params, dict):
        return []
    nested = [p for p in params.values() if isinstance(p, dict)]
    return nested if nested and len(nested) == len(params) else [params]


def model_labels(model_source: str) -> list[str] | None:
    """A sequence-classification model's class names, in output order (its config's ``id2label``); None
    when the config has none or cannot be read."""
    with readable_config(model_source, {}) as folder:
        id2label = (read_json(folder, "config.json") or {}).get("id2label") or {}
        try:
            return [str(id2label[str(i)]) for i in range(len(id2label))]
        except KeyError:
            return None


def read_json(folder: str | None, name: str) -> dict[str, Any] | None:
    """A JSON object file of a model folder; None if it is missing, unreadable or not an object."""
    if folder is None:
        return None
    try:
        with open(os.path.join(folder, name), encoding="utf-8") as handle:
            value = json.load(handle)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


class _Copy:
    """A bucket or Hub model's config files copied into one temp folder, and the names already asked for (a
    file the source lacks is asked for once too). Removed when the process ends (the job's driver is one)."""

    def __init__(self) -> None:
        import tempfile

        self.tmp = tempfile.TemporaryDirectory(prefix="rayllm-config-")
        self.asked: set[str] = set()


# One copy per (model, revision) in this process: the driver's checks (the longest sequence, a classifier's
# labels, the chat template) each read the config files, and a bucket or the Hub is asked for each file once.
_COPIES: dict[tuple[str, Any], _Copy] = {}


class readable_config:
    """The model's config files in a local folder: a local model's own, a bucket model's copied to a temp
    folder, a Hub model's fetched (with the job's HF token and endpoint); None if they cannot be had. A
    bucket's or the Hub's files are copied once per process, whichever check asks first."""

    FILES = ("config.json", "sentence_bert_config.json", "tokenizer_config.json", "generation_config.json")

    def __init__(self, model_source: str, engine_kwargs: dict[str, Any], extra: tuple[str, ...] = ()):
        self.model_source, self.engine_kwargs = model_source, engine_kwargs
        self.files = (*self.FILES, *extra)

    def __enter__(self) -> str | None:
        source = self.model_source
        if is_local_path(source):
            return os.path.expanduser(source.removeprefix("file://"))
        bucket = uri_scheme(source) in ("s3", "gs", "gcs")
        revision = None if bucket else self.engine_kwargs.get("revision")
        copy = _COPIES.get((source, revision))
        if copy is None:
            copy = _COPIES[(source, revision)] = _Copy()
        wanted = [name for name in self.files if name not in copy.asked]
        copy.asked.update(wanted)
        if wanted and bucket:
            self._copy_from_bucket(copy.tmp.name, wanted)
        elif wanted and not self._fetch_from_hub(copy.tmp.name, wanted, revision):
            copy.asked.update(self.FILES)  # no config.json from the Hub: the others are worth no more waiting
        return copy.tmp.name

    def _copy_from_bucket(self, into: str, names: list[str]) -> None:
        from airflow_provider_rayllm.job import filesystems

        # One filesystem (one client and its credentials) for the model's few config files.
        fs, base = filesystems.filesystem_for(self.model_source.rstrip("/"))
        for name in names:
            try:
                with fs.open_input_stream(f"{base}/{name}") as src, open(os.path.join(into, name), "wb") as dst:
                    dst.write(src.read())
            except (OSError, FileNotFoundError):
                continue

    def _fetch_from_hub(self, into: str, names: list[str], revision: Any) -> bool:
        """Fetch ``names``; False when config.json was among them and could not be had."""
        # huggingface_hub imports in a fraction of a second and reads HF_TOKEN / HF_ENDPOINT as vLLM does.
        try:
            from huggingface_hub import hf_hub_download
        except ImportError:
            return False
        for name in names:
            try:
                hf_hub_download(self.model_source, name, revision=revision, local_dir=into)
            except Exception as exc:  # absent file, no network, gated without a token: the engine says more
                log.debug("could not fetch %s of %s from the Hub: %s", name, self.model_source, exc)
                if name == "config.json":
                    return False
        return True

    def __exit__(self, *exc: Any) -> None:
        pass
