"""What every operator of this package shares: declared arguments, submit or re-attach, wait (deferred or
not), read the manifest.

An operator writes its typed parameters in its ``__init__`` and lists their declarations (``arguments.py``)
in ``arguments``; ``template_fields`` and renderers are made from that list here. A subclass turns its
rendered arguments into a job spec (``spec_body``) and says what it pushes when the job succeeded
(``publish``).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import shlex
import tempfile
import time
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Sequence

from airflow.sdk import BaseOperator, conf
from typing_extensions import Unpack

from airflow_provider_rayllm.contract.names import (
    ENTRYPOINT,
    ERROR_LOG_PREFIX,
    JOB_FILE,
    MANIFEST_LOG_PREFIX,
    REFUSED_LOG_LINE,
    SECRETS_FILE,
    SETUP_HOOK,
    SPEC_FILE,
    SWEEP_ENTRYPOINT,
)
from airflow_provider_rayllm.contract.progress import describe_progress, parse_progress
from airflow_provider_rayllm.contract.secrets import redact, secret_env_vars
from airflow_provider_rayllm.contract.spec import (
    AnySpec,
    RunSpec,
    SpecError,
    format_validation_error,
    uri_scheme,
    validate_body,
)
from airflow_provider_rayllm.exceptions import InvalidSpec, RayJobFailed, RayJobLost, RayJobRefused, RayLLMError
from airflow_provider_rayllm.hooks.ray_job import ACTIVE_STATES, OutageClock, RayJobHook, lost_message
from airflow_provider_rayllm.links import RayJobLink
from airflow_provider_rayllm.operators import arguments as args_mod
from airflow_provider_rayllm.operators import credentials
from airflow_provider_rayllm.operators.arguments import Argument
from airflow_provider_rayllm.operators.task_args import BaseOperatorArgs
from airflow_provider_rayllm.triggers.ray_job import RayJobTrigger

if TYPE_CHECKING:
    from airflow.sdk import Context

PACKAGE_DIR = Path(__file__).resolve().parents[1]
# Left out of the package a job receives (gitignore-style patterns, as Ray's runtime_env "excludes" reads them).
SHIP_EXCLUDES = ("/local/", "__pycache__/")
MAX_GENERATIONS = 100
METADATA_OUTPUT_URI = "rayllm_output_uri"
METADATA_CLEAR_NUMBER = "airflow_clear_number"

_BASE_OPERATOR_ARGS = frozenset(p for p in inspect.signature(BaseOperator.__init__).parameters if p != "self")


def refuse_unknown(operator: str, kwargs: Mapping[str, Any]) -> None:
    """A TypeError for the first argument that neither this operator nor BaseOperator takes, naming the operator
    that does take it (Airflow's own error would only say that it is invalid)."""
    for name in kwargs:
        if name not in _BASE_OPERATOR_ARGS:
            raise TypeError(unknown_argument(operator, name))


def unknown_argument(operator: str, name: str) -> str:
    """An argument this operator does not take, and which operator does."""
    takers = [
        kind for kind, label in _OPERATORS.items() if any(a.name == name for a in args_mod.operator_arguments(kind))
    ]
    hint = f"; it is an argument of {', '.join(_OPERATORS[k] for k in takers)}" if takers else ""
    return f"{operator} got an unexpected argument {name!r}{hint}"


_OPERATORS = {"vllm": "VLLMBatchOperator", "http": "HttpLLMBatchOperator", "upload": "ModelUploadOperator"}


# How Ray prefixes a line a worker process printed: "(MapWorker(...) pid=12, ip=10.0.0.2) ".
_PROCESS = r"\(.*?pid=\d+(?:, ip=[\d.]+)?\)"


class JobLogView:
    """Which job log lines the task log shows: the driver's own lines and the workers' errors. The engine's
    chatter stays in Ray's job log, and so do the tracebacks a finished engine prints while it shuts down
    (vLLM's output handler raising EngineDeadError, Python's resource tracker missing a /psm_ segment)."""

    WORKER = re.compile(rf"^(?:\x1b\[\d+m)?{_PROCESS}(?:\x1b\[0m)?\s?")
    SHUTDOWN_NOISE = ("EngineDeadError", "KeyError: '/psm_", "resource_tracker")
    # The line vLLM's engine logs just before that traceback.
    SHUTDOWN_LINES = ("AsyncLLM output_handler failed",)
    # Ray's notices about choices the job makes on purpose: its map actors get a few restarts while Ray Data
    # holds their constructor arguments in the object store (Ray core logs it at error level, once an actor).
    NOTICES = ("has constructor arguments in the object store and max_restarts > 0",)
    VLLM_LOGGER = re.compile(r"^(?:\(\w+ pid=\d+\) )?[A-Z]+ \d\d-\d\d [\d:]+ \[[^\]]+\] ")

    def __init__(self) -> None:
        self.traceback: list[str] | None = None

    def feed(self, line: str) -> list[str]:
        if not line.strip() or line.startswith(MANIFEST_LOG_PREFIX) or line.strip() == REFUSED_LOG_LINE:
            return []
        worker = self.WORKER.match(line)
        text = line[worker.end() :] if worker else line
        # vLLM logs a traceback line by line, each behind its own logger prefix
        # ("(MainProcess pid=6748) ERROR 12-04 15:36:26 [async_llm.py:906]   File ..."): read the line's text.
        logged = self.VLLM_LOGGER.match(text) if worker else None
        if logged:
            text = text[logged.end() :]
        if self.traceback is not None:
            self.traceback.append(line)
            if (
                text[:1].isspace()
                or text.startswith(("Traceback", "The above exception", "During handling"))
                or not text.strip()
            ):
                return []
            block, self.traceback = self.traceback, None
            return [] if any(noise in "\n".join(block) for noise in self.SHUTDOWN_NOISE) else block
        if "Traceback (most recent call last)" in text:
            self.traceback = [line]
            return []
        if any(notice in text for notice in self.NOTICES):
            return []
        if worker and not any(level in text for level in ("ERROR", "Error:", "CRITICAL")):
            return []
        if worker and any(noise in text for noise in self.SHUTDOWN_LINES):
            return []
        return [line]


class JobLogPrinter:
    """Job log lines into the task log: progress lines as one 'Progress:' line each, the rest as the
    ``JobLogView`` chooses, with the task's secrets scrubbed."""

    def __init__(self, log: Any, secrets: Sequence[str]) -> None:
        self.log = log
        self.secrets = secrets
        self.view = JobLogView()

    def show(self, lines: Sequence[str]) -> None:
        for line in lines:
            done = parse_progress(line)
            if done is not None:
                self.log.info("Progress: %s", describe_progress(done))
                continue
            for shown in self.view.feed(line):
                self.log.info("[ray] %s", scrub(shown, self.secrets))


# Errors that only say a Ray worker died: the cause is an earlier error line of the job's log.
_DEATHS = ("ActorDiedError", "RayTaskError", "WorkerCrashedError", "ActorUnschedulableError", "RaySystemError")
_COLOR = re.compile(r"\x1b\[[0-9;]*m")
# Ray's process prefixes, then vLLM's logger prefix ("ERROR 12-04 00:40:05 [core.py:1510] ").
_PREFIXES = re.compile(rf"^(?:{_PROCESS}\s*|[A-Z]+ \d\d-\d\d [\d:]+ \[[^\]]+\]\s*)+")
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception)): (\S.*)$")


