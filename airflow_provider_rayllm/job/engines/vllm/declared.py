"""The argument names vLLM declares (its ``EngineArgs`` and ``SamplingParams`` fields), read from the cluster's
installed vLLM source without importing it: ``import vllm`` pulls in torch and costs the driver tens of
seconds, while parsing the two class bodies takes a fraction of one. None when the source cannot be read
(a vLLM installed without its .py files); the caller then asks vLLM itself."""

from __future__ import annotations

import ast
import functools
import importlib.util
import os

# (module path under the vllm package, class): the classes whose fields the user's settings name.
ENGINE_ARGS = (("engine", "arg_utils.py"), "EngineArgs")
SAMPLING_PARAMS = (("sampling_params.py",), "SamplingParams")


def vllm_dir() -> str | None:
    """The installed vllm package's folder; finding it imports nothing (only a submodule's lookup would)."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return locations[0] if locations else None


@functools.cache
def field_names(path: tuple[str, ...], class_name: str) -> frozenset[str] | None:
    """The public fields a class of vLLM declares in its body (annotated names, ``ClassVar`` excepted)."""
    root = vllm_dir()
    if root is None:
        return None
    try:
        with open(os.path.join(root, *path), encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            names = {
                item.target.id
                for item in node.body
                if isinstance(item, ast.AnnAssign)
                and isinstance(item.target, ast.Name)
                and not item.target.id.startswith("_")
                and "ClassVar" not in ast.unparse(item.annotation)
            }
            return frozenset(names) or None
    return None


def engine_arg_names() -> frozenset[str] | None:
    return field_names(*ENGINE_ARGS)


def sampling_param_names() -> frozenset[str] | None:
    return field_names(*SAMPLING_PARAMS)
