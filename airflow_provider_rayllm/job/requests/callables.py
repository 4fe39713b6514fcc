"""The user's callables (preprocess, postprocess): by import path, or pickled by the Airflow worker."""

from __future__ import annotations

import importlib
import os
from typing import Any, Callable

from airflow_provider_rayllm.contract.spec import CallableRef
from airflow_provider_rayllm.job.errors import JobError


def load_callable(ref: CallableRef, package_dir: str) -> Callable[[dict], dict]:
    if ref.import_path:
        module_name, _, attr = ref.import_path.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise JobError(f"cannot import callable {ref.import_path!r} on the cluster: {exc}") from exc
        return obj
    import cloudpickle

    path = os.path.join(package_dir, str(ref.pickled))
    try:
        with open(path, "rb") as handle:
            return cloudpickle.load(handle)
    except Exception as exc:
        raise JobError(
            f"cannot load the pickled callable {ref.pickled!r}: {exc}. Callables pickled by the Airflow "
            "worker need the same Python version and the modules they use on the cluster"
        ) from exc
