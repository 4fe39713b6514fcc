"""The worker setup hook resolves, and Ray 2.60's import of a module vLLM 0.32 moved finds it."""

from __future__ import annotations

import importlib

import pytest


def test_the_setup_hook_named_in_the_runtime_env_is_importable():
    from airflow_provider_rayllm.contract.names import SETUP_HOOK

    module, _, name = SETUP_HOOK.rpartition(".")
    assert callable(getattr(importlib.import_module(module), name))


def test_ray_finds_vllms_moved_chat_utils_under_its_old_name():
    from airflow_provider_rayllm.job import compat

    compat.install()
    compat.install()  # a second call adds no second finder
    assert sum(isinstance(f, compat._Alias) for f in __import__("sys").meta_path) == 1
    from vllm.entrypoints.chat_utils import parse_chat_messages_async  # what Ray 2.60's multimodal stage imports

    assert (
        parse_chat_messages_async
        is importlib.import_module(compat.MOVED["vllm.entrypoints.chat_utils"]).parse_chat_messages_async
    )


_ENGINE_PROCESS = """
import json, os, subprocess
from airflow_provider_rayllm.job import compat
compat.install()
# What vLLM's CPU platform sets (and what it forces in a Ray actor): spawn.
os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
from vllm.utils import system_utils
methods = [system_utils.get_mp_context().get_start_method()]
os.environ.pop(compat.FORK_ENV)
methods.append(system_utils.get_mp_context().get_start_method())
started = []
run = subprocess.run
subprocess.run = lambda *args, **kwargs: started.append(" ".join(args[0])) or run(*args, **kwargs)
from vllm.model_executor.models.registry import ModelRegistry
info = ModelRegistry._try_inspect_model_cls("LlamaForCausalLM")
cached = sorted(os.listdir(os.path.join(os.environ["VLLM_CACHE_ROOT"], "modelinfos")))
print(json.dumps([methods, [c for c in started if compat.REGISTRY in c], info.is_text_generation_model, cached]))
"""


@pytest.fixture(scope="module")
def engine_process(tmp_path_factory) -> list:
    """What a one-worker CPU engine's actor sees (FORK_ENV set, an empty vLLM cache root): the start methods of
    vLLM's multiprocessing context with FORK_ENV and without, vLLM's registry subprocesses started while it inspects a
    model's class, what it learnt, and what its cache root holds after."""
    import json
    import os
    import subprocess
    import sys

    from airflow_provider_rayllm.job.compat import FORK_ENV

    env = {**os.environ, FORK_ENV: "1", "VLLM_CACHE_ROOT": str(tmp_path_factory.mktemp("vllm-cache"))}
    done = subprocess.run([sys.executable, "-c", _ENGINE_PROCESS], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_vllms_engine_core_is_forked_only_where_the_engines_settings_ask(engine_process):
    """Imported with FORK_ENV set (a one-worker CPU engine's actor), vLLM's multiprocessing context is fork;
    the same process without it gets vLLM's own choice (spawn)."""
    assert engine_process[0] == ["fork", "spawn"], engine_process[0]


def test_on_the_cpu_vllm_inspects_a_models_class_in_the_engines_process(engine_process):
    """vLLM inspects a model's class in a subprocess that imports torch and vLLM again; on its CPU platform the
    engine's own process does it, and vLLM still keeps the answer in its cache root."""
    _, started, generates, cached = engine_process
    assert started == [], f"vLLM started {started} to inspect the model's class"
    assert generates is True
    assert cached == ["vllm-model_executor-models-llama-LlamaForCausalLM.json"], cached


def test_off_the_cpu_vllms_own_subprocess_inspects_unless_the_engine_core_is_forked(monkeypatch):
    """On a GPU, the engine's process inspects only where its engine core is to be forked (the fork itself asks
    that CUDA be uninitialised there); anywhere else vLLM's subprocess does, as vLLM would."""
    from vllm.platforms import current_platform

    from airflow_provider_rayllm.job import compat

    calls = []
    inspect = compat._in_process_where_safe(lambda fn: calls.append(fn) or "from vLLM's subprocess")
    monkeypatch.delenv(compat.FORK_ENV, raising=False)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    assert inspect(lambda: "in this process") == "from vLLM's subprocess" and len(calls) == 1
    monkeypatch.setenv(compat.FORK_ENV, "1")
    assert inspect(lambda: "in this process") == "in this process" and len(calls) == 1
    monkeypatch.delenv(compat.FORK_ENV)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: True)
    assert inspect(lambda: "in this process") == "in this process" and len(calls) == 1


