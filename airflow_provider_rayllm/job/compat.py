"""What the Ray and vLLM versions we run on need of us, applied lazily on first import.

Ray 2.60's multimodal stage (the guide's ``has_image=True``) imports ``vllm.entrypoints.chat_utils``;
vLLM 0.32 moved that module to ``vllm.renderers.chat_utils`` with the same ``parse_chat_messages_async``.
Without the alias every image row fails with "No module named 'vllm.entrypoints.chat_utils'". The alias
is lazy (nothing is imported until Ray asks for the old name) and only used when the old name is gone.

Ray's engine stage runs vLLM's async engine, whose engine core is always a process of its own, and vLLM
starts it with ``spawn`` inside a Ray actor (and on every CPU platform): the new process imports torch and
vLLM again, about as long as the actor took to import them. For a one-worker engine (no worker processes of
its own, no Ray executor) the engine's settings set ``FORK_ENV``: the engine core is then forked from the
actor, with everything the actor imported already loaded. On a GPU the actor has not touched CUDA by then
(the engine core is the first to); where it has, vLLM's spawn stands, since a forked child cannot use a
CUDA context it inherits.

vLLM learns what a model's class supports (``inspect_model_cls``) in a subprocess of its own, so that
importing the model's module cannot initialise CUDA in the engine's process; it keeps the answer in its cache
root (``modelinfos/``) and asks again under every new root. That subprocess imports torch and vLLM once more
for each architecture and cache root: about 9.5 CPU-s on a 2-core node, about 25 s of a cold job's start on an
H100 node. ``install`` has the inspection run in the engine's process, which has imported both already, where
nothing is lost by it: on vLLM's CPU platform (no CUDA), and in an actor whose engine core is to be forked
(``FORK_ENV``), where the fork already asks that CUDA be uninitialised and falls back to vLLM's spawn if it is
not. Anywhere else vLLM's subprocess stands.

The job's driver builds Ray's processor, whose vLLM stage module imports Ray's ``common.errors``; that module
imports vLLM (torch, transformers and vLLM's own modules: 8-30 s on a CPU node) only to name the engine's
fatal error types, which matter in the engine actors alone. ``install_driver`` loads it in the driver with
vLLM's imports refused (the module keeps empty tuples then, as on a node without vLLM); the actors import it
themselves, with vLLM.

Two more of Ray's modules import torch for what only the engine actors do: its model-download module
(``download_model_files`` asks ``torch.hub`` where torch's cache is, to make its ``kernels`` folder; the driver
calls it once, to read the model's config for the telemetry below) and its vLLM stage module (which turns
bf16 embeddings into float32). In the driver torch's import cost about 2 CPU-s and as many seconds before
the first engine was asked for. ``install_driver`` loads both with ``_LazyTorch`` as their ``torch``: torch's
cache folder named without torch, and any other name loading the real package. The actors import the
modules themselves, with torch.

The same builder imports transformers in the driver only to read the model's architecture for Ray's usage
telemetry (``AutoConfig.from_pretrained``, inside a ``try``): transformers' import and its config classes cost
the driver about 4.5 CPU-s and as many seconds before the first engine is asked for.
``config_only_transformers`` stands in for the package while the processor is built: its ``AutoConfig``
reads a local folder's ``config.json`` (Ray reports the same architecture); a model id, or any other name,
loads the real package.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.util
import multiprocessing
import os
import sys
import types
from typing import Any, Iterator

MOVED = {"vllm.entrypoints.chat_utils": "vllm.renderers.chat_utils"}
# Ray's module that imports vLLM only for its error types (see the module's docstring).
RAY_ERRORS = "ray.llm._internal.common.errors"
# Ray's modules that import torch for what only the engine actors do (see the module's docstring).
RAY_DOWNLOADS = "ray.llm._internal.common.utils.download_utils"
RAY_VLLM_STAGE = "ray.llm._internal.batch.stages.vllm_engine_stage"
RAY_TORCH_NAMERS = (RAY_DOWNLOADS, RAY_VLLM_STAGE)
# Set (to "1") in a one-worker engine's runtime_env: its engine core is forked, not spawned.
FORK_ENV = "RAYLLM_FORK_ENGINE_CORE"
SYSTEM_UTILS = "vllm.utils.system_utils"
# vLLM's model registry, whose ``_run_in_subprocess`` inspects a model's class (see the module's docstring).
REGISTRY = "vllm.model_executor.models.registry"


def _forks_engine_core() -> bool:
    """This process is a one-worker engine's actor whose engine core is to be forked (``FORK_ENV``)."""
    return os.environ.get(FORK_ENV) == "1"


