"""The worker setup hook resolves, and Ray 2.60's import of a module vLLM 0.32 moved finds it."""

from __future__ import annotations

import importlib


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


_START_METHODS = """
import os
from airflow_provider_rayllm.job import compat
compat.install()
# What vLLM's CPU platform sets (and what it forces in a Ray actor): spawn.
os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
from vllm.utils import system_utils
print(system_utils.get_mp_context().get_start_method())
os.environ.pop(compat.FORK_ENV)
print(system_utils.get_mp_context().get_start_method())
"""


def test_vllms_engine_core_is_forked_only_where_the_engines_settings_ask():
    """Imported with FORK_ENV set (a one-worker CPU engine's actor), vLLM's multiprocessing context is fork;
    the same process without it gets vLLM's own choice (spawn)."""
    import os
    import subprocess
    import sys

    from airflow_provider_rayllm.job.compat import FORK_ENV

    env = {**os.environ, FORK_ENV: "1"}
    out = subprocess.run(
        [sys.executable, "-c", _START_METHODS], env=env, capture_output=True, text=True, timeout=300, check=True
    ).stdout.split()
    assert out[-2:] == ["fork", "spawn"], out
