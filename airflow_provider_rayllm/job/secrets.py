"""Secrets reach the job as a file in its runtime_env working_dir, never as text the Jobs API shows.

The operator writes ``secrets.json`` (environment variables) next to ``spec.json``. The driver loads it
at start; every Ray worker of the job loads it through ``worker_process_setup_hook``, so read tasks and
engine actors get credentials in their own process environment. Neither the entrypoint, the job
metadata nor the runtime_env env_vars carry a secret, and nothing here logs a value.

Ray keeps a job's package in its store and unpacked on every node that ran the job's workers, long after
the job ended. So the driver, whatever way the job ends (success, failure, or a stop: Ray sends SIGTERM
first), removes the secrets file and the key file from its node's copy and the package from the cluster's
store at once, then from every other node's copy (``cleanup``), and says which nodes did not answer. A
driver that never reaches its cleanup (SIGKILL, the OOM killer, ``os._exit``) leaves its node's copies: the
next job of this package removes them at its start (``sweep_leftovers``), from every node, for each package
whose job (named in its ``rayllm-job.json``) is no longer active.

Ray unpacks the package with the default file mode; the first process of the job on a node narrows the
secrets file to 0600 before it reads it.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from typing import Any

from airflow_provider_rayllm.contract.names import GCP_KEYFILE_JSON, JOB_FILE, SECRETS_FILE

# A service-account key travels as JSON text and becomes a 0600 file for the Google clients.
GCP_KEYFILE_NAME = "gcp-keyfile.json"


def load_into_env(directory: str | None = None) -> list[str]:
    """Set the job's secrets as environment variables of this process; returns the names set."""
    path = os.path.join(directory or os.getcwd(), SECRETS_FILE)
    if not os.path.exists(path):
        return []
    try:
        os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
    except OSError:  # another user's file: reading it is what matters here
        pass
    with open(path, encoding="utf-8") as handle:
        values: dict[str, str] = json.load(handle)
    keyfile = values.pop(GCP_KEYFILE_JSON, None)
    if keyfile:
        values["GOOGLE_APPLICATION_CREDENTIALS"] = _private_keyfile(os.path.dirname(os.path.abspath(path)), keyfile)
    for name, value in values.items():
        os.environ[name] = str(value)
    _LOADED.extend(str(v) for v in values.values() if v and len(str(v)) >= 4)
    return sorted(values)


_LOADED: list[str] = []  # the values this process loaded, to scrub messages with after the file is gone


def _private_keyfile(directory: str, keyfile: str) -> str:
    """The key as a 0600 file beside secrets.json: it lives and goes with the job's package, like the
    secrets file itself, instead of piling up in /tmp. Every worker of the job writes the same bytes;
    the rename makes each write whole."""
    key_path = os.path.join(directory, GCP_KEYFILE_NAME)
    fd, tmp_path = tempfile.mkstemp(prefix=".gcp-key-", dir=directory)
    with os.fdopen(fd, "w") as out:
        out.write(keyfile)
    os.chmod(tmp_path, stat.S_IRUSR | stat.S_IWUSR)
    os.replace(tmp_path, key_path)
    return key_path


def secret_values() -> list[str]:
    """The values loaded from the secrets file, so messages can be scrubbed of them."""
    path = os.path.join(os.getcwd(), SECRETS_FILE)
    if _LOADED or not os.path.exists(path):
        return list(_LOADED)
    with open(path, encoding="utf-8") as handle:
        return [str(v) for v in json.load(handle).values() if v and len(str(v)) >= 4]


def scrub(text: str, secrets: list[str]) -> str:
    for value in secrets:
        text = text.replace(value, "***")
    return text