def _forking(original: Any) -> Any:
    """vLLM's ``get_mp_context``, answering ``fork`` where ``FORK_ENV`` asks for it and CUDA is not in use."""

    def get_mp_context() -> Any:
        context = original()
        if not _forks_engine_core() or "torch.cuda" in sys.modules and _cuda_initialized():
            return context
        return multiprocessing.get_context("fork")

    return get_mp_context


def _cuda_initialized() -> bool:
    import torch

    return bool(torch.cuda.is_initialized())


def _titling(original: Any, module: Any) -> Any:
    """vLLM's ``set_process_title``, which in a process forked from a Ray worker leaves Ray's title (the
    ``setproctitle`` package cannot find the command line Ray rewrote): there the title is set the way Ray sets
    its own, so the engine core still shows as ``VLLM::EngineCore`` to ``ps`` and monitoring."""

    def set_process_title(name: str, suffix: str = "", prefix: str | None = None) -> None:
        if prefix is None:
            original(name, suffix)
            prefix = module.envs.VLLM_PROCESS_NAME_PREFIX
        else:
            original(name, suffix, prefix)
        try:
            import setproctitle

            if setproctitle.getproctitle():
                return
        except ImportError:
            pass
        raylet = sys.modules.get("ray._raylet")
        if raylet is not None and hasattr(raylet, "setproctitle"):
            raylet.setproctitle(f"{prefix}::{name}_{suffix}" if suffix else f"{prefix}::{name}")

    return set_process_title