# Ray's message for a failed entrypoint ends its first line by announcing the log it appends.
_LOG_ANNOUNCED = re.compile(r",?\s*last available logs \(truncated to [\d,]+ chars\):?\s*$")


def ray_reason(message: str) -> str:
    """The first line of Ray's message for a job, without the announcement of the log Ray appends after it
    (the task log shows the job's own lines already)."""
    return _LOG_ANNOUNCED.sub("", (message.strip().splitlines() or [""])[0])


def root_cause(log_lines: Sequence[str], error: str) -> str:
    """When the job's error only says that a Ray worker died (an engine that could not start: vLLM's own
    message says "See root cause above"), the first exception line the job's log holds before it, with the
    Ray and vLLM prefixes and colors removed; "" otherwise."""
    if error and not any(death in error.split(":", 1)[0] for death in _DEATHS):
        return ""
    for line in log_lines:
        if line.startswith(ERROR_LOG_PREFIX):
            break
        found = _EXCEPTION.match(_PREFIXES.sub("", _COLOR.sub("", line)).strip())
        if found and not found[1].endswith(_DEATHS) and "root cause above" not in found[2]:
            return f"{found[1]}: {found[2]}"
    return ""


def scrub(text: str, secrets: Sequence[str]) -> str:
    for value in secrets:
        text = text.replace(value, "***")
    return redact(text)


