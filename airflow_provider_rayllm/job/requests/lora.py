"""Which model a row asks for: the base model, or a LoRA adapter by name."""

from __future__ import annotations

import os
from typing import Any

from airflow_provider_rayllm.job.stream import is_empty


class LoraRouting:
    """Which model a row asks for: the base model, or a LoRA adapter by name.

    Ray's engine stage reads the row's ``model``: the base model's source means no adapter; an adapter
    under a bucket is named and downloaded by Ray; a local adapter is given by its folder.
    """

    def __init__(self, model_source: str, adapters_path: str, allowed: list[str] | None):
        self.model_source = model_source
        self.adapters_path = adapters_path.rstrip("/")
        self.local = "://" not in adapters_path
        self.allowed = set(allowed) if allowed is not None else None

    def model_for(self, name: Any) -> str:
        if is_empty(name) or name == "":
            return self.model_source
        if not isinstance(name, str):
            raise ValueError(f"LoRA adapter column holds {type(name).__name__}, not a name")
        if self.allowed is not None and name not in self.allowed:
            raise ValueError(f"LoRA adapter {name!r} is not one of lora_adapters {sorted(self.allowed)!r}")
        if "/" in name or name.startswith("."):
            raise ValueError(f"LoRA adapter name {name!r} must be a plain folder name")
        return os.path.join(self.adapters_path, name) if self.local else name
