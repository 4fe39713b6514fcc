"""The job driver's preflight (every check it makes before an engine starts) on each job package folder
given, in one Ray driver connected to the test cluster: one vLLM import for all of them instead of one per
submitted job. Prints one JSON line per folder: {"folder": ..., "error": the JobError's text or null,
"heavy": the heavy modules (vllm, torch) this process has imported so far}. With --plan, a folder that
passes also gets its engine step built into a lazy plan, as the driver builds it before the stream runs.

    python tests/integration/preflight.py [--plan] FOLDER [FOLDER ...]   (RAY_ADDRESS and the cluster's auth in env)
"""

from __future__ import annotations

import json
import os
import sys

HEAVY = ("vllm", "torch")


def main(folders: list[str]) -> int:
    import ray
    import ray.data

    from airflow_provider_rayllm.contract.names import SPEC_FILE
    from airflow_provider_rayllm.contract.spec import SpecError, parse_spec
    from airflow_provider_rayllm.job import compat, driver
    from airflow_provider_rayllm.job.errors import JobError

    plan = folders[:1] == ["--plan"]
    folders = folders[1:] if plan else folders
    compat.install()
    ray.init(log_to_driver=False)
    for folder in folders:
        with open(os.path.join(folder, SPEC_FILE), encoding="utf-8") as handle:
            spec = parse_spec(handle.read())
        try:
            _, _, engine = driver.preflight(spec, folder)
            if plan:
                engine.apply(ray.data.from_items([{"prompt": "hi"}]))
            error = None
        except (JobError, SpecError) as exc:
            error = str(exc)
        heavy = sorted(name for name in HEAVY if name in sys.modules)
        print(json.dumps({"folder": folder, "error": error, "heavy": heavy}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