def _safe(part: Any) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]", "_", str(part)) or "_"


def default_output_uri(base: str, dag_id: str, run_id: str, task_id: str, map_index: int) -> str:
    """One prefix per task instance: scheduled runs, manual runs and backfills never collide."""
    parts = [_safe(dag_id), _safe(run_id), _safe(task_id)]
    if map_index is not None and map_index >= 0:
        parts.append(f"map_{map_index}")
    return "/".join([base.rstrip("/"), *parts])


def asset_uri(uri: str) -> str:
    """A path or bucket URI as an asset URI: local paths become file:// URIs."""
    if uri_scheme(uri) != "file" or uri.startswith("file://"):
        return uri
    return "file://" + os.path.abspath(os.path.expanduser(uri))


def submission_base_id(dag_id: str, run_id: str, task_id: str, map_index: int, spec_hash: str) -> str:
    """Same task instance and same settings => same id; the generation suffix is added on top."""
    key = json.dumps([dag_id, run_id, task_id, map_index, spec_hash])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    readable = re.sub(r"[^A-Za-z0-9_-]", "-", f"{dag_id}.{task_id}")[:60]
    return f"rayllm-{readable}-{digest}"


class RayJobOperator(BaseOperator):
    """Runs one job of this package on Ray and returns its manifest.

    Each concrete operator writes its parameters, typed, in its ``__init__`` and lists their declarations
    (description, templated or not, where the value goes in the job spec) in ``arguments``;
    ``template_fields``, the renderers and docs/OPERATORS.md come from those declarations, and a unit test
    checks that the signature and the declarations agree. The job's own parameters below reach a subclass
    through ``**kwargs`` (``RayJobArgs``).
    """

    arguments: ClassVar[tuple[Argument, ...]] = args_mod.JOB
    template_fields: Sequence[str] = tuple(a.attr for a in args_mod.JOB if a.templated)
    operator_extra_links = (RayJobLink(),)
    ui_color = "#e0f0ff"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "arguments" in cls.__dict__:
            cls.template_fields = tuple(a.attr for a in cls.arguments if a.templated)
            cls.template_fields_renderers = {a.attr: a.renderer for a in cls.arguments if a.templated and a.renderer}

    def __init__(
        self,
        *,
        ray_conn_id: str = "ray_default",
        deferrable: bool | None = None,
        poll_interval: float = 5.0,
        unreachable_timeout: float = 600.0,
        job_runtime_env: dict[str, Any] | None = None,
        ship_package: bool = True,
        aws_conn_id: str | None = None,
        gcp_conn_id: str | None = None,
        hf_conn_id: str | None = None,
        entrypoint_num_cpus: float | None = None,
        entrypoint_resources: dict[str, float] | None = None,
        **kwargs: Unpack[BaseOperatorArgs],
    ) -> None:
        refuse_unknown(type(self).__name__, kwargs)
        super().__init__(**kwargs)
        self.take_arguments(locals())
        self._submission_id: str | None = None
        self._secrets: dict[str, str] | None = None

    def take_guide_config(self, config: Any, fields: Mapping[str, str], given: Mapping[str, Any]) -> None:
        """The guide's processor config (``processor_config``): each field it sets fills its argument."""
        from airflow_provider_rayllm.operators.guide_config import mapped_arguments

        declared = {a.name: a for a in type(self).arguments}
        defaults = {name: a.signature_default() for name, a in declared.items()}
        for name, value in mapped_arguments(type(self).__name__, config, fields, given, defaults).items():
            setattr(self, declared[name].attr, value)

    def take_arguments(self, values: Mapping[str, Any]) -> None:
        """Keep the declared arguments found in ``values`` (an ``__init__``'s locals) as attributes: None for an
        argument whose spec field has a default made fresh (``{}``) takes that default."""
        for argument in type(self).arguments:
            if argument.name in values:
                value = values[argument.name]
                if value is None and callable(argument.default):
                    value = argument.fresh_default()
                setattr(self, argument.attr, value)

    @property
    def waits_deferred(self) -> bool:
        if self.deferrable is None:
            return conf.getboolean("operators", "default_deferrable", fallback=False)
        return bool(self.deferrable)

    @cached_property
    def hook(self) -> RayJobHook:
        return RayJobHook(ray_conn_id=self.ray_conn_id)

    # --- subclass contract ----------------------------------------------------------------------
    def spec_body(self, context: Context, output_uri: str, package_dir: Path) -> dict[str, Any]:
        """The spec as a dict (without ``run``); may write files (pickled callables) into package_dir."""
        raise NotImplementedError

    def publish(self, context: Context, manifest: dict[str, Any]) -> None:
        """What the task pushes and says once the job succeeded."""
        raise NotImplementedError

    def already_published(self, spec: AnySpec) -> dict[str, Any] | None:
        """A manifest in storage that this task instance published for the same settings and the same clear
        of its run (a retry after the cluster forgot the job), or None."""
        return None

    def summary(self, spec: AnySpec) -> str:
        """One line that opens the task log: what runs, on what, and where the result goes."""
        return f"{type(self).__name__}: {spec.model_name} -> {spec.output_uri}"

    def section(self, name: str) -> dict[str, Any]:
        """The rendered arguments that go into one section of the spec, under the spec's field names."""
        return {a.path[1]: getattr(self, a.attr) for a in self.arguments if a.path and a.path[0] == name}

    def user_field(self, path: str) -> str:
        """A spec path as the argument the user wrote: 'source.uris.0' -> 'input_uri.0'."""
        parts = path.split(".")
        for a in self.arguments:
            if a.path and len(parts) >= 2 and parts[1] == a.path[1] and (parts[0] == a.path[0] or parts[0] == "source"):
                return ".".join([a.name, *parts[2:]])
        return path

    # --- spec -----------------------------------------------------------------------------------
    def _run_spec(self, context: Context) -> RunSpec:
        ti = context["ti"]
        map_index = getattr(ti, "map_index", -1)
        return RunSpec(
            dag_id=ti.dag_id,
            run_id=ti.run_id,
            task_id=ti.task_id,
            map_index=-1 if map_index is None else int(map_index),
            try_number=int(getattr(ti, "try_number", 0) or 0),
            clear_number=int(getattr(context.get("dag_run"), "clear_number", 0) or 0),
        )

    def resolve_output_uri(self, run: RunSpec) -> str:
        if self.output_uri:
            return str(self.output_uri)
        base = self.hook.settings.output_base
        if not base:
            raise InvalidSpec(
                f"{self.task_id}: output_uri is not set and the connection {self.ray_conn_id!r} has no "
                "extra 'output_base'; give one of them"
            )
        return default_output_uri(base, run.dag_id, run.run_id, run.task_id, run.map_index)

    def build_spec(self, context: Context, package_dir: Path) -> AnySpec:
        run = self._run_spec(context)
        try:
            body = self.spec_body(context, self.resolve_output_uri(run), package_dir)
        except SpecError as exc:
            raise InvalidSpec(f"{self.task_id}: {exc}") from None
        body["run"] = run.model_dump()
        from pydantic import ValidationError

        try:
            return validate_body(body)
        except ValidationError as exc:
            raise InvalidSpec(
                f"{self.task_id}: invalid settings: {format_validation_error(exc, self.user_field)}"
            ) from None

    # --- submit / attach ------------------------------------------------------------------------
    def _resolve_generation(self, base_id: str, clear_number: int = 0) -> tuple[str, str]:
        """('attach' | 'submit', submission_id).

        A retry re-attaches to a live or finished job; a new generation runs after a failed or stopped
        one, and after a finished one when the run was cleared since (a user's rerun, a backfill that
        reprocesses: the input may have changed, so the rows are computed again).
        """
        last: tuple[str, dict[str, Any]] | None = None
        for generation in range(MAX_GENERATIONS):
            sid = f"{base_id}-g{generation}"
            info = self.hook.get_job_info(sid)
            if info is None:
                if last is None:
                    return "submit", sid
                prev_sid, prev = last
                if prev["status"] in ACTIVE_STATES:
                    return "attach", prev_sid
                if prev["status"] == "SUCCEEDED":
                    cleared_at = int((prev.get("metadata") or {}).get(METADATA_CLEAR_NUMBER) or 0)
                    if cleared_at >= clear_number:
                        return "attach", prev_sid
                return "submit", sid
            last = (sid, info)
        raise RayLLMError(f"{base_id}: {MAX_GENERATIONS} generations already ran; refusing to submit another")

    def secrets(self) -> dict[str, str]:
        """``job_secrets()``, read from the connections once per task run."""
        if self._secrets is None:
            self._secrets = self.job_secrets()
        return dict(self._secrets)

    def job_secrets(self) -> dict[str, str]:
        """Environment variables the job's processes need that must not show in the Jobs API."""
        env: dict[str, str] = dict(secret_env_vars(self.job_runtime_env)[1])
        if self.aws_conn_id:
            env.update(credentials.aws_env(self.aws_conn_id))
        if self.gcp_conn_id:
            env.update(credentials.gcp_env(self.gcp_conn_id))
        if self.hf_conn_id:
            env.update(credentials.hf_env(self.hf_conn_id))
        return env

    def _runtime_env(self, package_dir: Path, quiet: bool = False) -> dict[str, Any]:
        kept, moved = secret_env_vars(self.job_runtime_env)
        if moved and not quiet:
            self.log.warning(
                "job_runtime_env.env_vars %s look secret: they go to the job's secrets file, not to the runtime_env "
                "that the Jobs API shows (a connection keeps them out of the DAG file too)",
                sorted(moved),
            )
        env = dict(kept or {})
        for key in ("working_dir", "worker_process_setup_hook"):
            if key in env:
                raise InvalidSpec(f"job_runtime_env.{key} is set by the operator (it carries the job spec and secrets)")
        env["working_dir"] = str(package_dir)
        env["worker_process_setup_hook"] = SETUP_HOOK
        # A stopped job gets this long after Ray's SIGTERM (its default is 3 s) to remove its secrets from the
        # cluster before the SIGKILL.
        env["env_vars"] = {"RAY_JOB_STOP_WAIT_TIME_S": "30", **(env.get("env_vars") or {})}
        if self.ship_package:
            env["py_modules"] = [*env.get("py_modules", []), str(PACKAGE_DIR)]
            # The embedded dev stack (local cluster, model preparation, demo) never runs in a job.
            env["excludes"] = [*env.get("excludes", []), *SHIP_EXCLUDES]
        return env

    def _submit(self, submission_id: str, spec: AnySpec, package_dir: Path) -> None:
        (package_dir / SPEC_FILE).write_text(spec.to_json())
        (package_dir / JOB_FILE).write_text(json.dumps({"submission_id": submission_id}))
        secrets = self.secrets()
        if secrets:
            # Private from its creation: opened with mode 0600, never widened and narrowed after.
            fd = os.open(package_dir / SECRETS_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as handle:
                handle.write(json.dumps(secrets))
            self.log.info("Job secrets passed through the job package: %s", sorted(secrets))
        metadata = {
            METADATA_OUTPUT_URI: spec.output_uri,
            "rayllm_submission_id": submission_id,
            "rayllm_spec_hash": spec.content_hash()[:16],
            "airflow_dag_id": spec.run.dag_id,
            "airflow_run_id": spec.run.run_id,
            "airflow_task_id": spec.run.task_id,
            "airflow_map_index": str(spec.run.map_index),
            METADATA_CLEAR_NUMBER: str(spec.run.clear_number),
        }
        try:
            self.hook.submit_job(
                entrypoint=ENTRYPOINT,
                submission_id=submission_id,
                runtime_env=self._runtime_env(package_dir),
                metadata=metadata,
                entrypoint_num_cpus=self.entrypoint_num_cpus,
                entrypoint_resources=self.entrypoint_resources,
            )
        except Exception as exc:
            # Another attempt of this task instance submitted the same id first: attach to it.
            if "already exists" in str(exc):
                self.log.info("Ray job %s was submitted by another attempt; attaching", submission_id)
                return
            raise
        self.log.info("Submitted Ray job %s (entrypoint %r)", submission_id, ENTRYPOINT)

    # --- execute --------------------------------------------------------------------------------
    def execute(self, context: Context) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="rayllm-job-") as tmp:
            package_dir = Path(tmp)
            spec = self.build_spec(context, package_dir)
            run = spec.run
            base_id = submission_base_id(run.dag_id, run.run_id, run.task_id, run.map_index, spec.content_hash())
            action, submission_id = self._resolve_generation(base_id, run.clear_number)
            self.log.info("%s", self.summary(spec))
            if action == "submit":
                published = self.already_published(spec)
                if published is not None:
                    # Ray no longer knows the job (a restarted or ephemeral cluster), storage does.
                    self.log.info(
                        "Already published by %s for these settings and this clear of the run: returning its manifest",
                        published["submission_id"],
                    )
                    context["ti"].xcom_push(key="submission_id", value=published["submission_id"])
                    self.publish(context, published)
                    return published
            self.log.info("Output prefix %s; Ray submission %s (%s)", spec.output_uri, submission_id, action)
            if action == "submit":
                self._submit(submission_id, spec, package_dir)
        self._submission_id = submission_id
        context["ti"].xcom_push(key="ray_job_url", value=self.hook.settings.dashboard_job_url(submission_id))
        context["ti"].xcom_push(key="submission_id", value=submission_id)
        if self.waits_deferred:
            self.defer(
                trigger=RayJobTrigger(
                    submission_id=submission_id,
                    ray_conn_id=self.ray_conn_id,
                    poll_interval=self.poll_interval,
                    unreachable_timeout=self.unreachable_timeout,
                ),
                method_name="execute_complete",
            )
        status, message = self._wait_with_logs(submission_id)
        return self._finish(context, submission_id, status, message)

    def _wait_with_logs(self, submission_id: str) -> tuple[str, str]:
        """Poll the job's status and copy its log's new lines into the task log as they come."""
        known = self._secret_values()
        clock = OutageClock(submission_id, self.unreachable_timeout)
        printer = JobLogPrinter(self.log, known)
        tail = self.hook.tail_job_logs(submission_id)
        try:
            while True:
                try:
                    info = self.hook.get_job_info(submission_id)
                    clock.answered()
                except Exception as exc:  # the dashboard may be restarting: keep waiting, within a limit
                    ended = clock.failed(exc)
                    if ended:
                        return "ERROR", ended
                    self.log.warning("Ray Jobs API unreachable (%.0f s): %s; retrying", clock.silent_s, exc)
                    time.sleep(self.poll_interval)
                    continue
                if info is None:
                    return "LOST", lost_message(submission_id)
                status = str(info["status"])
                if status not in ACTIVE_STATES:
                    printer.show(self.hook.ended_job_lines(tail))
                    return status, str(info.get("message") or "")
                printer.show(tail.lines())
                tail.sleep(self.poll_interval)
        finally:
            tail.stop()

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(event, dict) or "status" not in event or "submission_id" not in event:
            raise RayLLMError(f"unexpected trigger event {event!r}")
        submission_id = str(event["submission_id"])
        self._submission_id = submission_id
        return self._finish(context, submission_id, str(event["status"]), str(event.get("message") or ""))

    # --- finish ---------------------------------------------------------------------------------
    def _job_error_line(self, submission_id: str) -> tuple[str, str, bool]:
        """The job's own error line (with the root cause when it only says a worker died), its log's end, and
        whether the job refused to run as set (a retry would fail the same way)."""
        try:
            lines = self.hook.get_job_logs(submission_id).splitlines()
        except Exception:
            return "", "", False
        ours = [_COLOR.sub("", line[len(ERROR_LOG_PREFIX) :]) for line in lines if line.startswith(ERROR_LOG_PREFIX)]
        error = ours[-1] if ours else ""
        cause = root_cause(lines, error)
        if cause:
            error = f"{error} (caused by {cause})" if error else cause
        refused = any(line.strip() == REFUSED_LOG_LINE for line in lines)
        shown = [line for line in lines[-41:] if line.strip() != REFUSED_LOG_LINE][-40:]
        return error, "\n".join(shown), refused

    def _secret_values(self) -> list[str]:
        """The secrets this task sends, to scrub from what it logs or raises (a courtesy when unreadable)."""
        try:
            return [v for v in self.secrets().values() if v and len(v) >= 4]
        except Exception:
            return []

    def _finish(self, context: Context, submission_id: str, status: str, message: str) -> dict[str, Any]:
        if status == "LOST":
            raise RayJobLost(f"{message}; a retry of this task submits the job again")
        if status != "SUCCEEDED":
            known = self._secret_values()
            error, tail, refused = self._job_error_line(submission_id)
            if tail:
                self.log.error("Last lines of Ray job %s:\n%s", submission_id, scrub(tail, known))
            detail = f": {error}" if error else ""
            first = ray_reason(message)
            failure = RayJobRefused if refused else RayJobFailed
            raise failure(scrub(f"Ray job {submission_id} ended {status}{detail} (Ray: {first})", known))
        manifest = self._read_manifest(submission_id)
        self.publish(context, manifest)
        self._report_lineage(manifest)
        return manifest

    def lineage_inputs(self) -> list[str]:
        """URIs of what the job read, for Airflow's hook lineage collector (subclasses say)."""
        return []

    def _report_lineage(self, manifest: dict[str, Any]) -> None:
        """Inputs and the output prefix go to Airflow's hook lineage collector (a no-op without a reader)."""
        try:
            from airflow.sdk.lineage import get_hook_lineage_collector
        except ImportError:  # pragma: no cover - Airflow without the SDK lineage module
            return
        collector = get_hook_lineage_collector()
        try:
            for uri in self.lineage_inputs():
                collector.add_input_asset(context=self.hook, uri=asset_uri(uri))
            collector.add_output_asset(
                context=self.hook,
                uri=asset_uri(manifest["output_uri"]),
                asset_extra={"submission_id": manifest.get("submission_id"), "rows_out": manifest.get("rows_out")},
            )
        except Exception as exc:  # lineage never fails a task
            self.log.warning("lineage not reported: %s", exc)

    def _read_manifest(self, submission_id: str) -> dict[str, Any]:
        """The published manifest; it must be this submission's (a stale one is never returned)."""
        info = self.hook.get_job_info(submission_id) or {}
        output_uri = (info.get("metadata") or {}).get(METADATA_OUTPUT_URI)
        manifest: dict[str, Any] | None = None
        if output_uri:
            try:
                from airflow_provider_rayllm.contract.storage import read_manifest

                manifest = read_manifest(output_uri, {**os.environ, **self.secrets()})
            except Exception as exc:  # e.g. a path only the cluster can see
                self.log.info(
                    "Manifest at %s not readable from this worker (%s); using the job log copy", output_uri, exc
                )
        if manifest is None or manifest.get("submission_id") != submission_id:
            logs = self.hook.get_job_logs(submission_id)
            lines = [line for line in logs.splitlines() if line.startswith(MANIFEST_LOG_PREFIX)]
            if not lines:
                raise RayLLMError(f"Ray job {submission_id} succeeded but wrote no manifest")
            manifest = json.loads(lines[-1][len(MANIFEST_LOG_PREFIX) :])
        if manifest.get("submission_id") != submission_id:
            raise RayLLMError(
                f"the manifest at {output_uri} belongs to {manifest.get('submission_id')!r}, not {submission_id!r}"
            )
        return manifest

    def resume_execution(self, next_method: str, next_kwargs: dict[str, Any] | None, context: Context) -> Any:
        """A deferred task that Airflow resumes only to fail it (execution_timeout reached while deferred,
        or the trigger crashed) stops its Ray job first: the triggerer does not call on_kill for a timeout."""
        if next_method == "__fail__":
            ti = context["ti"]
            submission_id = ti.xcom_pull(task_ids=ti.task_id, key="submission_id", map_indexes=ti.map_index)
            if submission_id:
                self._submission_id = str(submission_id)
                self.log.error(
                    "The deferred wait ended without the job's result (%s)", (next_kwargs or {}).get("error")
                )
                self.on_kill()
        return super().resume_execution(next_method, next_kwargs, context)

    def on_kill(self) -> None:
        if self._submission_id:
            self.log.info("Stopping Ray job %s", self._submission_id)
            try:
                self.hook.stop_job(self._submission_id)
            except Exception as exc:
                self.log.error("could not stop Ray job %s: %s", self._submission_id, exc)
            self._submit_sweep(self._submission_id)

    def _submit_sweep(self, stopped_id: str) -> None:
        """A small job, with no secret of its own, that waits for the stopped job to end and then removes what
        ended jobs of ours left on the cluster (``secrets.json`` on the nodes, packages in the store): a job
        stopped while PENDING never ran the driver whose cleanup would have done it. It is not waited for."""
        sweep_id = f"{stopped_id}-sweep"
        try:
            with tempfile.TemporaryDirectory(prefix="rayllm-sweep-") as tmp:
                (Path(tmp) / JOB_FILE).write_text(json.dumps({"submission_id": sweep_id}))
                self.hook.submit_job(
                    entrypoint=f"{SWEEP_ENTRYPOINT} {shlex.quote(stopped_id)}",
                    submission_id=sweep_id,
                    runtime_env=self._runtime_env(Path(tmp), quiet=True),
                    metadata={"rayllm_sweep_after": stopped_id},
                    entrypoint_num_cpus=0,
                )
            self.log.info("Submitted Ray job %s to sweep what %s leaves on the cluster", sweep_id, stopped_id)
        except Exception as exc:  # the next job's own sweep is the fallback; said, not hidden
            self.log.warning("could not submit the sweep job after stopping %s: %s", stopped_id, redact(str(exc)))