class _Wrapping(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds one module as the other finders would and loads it through ``exec_module`` (a subclass's), which
    runs the module's own loader and does its work before or after."""

    def wants(self, fullname: str) -> bool:
        raise NotImplementedError

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not self.wants(fullname):
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)


class _Patched(_Wrapping):
    """Loads vLLM's ``system_utils`` as usual, then puts ``_forking`` around its ``get_mp_context`` (and
    ``_titling`` around ``set_process_title``) before any other vLLM module imports the names."""

    def wants(self, fullname: str) -> bool:
        return fullname == SYSTEM_UTILS and _forks_engine_core()

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        if hasattr(module, "get_mp_context"):
            module.get_mp_context = _forking(module.get_mp_context)
        if hasattr(module, "set_process_title"):
            module.set_process_title = _titling(module.set_process_title, module)


def _in_process_where_safe(original: Any) -> Any:
    """vLLM's ``_run_in_subprocess``, running ``fn`` in this process on vLLM's CPU platform and where the engine
    core is to be forked (see the module's docstring), in vLLM's subprocess anywhere else."""

    def run_in_subprocess(fn: Any) -> Any:
        from vllm.platforms import current_platform

        if current_platform.is_cpu() or _forks_engine_core():
            return fn()
        return original(fn)

    return run_in_subprocess


class _InspectInProcess(_Wrapping):
    """Loads vLLM's model registry as usual, then puts ``_in_process_where_safe`` around its
    ``_run_in_subprocess``."""

    def wants(self, fullname: str) -> bool:
        return fullname == REGISTRY

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        if hasattr(module, "_run_in_subprocess"):
            module._run_in_subprocess = _in_process_where_safe(module._run_in_subprocess)


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


class _RefuseVllm(importlib.abc.MetaPathFinder):
    """Refuses vLLM's modules while it is on ``sys.meta_path``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname == "vllm" or fullname.startswith("vllm."):
            raise ImportError(f"{fullname} is not imported by the job's driver", name=fullname)
        return None


class _ErrorsWithoutVllm(_Wrapping):
    """Loads ``RAY_ERRORS`` with vLLM's imports refused, unless vLLM is loaded already (then as it is)."""

    def wants(self, fullname: str) -> bool:
        return fullname == RAY_ERRORS and "vllm" not in sys.modules

    def exec_module(self, module: Any) -> None:
        refuse = _RefuseVllm()
        sys.meta_path.insert(0, refuse)
        try:
            self._loader.exec_module(module)
        finally:
            sys.meta_path.remove(refuse)


def _torch_home() -> str:
    """Where torch keeps its cache: ``$TORCH_HOME``, else ``torch`` under ``$XDG_CACHE_HOME`` (``~/.cache``)."""
    cache = os.getenv("XDG_CACHE_HOME", os.path.join("~", ".cache"))
    return os.path.expanduser(os.getenv("TORCH_HOME", os.path.join(cache, "torch")))


def _real_torch() -> Any:
    if isinstance(sys.modules.get("torch"), _LazyTorch):
        del sys.modules["torch"]
    return importlib.import_module("torch")


class _LazyTorch(types.ModuleType):
    """A ``torch`` whose ``hub._get_torch_home`` needs no torch; any other name loads the real package."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.hub = types.SimpleNamespace(_get_torch_home=_torch_home)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # what introspection asks every module
            raise AttributeError(name)
        return getattr(_real_torch(), name)


class _WithLazyTorch(_Wrapping):
    """Loads ``RAY_TORCH_NAMERS`` with ``_LazyTorch`` as their ``torch`` unless the real torch is loaded already
    (then as they are)."""

    def wants(self, fullname: str) -> bool:
        return fullname in RAY_TORCH_NAMERS and not _torch_loaded()

    def exec_module(self, module: Any) -> None:
        stand_in = sys.modules.get("torch")
        ours = not isinstance(stand_in, _LazyTorch)  # an outer load may have put it there already
        if ours:
            stand_in = sys.modules["torch"] = _LazyTorch()
        try:
            self._loader.exec_module(module)
        finally:
            if ours and sys.modules.get("torch") is stand_in:
                del sys.modules["torch"]


def _torch_loaded() -> bool:
    return "torch" in sys.modules and not isinstance(sys.modules["torch"], _LazyTorch)


def _real_transformers() -> Any:
    if isinstance(sys.modules.get("transformers"), _ConfigOnlyTransformers):
        del sys.modules["transformers"]
    return importlib.import_module("transformers")


class _FolderConfig:
    """``AutoConfig`` for Ray's telemetry read: a local folder's architectures, without transformers."""

    @staticmethod
    def from_pretrained(path: Any, *args: Any, **kwargs: Any) -> Any:
        from airflow_provider_rayllm.job.engines.vllm.model_config import read_json

        architectures = (read_json(str(path), "config.json") or {}).get("architectures")
        if isinstance(architectures, list):
            return types.SimpleNamespace(architectures=architectures)
        return _real_transformers().AutoConfig.from_pretrained(path, *args, **kwargs)


class _ConfigOnlyTransformers(types.ModuleType):
    """A ``transformers`` whose ``AutoConfig`` is ``_FolderConfig``; any other name loads the real package."""

    def __init__(self) -> None:
        super().__init__("transformers")
        self.AutoConfig = _FolderConfig

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # what introspection asks every module (inspect.getmodule reads __file__)
            raise AttributeError(name)
        return getattr(_real_transformers(), name)


@contextlib.contextmanager
def config_only_transformers() -> Iterator[None]:
    """While Ray's processor is built in the driver: ``transformers`` is ``_ConfigOnlyTransformers`` unless
    the real package is loaded already (see the module's docstring)."""
    if "transformers" in sys.modules:
        yield
        return
    stand_in = _ConfigOnlyTransformers()
    sys.modules["transformers"] = stand_in
    try:
        yield
    finally:
        if sys.modules.get("transformers") is stand_in:
            del sys.modules["transformers"]


def install_driver() -> None:
    """``install``, Ray's error types loaded without vLLM and its torch-naming modules without torch: for the
    job's driver process only."""
    install()
    for finder in (_ErrorsWithoutVllm, _WithLazyTorch):
        if not any(isinstance(f, finder) for f in sys.meta_path):
            sys.meta_path.insert(0, finder())


def install() -> None:
    for finder in (_Alias, _Patched, _InspectInProcess):
        if not any(isinstance(f, finder) for f in sys.meta_path):
            sys.meta_path.insert(0, finder())
