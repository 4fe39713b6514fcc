"""What the stream's stages share: the columns the job carries through Ray's stages, the CPU share of the
light stages, and row values as plain Python."""

from __future__ import annotations

import math
from typing import Any

# Columns the job carries through Ray's stages. The input columns a row keeps travel as one column
# (KEPT_INPUT), so the engine's own output columns (``prompt``, ``messages``...) cannot overwrite them.
KEPT_INPUT = "__rayllm_in"
REQUEST = "__rayllm_request"
PRE_ERROR = "__rayllm_pre_error"
# Ray's own column for a row that failed (its engine stages pass such rows through untouched); our
# request step and our HTTP callers use it too, so every engine's failed rows look alike.
ERROR = "__inference_error__"

# Our light stages (requests, callers, writes) take a fifth of a CPU: at a whole CPU each they would wait
# behind the engine's stage actors on a small cluster, and deadlock a 2-core one.
LIGHT: dict[str, Any] = {"num_cpus": 0.2}


def light_tasks(replicas: int) -> dict[str, Any]:
    """Map arguments of a light task stage beside an engine of ``replicas`` actors: a fifth of a CPU, and at
    most as many tasks at once as the engine has replicas (answers come from no more places than that). At a
    fifth of a CPU, several tasks of a stage would run at once, and Ray starts a worker process for each
    (about 2 CPU-s apiece) to handle a few rows. Stages with the same arguments fuse into one task."""
    import ray.data

    return {**LIGHT, "compute": ray.data.TaskPoolStrategy(size=replicas)}


# Ray Data restarts a dead map actor for ever by default (max_restarts=-1), so an actor that dies on every
# start (a bad image, a crash in its constructor) would hold the job without an end. A few restarts still
# ride out a killed worker or a dead engine (Ray's vLLM stage exits its actor to get a fresh engine).
ACTOR_RETRIES: dict[str, Any] = {"max_restarts": 3, "max_task_retries": 3}


def is_empty(value: Any) -> bool:
    # A JSON null or an empty CSV cell can arrive as None or as NaN, depending on the reader.
    return value is None or (isinstance(value, float) and math.isnan(value))


def count(value: Any) -> int:
    """A token count from a row (None or NaN where a row has none) as an int."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return 0
    return int(number) if math.isfinite(number) else 0


def to_python(value: Any) -> Any:
    """numpy values (what Ray's blocks hold) as plain Python, for files and user code."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {k: to_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_python(v) for v in value]
    return value