def remove_local(directory: str | None = None) -> list[str]:
    """Delete this node's copy of the secrets file and key file: in ``directory``, or the cwd (a task's cwd is
    its node's job package). The driver calls it first, in no time: a stopped job is killed a while after Ray's
    SIGTERM, and the tasks that reach the other nodes can take long to start on a busy cluster."""
    removed = []
    for name in (SECRETS_FILE, GCP_KEYFILE_NAME):
        path = os.path.join(directory or os.getcwd(), name)
        try:
            os.remove(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def remove_package() -> str | None:
    """Delete the job's package (its working_dir, holding the secrets file) from the cluster's store: one call
    to the GCS, so a stopped driver does it at once, before the slower steps. Returns the package deleted."""
    import ray

    if not ray.is_initialized():
        return None
    package = (ray.get_runtime_context().runtime_env or {}).get("working_dir") or ""
    if not package.startswith("gcs://"):
        return None
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(package)
    return package


def cleanup(package_dir: str, timeout_s: float = 15.0) -> None:
    """Remove the secrets from every node's copy of the job package and the package from the cluster's store.

    The driver's own node and the store first (quick, so a stop's SIGKILL cannot come between); then, even
    when the store could not be reached, a task per other live node runs in the job's own runtime env (its
    working directory is that node's copy of the package, which a node keeps after the store's copy is gone)
    and deletes the files there."""
    import ray

    remove_local(package_dir)
    if not ray.is_initialized():
        ray.init(log_to_driver=False)
    try:
        remove_package()
    finally:
        _on_other_nodes(remove_local, timeout_s)


def _on_other_nodes(function: Any, timeout_s: float, *args: Any) -> list[Any]:
    """``function(*args)`` as a task pinned to each live node other than this process's own, in the job's
    runtime env; the results. This node's part is the caller's, in its own process: a task here would start a
    worker process (about 1.5 CPU-s) for what takes a millisecond. A node whose task did not end within
    ``timeout_s`` is an error that names it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    nodes = [node["NodeID"] for node in ray.nodes() if node.get("Alive") and node["NodeID"] != here]
    if not nodes:
        return []
    remote = ray.remote(num_cpus=0, max_retries=0)(function)
    refs = {
        remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(*args): node
        for node in nodes
    }
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    if pending:
        missing = sorted(refs[ref][:12] for ref in pending)
        raise RuntimeError(f"{len(pending)} node(s) did not answer within {timeout_s:.0f} s: {missing}")
    return ray.get(ready)


def _leftovers_here(ended: list[str]) -> list[str]:
    """On this node: the secrets files of job packages whose job the cluster listed as ended (this job's package
    is the task's working directory; its siblings are the other jobs' packages on this node). A package whose
    job the listing did not know yet (submitted since, a retry right after a stop) is its own job's: kept."""
    here = os.getcwd()
    removed: list[str] = []
    for entry in os.scandir(os.path.dirname(here)):
        if not entry.is_dir() or os.path.samefile(entry.path, here):
            continue
        if not any(os.path.exists(os.path.join(entry.path, n)) for n in (SECRETS_FILE, GCP_KEYFILE_NAME)):
            continue
        try:
            with open(os.path.join(entry.path, JOB_FILE), encoding="utf-8") as handle:
                owner = json.load(handle).get("submission_id")
        except (OSError, ValueError):
            continue  # not one of ours
        if owner and owner in ended:
            removed += remove_local(entry.path)
    return removed


def _jobs() -> list[Any]:
    """The cluster's submitted jobs with their details (Ray's state API)."""
    from ray.util.state import list_jobs

    return list_jobs(limit=10_000, detail=True, raise_on_missing_output=False)  # the API server's largest page


def _active(job: Any) -> bool:
    return str(job.status).rsplit(".", 1)[-1] in ("PENDING", "RUNNING")


def job_status(submission_id: str) -> str | None:
    """The cluster's status of the job of this submission id (PENDING, RUNNING, STOPPED, ...), None if unknown."""
    for job in _jobs():
        if str(job.submission_id) == submission_id:
            return str(job.status).rsplit(".", 1)[-1]
    return None


def end_pending(submission_id: str) -> bool:
    """End a job that waits in PENDING for its driver's resources. The Jobs API's stop only reaches a job's
    supervisor actor once it is scheduled, so a job stopped while PENDING would start later, when resources
    free up, for a task that was killed. Killing the unscheduled supervisor ends it: Ray then marks the job
    FAILED. (The actor's name and namespace are those of Ray's job manager.) Returns whether one was killed."""
    import ray
    from ray.dashboard.modules.job.common import JOB_ACTOR_NAME_TEMPLATE, SUPERVISOR_ACTOR_RAY_NAMESPACE

    try:
        actor = ray.get_actor(
            JOB_ACTOR_NAME_TEMPLATE.format(job_id=submission_id), namespace=SUPERVISOR_ACTOR_RAY_NAMESPACE
        )
    except ValueError:  # no such actor: the job has ended or never had one
        return False
    ray.kill(actor, no_restart=True)
    return True


def sweep_leftovers(timeout_s: float = 15.0) -> list[str]:
    """What ended jobs of this package left on the cluster when their driver was killed before its cleanup: the
    secrets files on every node, and their packages in the cluster's store (each ended job of ours names its
    package in its runtime_env) and their stream's counts. Returns the secrets files and packages removed."""
    import ray
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_exists, _internal_kv_list

    from airflow_provider_rayllm.job.progress import COUNTS_NAMESPACE

    if not ray.is_initialized():
        ray.init(log_to_driver=False)
    jobs = _jobs()
    ended = sorted(str(j.submission_id) for j in jobs if j.submission_id and not _active(j))
    # This node's packages from here (the driver's working directory is its own package), the others' by tasks.
    removed = _leftovers_here(ended)
    removed += [path for found in _on_other_nodes(_leftovers_here, timeout_s, ended) for path in found]
    # Their streams' counts (``progress.KVCounts``; no secret in them), which a driver that ends removes itself.
    counted = {key.split(b"/", 1)[0].decode() for key in _internal_kv_list("", namespace=COUNTS_NAMESPACE)}
    for job in jobs:
        if not (job.metadata or {}).get("rayllm_submission_id") or _active(job):
            continue
        package = str((job.runtime_env or {}).get("working_dir") or "")
        if package.startswith("gcs://") and _internal_kv_exists(package):
            _internal_kv_del(package)
            removed.append(package)
        if job.job_id in counted:
            _internal_kv_del(f"{job.job_id}/", del_by_prefix=True, namespace=COUNTS_NAMESPACE)
    return removed
