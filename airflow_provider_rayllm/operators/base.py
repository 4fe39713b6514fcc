"""What every batch operator shares: submit or re-attach, wait (deferred or not), publish the manifest.

A subclass only turns its rendered arguments into a job spec (``spec_body``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, conf

from airflow_provider_rayllm.contract import (
    SECRETS_FILE,
    SETUP_HOOK,
    SINK_SQL_URI_ENV,
    SQL_URI_ENV,
    describe_progress,
    parse_progress,
)
from airflow_provider_rayllm.exceptions import InvalidSpec, RayJobFailed, RayJobLost, RayLLMError
from airflow_provider_rayllm.hooks.ray_job import ACTIVE_STATES, OutageClock, RayJobHook, lost_message
from airflow_provider_rayllm.links import OUTPUT_URL_XCOM, OutputLink, RayJobLink, output_browser_url
from airflow_provider_rayllm.operators import credentials
from airflow_provider_rayllm.spec import (
    ERROR_LOG_PREFIX,
    MANIFEST_LOG_PREFIX,
    AnySpec,
    RunSpec,
    SpecError,
    uri_scheme,
    validate_body,
)
from airflow_provider_rayllm.triggers.ray_job import RayJobTrigger

if TYPE_CHECKING:
    from airflow.sdk import Context

ENTRYPOINT = "python -m airflow_provider_rayllm.job spec.json"
PACKAGE_DIR = Path(__file__).resolve().parents[1]
MAX_GENERATIONS = 100
METADATA_OUTPUT_URI = "rayllm_output_uri"
METADATA_CLEAR_NUMBER = "airflow_clear_number"

# Spec paths shown as the operator argument a user wrote; other sections' fields keep their own names.
_ARG_NAMES = {
    "source.uris": "input_uri",
    "source.format": "input_format",
    "source.columns": "input_columns",
    "sink.uri": "output_uri",
    "sink.format": "output_format",
    "sink.rows_per_file": "output_rows_per_file",
    "prompt.template": "prompt_template",
}


def user_field(path: str) -> str:
    """'processor.batch_size' -> 'batch_size'; 'source.uris.0' -> 'input_uri.0'."""
    for spec_path, arg in _ARG_NAMES.items():
        if path == spec_path or path.startswith(spec_path + "."):
            return arg + path[len(spec_path) :]
    section, _, rest = path.partition(".")
    return rest if rest and section in {"processor", "prompt", "limits", "source", "sink"} else path


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


class RayLLMBatchBaseOperator(BaseOperator):
    """Base for operators that run one batch job on Ray and return its manifest."""

    operator_extra_links = (RayJobLink(), OutputLink())
    ui_color = "#e0f0ff"

    def __init__(
        self,
        *,
        ray_conn_id: str = RayJobHook.default_conn_name,
        output_uri: str | None = None,
        output_format: str = "parquet",
        output_rows_per_file: int | None = None,
        max_error_fraction: float = 0.1,
        max_rows: int | None = None,
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
        poll_interval: float = 5.0,
        unreachable_timeout: float = 600.0,
        job_runtime_env: dict[str, Any] | None = None,
        ship_package: bool = True,
        aws_conn_id: str | None = None,
        gcp_conn_id: str | None = None,
        output_table: str | None = None,
        output_table_conn_id: str | None = None,
        hf_conn_id: str | None = None,
        entrypoint_num_cpus: float | None = None,
        entrypoint_resources: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.ray_conn_id = ray_conn_id
        self.output_uri = output_uri
        self.output_format = output_format
        self.output_rows_per_file = output_rows_per_file
        self.max_error_fraction = max_error_fraction
        self.max_rows = max_rows
        self.deferrable = deferrable
        self.poll_interval = poll_interval
        self.unreachable_timeout = unreachable_timeout
        self.job_runtime_env = job_runtime_env
        self.ship_package = ship_package
        self.aws_conn_id = aws_conn_id
        self.gcp_conn_id = gcp_conn_id
        self.output_table = output_table
        self.output_table_conn_id = output_table_conn_id
        self.hf_conn_id = hf_conn_id
        # What the job's driver reserves on the cluster; with a custom resource the cluster queues drivers.
        self.entrypoint_num_cpus = entrypoint_num_cpus
        self.entrypoint_resources = entrypoint_resources
        self._submission_id: str | None = None

    @cached_property
    def hook(self) -> RayJobHook:
        return RayJobHook(ray_conn_id=self.ray_conn_id)

    # --- subclass contract ----------------------------------------------------------------------
    def spec_body(self, context: Context, output_uri: str, package_dir: Path) -> dict[str, Any]:
        """The spec as a dict (without ``run`` and ``sink``); may write files (pickled callables) into package_dir."""
        raise NotImplementedError

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
        output_uri = self.resolve_output_uri(run)
        try:
            body = self.spec_body(context, output_uri, package_dir)
            if body.get("kind") != "upload":
                body["sink"] = self.sink_body(output_uri, run)
        except SpecError as exc:
            raise InvalidSpec(f"{self.task_id}: {exc}") from None
        body["run"] = run.model_dump()
        from pydantic import ValidationError

        from airflow_provider_rayllm.spec import format_validation_error

        try:
            return validate_body(body)
        except ValidationError as exc:
            raise InvalidSpec(f"{self.task_id}: invalid settings: {format_validation_error(exc, user_field)}") from None

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

    def job_secrets(self) -> dict[str, str]:
        """Environment variables the job's processes need that must not show in the Jobs API."""
        env: dict[str, str] = {}
        if self.aws_conn_id:
            env.update(credentials.aws_env(self.aws_conn_id))
        if self.gcp_conn_id:
            env.update(credentials.gcp_env(self.gcp_conn_id))
        if self.hf_conn_id:
            env.update(credentials.hf_env(self.hf_conn_id))
        if self.output_table and self.output_table_conn_id:
            _, uri = credentials.sql_source(self.output_table_conn_id)
            env[SINK_SQL_URI_ENV] = uri[SQL_URI_ENV]
        return env

    def sink_body(self, output_uri: str, run: RunSpec) -> dict[str, Any]:
        sink: dict[str, Any] = {"uri": output_uri, "format": self.output_format, "rows_per_file": self.output_rows_per_file}
        if self.output_table:
            if not self.output_table_conn_id:
                raise SpecError("output_table needs output_table_conn_id, the Airflow connection of the database")
            dialect, _ = credentials.sql_source(self.output_table_conn_id)
            run_key = f"{run.dag_id}/{run.run_id}/{run.task_id}/{run.map_index}"
            sink["table"] = {"table": self.output_table, "dialect": dialect, "run_key": run_key}
        return sink

    def _runtime_env(self, package_dir: Path) -> dict[str, Any]:
        env = dict(self.job_runtime_env or {})
        for key in ("working_dir", "worker_process_setup_hook"):
            if key in env:
                raise InvalidSpec(f"job_runtime_env.{key} is set by the operator (it carries the job spec and secrets)")
        env["working_dir"] = str(package_dir)
        env["worker_process_setup_hook"] = SETUP_HOOK
        if self.ship_package:
            env["py_modules"] = [*env.get("py_modules", []), str(PACKAGE_DIR)]
        return env

    def _submit(self, submission_id: str, spec: AnySpec, package_dir: Path) -> None:
        (package_dir / "spec.json").write_text(spec.to_json())
        secrets = self.job_secrets()
        if secrets:
            path = package_dir / SECRETS_FILE
            path.touch(mode=0o600)
            path.write_text(json.dumps(secrets))
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
            self.log.info("Output prefix %s; Ray submission %s (%s)", spec.output_uri, submission_id, action)
            if action == "submit":
                self._submit(submission_id, spec, package_dir)
        self._submission_id = submission_id
        context["ti"].xcom_push(key="ray_job_url", value=self.hook.settings.dashboard_job_url(submission_id))
        context["ti"].xcom_push(key="submission_id", value=submission_id)
        if self.deferrable:
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
        """Poll the job and copy its new log lines into the task log."""
        printed = 0
        clock = OutageClock(submission_id, self.unreachable_timeout)
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
            try:
                logs = self.hook.get_job_logs(submission_id)
            except Exception as exc:  # logs are a courtesy; status decides
                self.log.debug("could not read job logs: %s", exc)
                logs = ""
            if len(logs) > printed:
                for line in logs[printed:].splitlines():
                    done = parse_progress(line)
                    if done is not None:
                        self.log.info("Progress: %s", describe_progress(done))
                    elif line.strip() and not line.startswith(MANIFEST_LOG_PREFIX):
                        self.log.info("[ray] %s", line)
                printed = len(logs)
            status = str(info["status"])
            if status not in ACTIVE_STATES:
                return status, str(info.get("message") or "")
            time.sleep(self.poll_interval)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(event, dict) or "status" not in event or "submission_id" not in event:
            raise RayLLMError(f"unexpected trigger event {event!r}")
        submission_id = str(event["submission_id"])
        self._submission_id = submission_id
        return self._finish(context, submission_id, str(event["status"]), str(event.get("message") or ""))

    # --- finish ---------------------------------------------------------------------------------
    def _job_error_line(self, submission_id: str) -> tuple[str, str]:
        try:
            logs = self.hook.get_job_logs(submission_id)
        except Exception:
            return "", ""
        ours = [line[len(ERROR_LOG_PREFIX) :] for line in logs.splitlines() if line.startswith(ERROR_LOG_PREFIX)]
        tail = "\n".join(logs.splitlines()[-40:])
        return (ours[-1] if ours else ""), tail

    def _finish(self, context: Context, submission_id: str, status: str, message: str) -> dict[str, Any]:
        if status == "LOST":
            raise RayJobLost(f"{message}; a retry of this task submits the job again")
        if status != "SUCCEEDED":
            error, tail = self._job_error_line(submission_id)
            if tail:
                self.log.error("Last lines of Ray job %s:\n%s", submission_id, tail)
            detail = f": {error}" if error else ""
            raise RayJobFailed(f"Ray job {submission_id} ended {status}{detail} (Ray: {message})")
        manifest = self._read_manifest(submission_id)
        self._publish(context, manifest)
        self._annotate_outlets(context, manifest)
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

    def _annotate_outlets(self, context: Context, manifest: dict[str, Any]) -> None:
        """Each declared outlet asset's event carries where this run's output is (URIs and figures only)."""
        events = context.get("outlet_events")
        if events is None or not self.outlets:  # (an empty accessor mapping is falsy but usable)
            return
        extra = {
            "output_uri": manifest.get("outputs_uri") or manifest.get("output_uri"),
            "manifest_uri": manifest.get("output_uri"),
            "submission_id": manifest.get("submission_id"),
            "rows_out": manifest.get("rows_out"),
            "rows_errored": manifest.get("rows_errored"),
        }
        for outlet in self.outlets or []:
            try:
                events[outlet].extra.update({k: v for k, v in extra.items() if v is not None})
            except (KeyError, TypeError, AttributeError) as exc:
                self.log.debug("outlet %r takes no event extra: %s", outlet, exc)

    def _publish(self, context: Context, manifest: dict[str, Any]) -> None:
        """Push the output location and say what the job did (batch jobs; the upload operator overrides)."""
        context["ti"].xcom_push(key="output_uri", value=manifest["outputs_uri"])
        try:
            secrets = self.job_secrets()
        except Exception:  # a link is a courtesy
            secrets = {}
        custom = any(k in secrets for k in ("AWS_ENDPOINT_URL", "STORAGE_EMULATOR_HOST"))
        url = output_browser_url(manifest["outputs_uri"], custom_endpoint=custom)
        if url:
            context["ti"].xcom_push(key=OUTPUT_URL_XCOM, value=url)
        self.log.info(
            "Published %s: %d rows in, %d out, %d errors; tokens in/out %d/%d",
            manifest["output_uri"],
            manifest["rows_in"],
            manifest["rows_out"],
            manifest["rows_errored"],
            manifest["input_tokens"],
            manifest["output_tokens"],
        )
        if manifest["rows_errored"]:
            self.log.warning("%d error rows are in %s", manifest["rows_errored"], manifest["errors_uri"])

    def _read_manifest(self, submission_id: str) -> dict[str, Any]:
        """The published manifest; it must be this submission's (a stale one is never returned)."""
        info = self.hook.get_job_info(submission_id) or {}
        output_uri = (info.get("metadata") or {}).get(METADATA_OUTPUT_URI)
        manifest: dict[str, Any] | None = None
        if output_uri:
            try:
                from airflow_provider_rayllm.job import manifest as manifest_io

                manifest = manifest_io.read(output_uri, {**os.environ, **self.job_secrets()})
            except Exception as exc:  # e.g. a path only the cluster can see
                self.log.info("Manifest at %s not readable from this worker (%s); using the job log copy", output_uri, exc)
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
                self.log.error("The deferred wait ended without the job's result (%s)", (next_kwargs or {}).get("error"))
                self.on_kill()
        return super().resume_execution(next_method, next_kwargs, context)

    def on_kill(self) -> None:
        if self._submission_id:
            self.log.info("Stopping Ray job %s", self._submission_id)
            try:
                self.hook.stop_job(self._submission_id)
            except Exception as exc:
                self.log.error("could not stop Ray job %s: %s", self._submission_id, exc)
