"""Module names that moved between the Ray and vLLM versions we run on, resolved on first import.

Ray 2.60's multimodal stage (the guide's ``has_image=True``) imports ``vllm.entrypoints.chat_utils``;
vLLM 0.32 moved that module to ``vllm.renderers.chat_utils`` with the same ``parse_chat_messages_async``.
Without the alias every image row fails with "No module named 'vllm.entrypoints.chat_utils'". The alias
is lazy (nothing is imported until Ray asks for the old name) and only used when the old name is gone.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

MOVED = {"vllm.entrypoints.chat_utils": "vllm.renderers.chat_utils"}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a moved module under its old name by loading it under the new one."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        new = MOVED.get(fullname)
        if new is None:
            return None
        # Only when the old module really is gone (a vLLM that still has it keeps its own).
        sys.meta_path.remove(self)
        try:
            if importlib.util.find_spec(fullname) is not None:
                return None
        except ImportError:
            pass
        finally:
            sys.meta_path.insert(0, self)
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: Any) -> None:
        sys.modules[module.__name__] = module


def install() -> None:
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