_DRIVER_IMPORTS = """
import json, logging, sys
from airflow_provider_rayllm.job import compat
compat.install_driver()
from ray.llm._internal.batch.stages import vllm_engine_stage  # what building Ray's vLLM processor imports
from ray.llm._internal.common import errors
from ray.llm._internal.common.utils import download_utils
vllm = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
torch = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
home = download_utils.torch.hub._get_torch_home()  # what download_model_files asks (the driver calls it)
torch_after = "torch" in sys.modules
print(json.dumps([vllm, list(errors.VLLM_FATAL_ERRORS), torch, home, torch_after]))
"""


def test_the_driver_builds_rays_vllm_stage_without_importing_vllm_or_torch():
    """Ray's stage module imports its errors module, which imports all of vLLM for two exception types, and
    torch (itself and through its download module, which names torch's cache folder): the driver loads the
    first with vLLM refused (empty tuples) and the others with a stand-in torch (the folder named as torch
    names it); the engine actors, which import them with plain ``install``, keep vLLM's types and torch."""
    import json
    import os
    import subprocess
    import sys

    from airflow_provider_rayllm.job import compat

    for env in ({}, {"TORCH_HOME": "/srv/torch-home"}, {"XDG_CACHE_HOME": "/srv/cache"}):
        run_env = {k: v for k, v in os.environ.items() if k not in ("TORCH_HOME", "XDG_CACHE_HOME")} | env
        done = subprocess.run(
            [sys.executable, "-c", _DRIVER_IMPORTS], capture_output=True, text=True, timeout=300, env=run_env
        )
        assert done.returncode == 0, done.stderr[-2000:]
        vllm, fatal, torch, home, torch_after = json.loads(done.stdout.strip().splitlines()[-1])
        assert (vllm, fatal, torch, torch_after) == ([], [], [], False)
        real = subprocess.run(
            [sys.executable, "-c", "import torch.hub; print(torch.hub._get_torch_home())"],
            capture_output=True,
            text=True,
            timeout=300,
            env=run_env,
            check=True,
        ).stdout.strip()
        assert home == real, (env, home, real)

    compat.install()  # what the engine actors' setup hook runs
    assert not any(isinstance(f, (compat._ErrorsWithoutVllm, compat._WithLazyTorch)) for f in sys.meta_path)
    compat.install_driver()  # and in a process that has vLLM loaded, the types are vLLM's, torch is torch
    import torch
    import vllm.v1.engine.exceptions

    sys.modules.pop(compat.RAY_ERRORS, None)
    errors = importlib.import_module(compat.RAY_ERRORS)
    assert errors.VLLM_FATAL_ERRORS == (vllm.v1.engine.exceptions.EngineDeadError,)
    for name in compat.RAY_TORCH_NAMERS:
        sys.modules.pop(name, None)
        assert importlib.import_module(name).torch is torch
    drivers = (compat._ErrorsWithoutVllm, compat._WithLazyTorch)
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, drivers)]


_CONFIG_ONLY = """
import inspect, json, sys
from airflow_provider_rayllm.job import compat
from airflow_provider_rayllm.local.models import smollm2_path
folder = str(smollm2_path())
with compat.config_only_transformers():
    import transformers  # what Ray's vLLM processor builder does for its telemetry read
    light = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=False).architectures
    inspect.getmodule(compile("1", "<probe>", "eval"))  # reads every module's __file__ (torch does): no load
    loaded_by_then = type(sys.modules["transformers"]).__name__
    tokenizer = transformers.AutoTokenizer  # any other name: the real package
inside = type(sys.modules["transformers"]).__name__
real = transformers.AutoConfig.from_pretrained(folder).architectures
print(json.dumps([light, loaded_by_then, tokenizer.__module__.split(".")[0], inside, real]))
"""


def test_rays_telemetry_read_of_the_model_config_needs_no_transformers():
    """Inside ``config_only_transformers`` ``AutoConfig`` answers the architecture from the folder's
    config.json (the same as transformers' own), introspection does not load the package, and any other
    name loads and returns the real one."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _CONFIG_ONLY], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    light, loaded_by_then, tokenizer_package, inside, real = json.loads(done.stdout.strip().splitlines()[-1])
    assert light == real and real, (light, real)
    assert loaded_by_then == "_ConfigOnlyTransformers"
    assert tokenizer_package == "transformers" and inside != "_ConfigOnlyTransformers"
