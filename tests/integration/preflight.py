"""The job driver's preflight (every check it makes before an engine starts) on each job package folder
given, in one Ray driver connected to the test cluster: one vLLM import for all of them instead of one per
submitted job. Prints one JSON line per folder: {"folder": ..., "error": the JobError's text or null,
"heavy": the heavy modules (vllm, torch) this process has imported so far}. With --build, a folder whose
checks pass then has its engine's Ray processor built (what the job's driver does next; nothing runs) and
its line adds "built": the heavy modules (vllm, torch, transformers) imported by then.

    python tests/integration/preflight.py [--build] FOLDER [FOLDER ...]   (RAY_ADDRESS and the cluster's auth in env)
"""

from __future__ import annotations

import json
import os
import sys

HEAVY = ("vllm", "torch")
BUILT_HEAVY = (*HEAVY, "transformers")


def main(folders: list[str]) -> int:
    import ray
    import ray.data

    from airflow_provider_rayllm.contract.names import SPEC_FILE
    from airflow_provider_rayllm.contract.spec import SpecError, parse_spec
    from airflow_provider_rayllm.job import compat, driver
    from airflow_provider_rayllm.job.errors import JobError

    build = folders[:1] == ["--build"]
    folders = folders[1:] if build else folders
    compat.install_driver()  # as the job's driver: entrypoint.py installs it first
    ray.init(log_to_driver=False)
    for folder in folders:
        with open(os.path.join(folder, SPEC_FILE), encoding="utf-8") as handle:
            spec = parse_spec(handle.read())
        try:
            _, _, engine = driver.preflight(spec, folder)
            error = None
        except (JobError, SpecError) as exc:
            error = str(exc)
        line = {"folder": folder, "error": error, "heavy": sorted(name for name in HEAVY if name in sys.modules)}
        if build and error is None:
            engine.apply(ray.data.from_items([{"id": 1}]))  # lazy: the processor is built, nothing runs
            line["built"] = sorted(name for name in BUILT_HEAVY if name in sys.modules)
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
