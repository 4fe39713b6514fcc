"""``python -m airflow_provider_rayllm.job SPEC_FILE``: load the secrets, read the spec, run the job, and end
with one machine-read line: the manifest, or the error (``RAYLLM_ERROR ...``) the operator quotes."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

from airflow_provider_rayllm.contract.names import ERROR_LOG_PREFIX, REFUSED_LOG_LINE, SWEEP_ENTRYPOINT
from airflow_provider_rayllm.contract.spec import SpecError, UploadJobSpec, parse_spec
from airflow_provider_rayllm.job import secrets
from airflow_provider_rayllm.job.errors import JobError, JobRefused
from airflow_provider_rayllm.job.publish import manifest

log = logging.getLogger("airflow_provider_rayllm.job")

# ``python -m airflow_provider_rayllm.job --sweep-after ID``: see ``sweep_after``.
SWEEP_FLAG = SWEEP_ENTRYPOINT.rsplit(" ", 1)[-1]
SWEEP_LOG_PREFIX = "RAYLLM_SWEPT "
SWEEP_WAIT_S = 90.0
# A stopped job still PENDING after this long will not be stopped by the Jobs API (see secrets.end_pending).
PENDING_GRACE_S = 5.0


def _submission_id() -> str:
    """Our submission id, from the job metadata Ray hands the driver (the operator sets it)."""
    try:
        config = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}"))
        metadata = config.get("metadata") or {}
        return metadata.get("rayllm_submission_id") or metadata.get("job_submission_id") or f"local-{int(time.time())}"
    except json.JSONDecodeError:
        return f"local-{int(time.time())}"


def main(argv: list[str]) -> int:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s rayllm: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    if len(argv) == 2 and argv[0] == SWEEP_FLAG:
        return sweep_after(argv[1])
    if len(argv) != 1:
        print(
            f"{ERROR_LOG_PREFIX}usage: python -m airflow_provider_rayllm.job SPEC_FILE | {SWEEP_FLAG} SUBMISSION_ID",
            flush=True,
        )
        return 2
    spec_path = os.path.abspath(argv[0])
    package_dir = os.path.dirname(spec_path)
    submission_id = _submission_id()
    from airflow_provider_rayllm.job import compat

    compat.install_driver()
    loaded = secrets.load_into_env(package_dir)
    if loaded:
        log.info("secrets loaded into the environment: %s", loaded)
    # Ray stops a job with SIGTERM (and SIGKILL some seconds later): the secrets on this node and the job's
    # package in the cluster's store go at once, then the job ends through the finally below, which removes
    # them from the other nodes.
    signal.signal(signal.SIGTERM, lambda signum, frame: _stopped(package_dir if loaded else None))
    try:
        with open(spec_path, encoding="utf-8") as handle:
            spec = parse_spec(handle.read())
        log.info("submission %s: %s -> %s", submission_id, spec.model_name, spec.output_uri)
        if isinstance(spec, UploadJobSpec):
            from airflow_provider_rayllm.job import upload

            body = upload.run(spec, submission_id)
        else:
            from airflow_provider_rayllm.job import driver

            body = driver.run(spec, submission_id, package_dir)
    except (JobError, SpecError) as exc:
        if isinstance(exc, (JobRefused, SpecError)):
            print(REFUSED_LOG_LINE, flush=True)
        print(f"{ERROR_LOG_PREFIX}{secrets.scrub(str(exc), secrets.secret_values())}", flush=True)
        return 1
    except Exception as exc:  # anything unforeseen still ends with one line the operator can quote
        import traceback

        known = secrets.secret_values()
        print(secrets.scrub(traceback.format_exc(), known), flush=True)
        first_line = (str(exc).strip().splitlines() or [""])[0][:500]
        print(f"{ERROR_LOG_PREFIX}{secrets.scrub(f'{type(exc).__name__}: {first_line}', known)}", flush=True)
        return 1
    finally:
        _wait_for_sweep()
        _cleanup(loaded, package_dir)
    print(manifest.log_line(body), flush=True)
    return 0


def sweep_after(submission_id: str, wait_s: float = SWEEP_WAIT_S) -> int:
    """The job the operator submits from ``on_kill``: once the stopped job has ended (a stopped driver takes up
    to ``RAY_JOB_STOP_WAIT_TIME_S`` for its own cleanup; one stopped while PENDING never ran any), remove what
    ended jobs of ours left on the cluster: their packages in the store (holding ``secrets.json``) and the
    secrets files on every node. It carries no secret of its own."""
    import ray

    ray.init(log_to_driver=False)
    started = time.monotonic()
    status, ended_pending = secrets.job_status(submission_id), False
    while status in ("PENDING", "RUNNING") and time.monotonic() - started < wait_s:
        if status == "PENDING" and not ended_pending and time.monotonic() - started > PENDING_GRACE_S:
            ended_pending = secrets.end_pending(submission_id)
            if ended_pending:
                log.info("job %s was still PENDING after its stop: its supervisor actor is killed", submission_id)
        time.sleep(1.0)
        status = secrets.job_status(submission_id)
    if status in ("PENDING", "RUNNING"):
        print(f"{ERROR_LOG_PREFIX}job {submission_id} had not ended after {wait_s:.0f} s; nothing swept", flush=True)
        return 1
    removed = secrets.sweep_leftovers()
    log.info("swept after %s: %d secrets file(s) and package(s) removed", submission_id, len(removed))
    print(f"{SWEEP_LOG_PREFIX}{json.dumps({'after': submission_id, 'removed': len(removed)})}", flush=True)
    return 0


def _wait_for_sweep(timeout_s: float = 30.0) -> None:
    """The driver's sweep of what ended jobs left (``secrets.sweep_leftovers``) ends before this job does."""
    driver = sys.modules.get("airflow_provider_rayllm.job.driver")
    sweeper = getattr(driver, "SWEEPER", None)
    if sweeper is not None and sweeper.is_alive():
        sweeper.join(timeout_s)


def _stopped(package_dir: str | None) -> None:
    if package_dir:
        secrets.remove_local(package_dir)
        try:
            secrets.remove_package()
        except Exception as exc:  # the cleanup in main's finally tries again
            print(
                f"WARNING: could not remove the job's package from the cluster's store: {type(exc).__name__}",
                flush=True,
            )
    raise SystemExit(143)


def _cleanup(loaded: list[str], package_dir: str) -> None:
    """The secrets leave the cluster with the job (a failed cleanup is said, never hidden)."""
    if not loaded:
        return
    try:
        secrets.cleanup(package_dir)
        log.info("job secrets removed from the cluster's copies of the job package")
    except Exception as exc:
        print(f"WARNING: could not remove the job's secrets from the cluster: {type(exc).__name__}: {exc}", flush=True)
