"""What the two batch operators share: the input, how rows become prompts, the output, the limits, and
what a finished job pushes. The engine (vLLM or an endpoint) is each operator's own section."""

from __future__ import annotations

import hashlib
import inspect
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from airflow_provider_rayllm.contract.names import SINK_SQL_URI_ENV, SQL_URI_ENV
from airflow_provider_rayllm.contract.spec import RunSpec, SpecError
from airflow_provider_rayllm.links import (
    OUTPUT_URL_XCOM,
    REPORT_URL_XCOM,
    OutputLink,
    RayJobLink,
    ReportLink,
    output_browser_url,
    report_browser_url,
)
from airflow_provider_rayllm.operators import credentials
from airflow_provider_rayllm.operators.base import RayJobOperator, default_output_uri

if TYPE_CHECKING:
    from airflow.sdk import Context


def _pickle_by_value(fn: Callable) -> bytes:
    """Pickle the function with its module's code unless that module is an installed package.

    A DAG file (or a test module) is not importable on the Ray cluster, so pickling a function
    defined there by reference would fail in the job with ModuleNotFoundError.
    """
    import cloudpickle

    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    path = getattr(module, "__file__", "") or ""
    by_value = (
        module is not None
        and module.__name__ != "__main__"  # cloudpickle already pickles __main__ by value
        and "site-packages" not in path
        and "dist-packages" not in path
    )
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(fn)
    finally:
        if by_value:
            cloudpickle.unregister_pickle_by_value(module)


def connection_price(conn_id: str, name: str) -> float | None:
    """A price kept in a connection's extra (``price_per_hour`` on the ray connection, the per-token prices
    on an endpoint's); None when the connection has none or cannot be read here."""
    from airflow.sdk import BaseHook

    try:
        value = (BaseHook.get_connection(conn_id).extra_dejson or {}).get(name)
    except Exception:  # a missing connection fails where it is needed, with its own error
        return None
    if value is None or value == "":
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise SpecError(f"connection {conn_id!r}: extra {name}={value!r} is not a number") from None


def callable_ref(fn: Callable | str | None, name: str, package_dir: Path) -> dict[str, Any] | None:
    """A callable travels as 'module:function' or cloudpickled into the job package."""
    if fn is None:
        return None
    if isinstance(fn, str):
        return {"import_path": fn}
    if not callable(fn):
        raise SpecError(f"{name} must be a callable or a 'module:function' string, got {fn!r}")
    file_name = f"{name}.pkl"
    (package_dir / file_name).write_bytes(_pickle_by_value(fn))
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        code = getattr(fn, "__code__", None)
        source = repr(code.co_code + repr(code.co_consts).encode()) if code else repr(fn)
    return {"pickled": file_name, "digest": hashlib.sha256(source.encode()).hexdigest()[:16]}


# What a finished batch task pushes: where its published output is (an incremental run's base, next time).
OUTPUTS_FOLDER_XCOM = "outputs_folder"


def incremental_base(given: str | None, pushed: Any, output_uri: str) -> tuple[str | None, str]:
    """(the base the job reads, None for the output prefix's own published run; where it came from): the
    task's ``incremental_from``, else the output prefix its latest earlier successful run pushed, else this
    run's own output prefix (the job reads its published manifest, if any)."""
    if given:
        return str(given), "incremental_from"
    if isinstance(pushed, str) and pushed and pushed.rstrip("/") != output_uri.rstrip("/"):
        return pushed, "the output of this task's latest earlier successful run (XCom outputs_folder)"
    return None, "the run published at this task's own output_uri, if any"


class BatchOperator(RayJobOperator):
    """Rows in, one engine's answers out: the arguments and steps both batch operators share."""

    operator_extra_links = (RayJobLink(), OutputLink(), ReportLink())

    def resolve_output_uri(self, run: RunSpec) -> str:
        if self.output_uri:
            return str(self.output_uri)
        base = self.hook.settings.output_base
        if not base:
            raise SpecError(
                f"output_uri is not set and the connection {self.ray_conn_id!r} has no extra 'output_base'; give one of them"
            )
        return default_output_uri(base, run.dag_id, run.run_id, run.task_id, run.map_index)

    def already_published(self, spec: Any) -> dict[str, Any] | None:
        from airflow_provider_rayllm.contract.storage import read_manifest

        if spec.sink.table is not None:
            # The manifest is written just before the table's switch commits: only a job (whose start
            # completes a switch a crash cut short) can tell that the table agrees with it.
            return None
        try:
            manifest = read_manifest(spec.sink.uri, {**os.environ, **self.secrets()})
        except Exception as exc:  # a prefix only the cluster can read: Ray's memory decides alone
            self.log.debug("published manifest not readable here: %s", exc)
            return None
        if manifest is None or manifest.get("spec_hash") != spec.content_hash():
            return None
        run, same = manifest.get("run") or {}, spec.run
        keys = ("dag_id", "run_id", "task_id", "map_index", "clear_number")
        return manifest if all(run.get(k) == getattr(same, k) for k in keys) else None

    def source_body(self) -> dict[str, Any]:
        given = [name for name in ("input_uri", "sql", "input_rows") if getattr(self, name) is not None]
        if len(given) != 1:
            raise SpecError(
                f"give exactly one of input_uri (files), sql (with sql_conn_id) or input_rows; got {given or 'none'}"
            )
        if given[0] == "input_uri":
            return {"kind": "files", **self.section("files")}
        if given[0] == "input_rows":
            return {"kind": "rows", **self.section("rows")}
        if not self.sql_conn_id:
            raise SpecError("sql needs sql_conn_id, the Airflow connection of the database")
        dialect, _ = credentials.sql_source(self.sql_conn_id)
        return {"kind": "sql", "dialect": dialect, **self.section("sql")}

    def prompt_body(self, package_dir: Path) -> dict[str, Any]:
        prompt = self.section("prompt")
        for name in ("preprocess", "postprocess"):
            prompt[name] = callable_ref(prompt[name], name, package_dir)
        return prompt

    def sink_body(self, output_uri: str, run: RunSpec) -> dict[str, Any]:
        sink = {**self.section("sink"), "uri": output_uri}
        if self.output_table:
            if not self.output_table_conn_id:
                raise SpecError("output_table needs output_table_conn_id, the Airflow connection of the database")
            dialect, _ = credentials.sql_source(self.output_table_conn_id)
            run_key = f"{run.dag_id}/{run.run_id}/{run.task_id}/{run.map_index}"
            sink["table"] = {"table": self.output_table, "dialect": dialect, "run_key": run_key}
        return sink

    def batch_body(
        self, kind: str, engine: dict[str, Any], output_uri: str, package_dir: Path, context: Context
    ) -> dict[str, Any]:
        """The whole spec around one engine section (``{"processor" | "http" | "serve": ...}``)."""
        return {
            "kind": kind,
            "source": self.source_body(),
            "prompt": self.prompt_body(package_dir),
            **engine,
            "sink": self.sink_body(output_uri, self._run_spec(context)),
            "limits": self.limits_body(package_dir),
            "incremental": self.incremental_body(context, output_uri),
        }

    def incremental_body(self, context: Context, output_uri: str) -> dict[str, Any] | None:
        """With incremental: the base run, as ``incremental_base`` chooses it from the task's previous run."""
        if not self.incremental and self.incremental_from is None:
            return None
        pushed = None
        if self.incremental and not self.incremental_from:
            ti = context["ti"]
            # The latest earlier run of this task (and map index) that succeeded: only a success pushes it.
            pushed = ti.xcom_pull(
                task_ids=ti.task_id,
                key=OUTPUTS_FOLDER_XCOM,
                include_prior_dates=True,
                map_indexes=getattr(ti, "map_index", -1),
            )
        base, source = incremental_base(self.incremental_from, pushed, output_uri)
        if self.incremental:
            self.log.info("Incremental: base %s (%s)", base or output_uri, source)
        return {"enabled": bool(self.incremental), "base": base}

    def limits_body(self, package_dir: Path) -> dict[str, Any]:
        """The limits; a quality gate given as a model becomes its fields, and its check, when a Python
        callable, travels pickled in the job package as preprocess does."""
        limits = self.section("limits")
        gate = limits.get("quality_gate")
        if gate is None:
            return limits
        gate = gate.model_dump(exclude_none=True) if hasattr(gate, "model_dump") else dict(gate)
        if callable(gate.get("check")):
            gate["check"] = callable_ref(gate["check"], "quality_check", package_dir)
        limits["quality_gate"] = gate
        return limits

    def job_secrets(self) -> dict[str, str]:
        env = super().job_secrets()
        if self.output_table and self.output_table_conn_id:
            _, uri = credentials.sql_source(self.output_table_conn_id)
            env[SINK_SQL_URI_ENV] = uri[SQL_URI_ENV]
        if self.sql and self.sql_conn_id:
            env.update(credentials.sql_source(self.sql_conn_id)[1])
        return env

    def lineage_inputs(self) -> list[str]:
        # A SQL query or inline rows name no location; files and bucket prefixes are reported as read.
        if not self.input_uri:
            return []
        return [self.input_uri] if isinstance(self.input_uri, str) else list(self.input_uri)

    def publish(self, context: Context, manifest: dict[str, Any]) -> None:
        """Push where the output files are, annotate the outlets, and say what the job did."""
        context["ti"].xcom_push(key=OUTPUTS_FOLDER_XCOM, value=manifest["outputs_folder"])
        try:
            secrets = self.secrets()
        except Exception:  # a link is a courtesy
            secrets = {}
        custom = any(k in secrets for k in ("AWS_ENDPOINT_URL", "STORAGE_EMULATOR_HOST"))
        url = output_browser_url(manifest["outputs_folder"], custom_endpoint=custom)
        # Pushed even when empty (a local folder): Airflow reads every extra link's key when the task ends, and
        # logs an error for a key that is missing.
        context["ti"].xcom_push(key=OUTPUT_URL_XCOM, value=url or "")
        report = manifest.get("report_uri")
        report_url = (
            report_browser_url(
                report,
                s3_endpoint=secrets.get("AWS_ENDPOINT_URL_S3") or secrets.get("AWS_ENDPOINT_URL"),
                gcs_endpoint=secrets.get("STORAGE_EMULATOR_HOST"),
            )
            if report
            else ""
        )
        context["ti"].xcom_push(key=REPORT_URL_XCOM, value=report_url)
        self._annotate_outlets(context, manifest)
        cost = manifest.get("estimated_cost")
        inc = manifest.get("incremental")
        if inc:
            self.log.info(
                "Incremental: %d rows reused, %d computed, %d dropped; base %s",
                inc["rows_reused"],
                inc["rows_computed"],
                inc["rows_dropped"],
                inc["base"] or "none (every row computed)",
            )
        self.log.info(
            "Finished: %d rows in, %d out (%d resumed), %d error rows; tokens in/out %d/%d; %.0f s%s; outputs in %s",
            manifest["rows_in"],
            manifest["rows_out"],
            manifest.get("rows_resumed") or 0,
            manifest["rows_errored"],
            manifest["input_tokens"],
            manifest["output_tokens"],
            manifest["wall_time_s"],
            f"; estimated cost {cost:.4f}" if cost is not None else "",
            manifest["outputs_folder"],
        )
        if report_url:
            self.log.info("Run report: %s", report_url)
        if manifest["rows_errored"]:
            self.log.warning(
                "%d error rows (%s) are in %s",
                manifest["rows_errored"],
                manifest.get("errors_by_reason"),
                manifest["errors_folder"],
            )

    def summary(self, spec: Any) -> str:
        source = spec.source
        if source.kind == "files":
            what = f"files {source.uris}"
        elif source.kind == "sql":
            what = f"a {source.dialect} query on {self.sql_conn_id}"
        else:
            what = f"{len(source.rows)} given row(s)"
        limit = f" (at most {spec.limits.max_rows} rows)" if spec.limits.max_rows else ""
        return f"{type(self).__name__}: {spec.task_type} with {spec.model_name} over {what}{limit} -> {spec.output_uri}"

    def _annotate_outlets(self, context: Context, manifest: dict[str, Any]) -> None:
        """Each declared outlet asset's event carries where this run's output is (URIs and figures only)."""
        events = context.get("outlet_events")
        if events is None or not self.outlets:  # (an empty accessor mapping is falsy but usable)
            return
        extra = {
            "outputs_folder": manifest.get("outputs_folder"),
            "output_uri": manifest.get("output_uri"),
            "submission_id": manifest.get("submission_id"),
            "rows_out": manifest.get("rows_out"),
            "rows_errored": manifest.get("rows_errored"),
        }
        for outlet in self.outlets or []:
            try:
                events[outlet].extra.update({k: v for k, v in extra.items() if v is not None})
            except (KeyError, TypeError, AttributeError) as exc:
                self.log.debug("outlet %r takes no event extra: %s", outlet, exc)
