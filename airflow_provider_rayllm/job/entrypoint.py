"""``python -m airflow_provider_rayllm.job SPEC_FILE``: the Ray driver that runs one batch job.

Order matters: every check that needs no engine runs first; outputs are written under this
submission's own generation folder; the manifest is written last and is what makes the
generation the published one.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from datetime import datetime, timezone
from typing import Any

from airflow_provider_rayllm.job import checkpoint, io, manifest, progress, secrets, sql, vllm_pipeline
from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.job.prompts import (
    PRE_ERROR,
    STASH,
    LoraRouting,
    RequestBuilder,
    error_row,
    load_callable,
)
from airflow_provider_rayllm.spec import (
    ERROR_COLUMN,
    ERROR_LOG_PREFIX,
    OUTPUT_TOKENS_IN,
    OUTPUT_TOKENS_OUT,
    JobSpec,
    SpecError,
    SqlSource,
    UploadJobSpec,
    parse_spec,
)

log = logging.getLogger("airflow_provider_rayllm.job")

ENGINE_ERROR = "__inference_error__"
# Our own row maps are light Python; at 1 CPU each they would wait behind the engine's stage actors
# on a small cluster (and deadlock a 2-core one).
LIGHT = {"num_cpus": 0.2}


def _say(msg: str, *args: Any) -> None:
    log.info(msg, *args)
    sys.stdout.flush()


def _print(line: str) -> None:
    """A machine-read line (progress), printed bare so the operator finds it at the start of a line."""
    print(line, flush=True)


class Shaper:
    """Engine output row -> our output row (success) or error row; one schema each."""

    def __init__(self, spec: JobSpec, package_dir: str):
        self.output_column = spec.prompt.output_column
        self.generate = spec.task_type == "generate"
        self.postprocess = load_callable(spec.prompt.postprocess, package_dir) if spec.prompt.postprocess else None

    def output(self, row: dict[str, Any]) -> dict[str, Any]:
        stash = dict(row[STASH] or {})
        if self.generate:
            value: Any = row.get("generated_text")
        else:
            emb = row.get("embeddings")
            value = emb.tolist() if hasattr(emb, "tolist") else emb
        tokens = {
            OUTPUT_TOKENS_IN: int(row.get("num_input_tokens") or 0),
            OUTPUT_TOKENS_OUT: int(row.get("num_generated_tokens") or 0),
        }
        if self.postprocess is not None:
            view = {k: v for k, v in row.items() if not k.startswith("__")}
            view.update(stash)
            if not self.generate:
                view["embeddings"] = value
            result = self.postprocess(view)
            if not isinstance(result, dict):
                raise TypeError(f"postprocess returned {type(result).__name__}, not a dict")
            return {**result, **{k: v for k, v in tokens.items() if k not in result}}
        return {**stash, self.output_column: value, **tokens}



def _check_error_fraction(errors: int, rows: int, limit: float, where: str) -> None:
    if rows and errors / rows > limit:
        raise JobError(
            f"{errors} of {rows} rows failed ({errors / rows:.1%}), above max_error_fraction={limit}; "
            f"nothing was published ({where})"
        )


def _token_totals(outputs: Any) -> tuple[int, int]:
    """Token totals from the materialized blocks, read by the driver (no aggregation tasks to start)."""
    import pyarrow.compute as pc
    import ray

    totals = [0, 0]
    for ref in outputs.to_arrow_refs():
        table = ray.get(ref)
        for i, column in enumerate((OUTPUT_TOKENS_IN, OUTPUT_TOKENS_OUT)):
            if column in table.column_names and table.num_rows:
                totals[i] += int(pc.sum(table.column(column)).as_py() or 0)
    return totals[0], totals[1]


def _input_columns(ds: Any) -> list[str]:
    schema = ds.schema()
    if schema is None:
        return []
    return list(schema.names)


class VLLMPipeline:
    """ray.data.llm's vLLM processor, after the checks that need no engine."""

    def __init__(self, spec: JobSpec, package_dir: str):
        assert spec.processor is not None
        self.spec, self.p, self.package_dir = spec, spec.processor, package_dir

    def check(self) -> None:
        p = self.p
        vllm_pipeline.check_model_source(p.model_source)
        gpus = vllm_pipeline.cluster_gpus()
        self.profile = vllm_pipeline.resolve_profile(p, gpus)
        self.engine_kwargs = vllm_pipeline.engine_kwargs_for(p, self.profile)
        self.placement = vllm_pipeline.placement_for(p, self.profile, self.engine_kwargs)
        vllm_pipeline.check_resources(p, self.profile, self.placement, gpus)
        vllm_pipeline.check_parallel(self.profile, self.engine_kwargs, self.placement)
        vllm_pipeline.check_engine_kwargs(p.model_source, self.engine_kwargs)
        vllm_pipeline.check_lora_adapters(p.dynamic_lora_loading_path, p.lora_adapters)
        vllm_pipeline.warn_if_underfed(p, self.engine_kwargs)
        if p.task_type == "generate" and self.spec.prompt.preprocess is None:
            vllm_pipeline.check_sampling_params(self.spec.prompt.sampling_params)
        _say("profile %s (cluster GPUs: %g); engine_kwargs %s; placement %s", self.profile, gpus, self.engine_kwargs, self.placement)

    def lora(self) -> LoraRouting | None:
        p = self.p
        if self.spec.prompt.lora_column and p.dynamic_lora_loading_path:
            return LoraRouting(p.model_source, p.dynamic_lora_loading_path, p.lora_adapters)
        return None

    def infer(self, good: Any, rows: int, checkpoint_uri: str | None, watch: progress.ProgressLog) -> tuple[Any, Any]:
        processor = vllm_pipeline.build(self.p, self.profile, self.engine_kwargs, self.placement)
        shaper = Shaper(self.spec, self.package_dir)
        return progress.infer_rows(
            good, rows, self.p.batch_size, processor, watch, ENGINE_ERROR, OUTPUT_TOKENS_OUT, shaper.output, LIGHT, checkpoint_uri
        )

    def details(self, input_tokens: int, output_tokens: int) -> dict[str, Any]:
        return {"resource_profile": self.profile, "engine_kwargs": self.engine_kwargs}

    def versions(self) -> dict[str, str]:
        import vllm

        return {"vllm": getattr(vllm, "__version__", "unknown")}


class HttpPipeline:
    """Requests to an OpenAI-compatible endpoint from a pool of Ray actors."""

    def __init__(self, spec: JobSpec, package_dir: str):
        assert spec.http is not None
        self.spec, self.http = spec, spec.http

    def check(self) -> None:
        from airflow_provider_rayllm.job import http_pipeline

        http_pipeline.check(self.http)
        _say(
            "endpoint %s, model %s; %d actor(s) x %d in flight; qps cap %s",
            self.http.url, self.http.model, self.http.concurrency, self.http.max_in_flight, self.http.qps,
        )

    def lora(self) -> None:
        return None

    def infer(self, good: Any, rows: int, checkpoint_uri: str | None, watch: progress.ProgressLog) -> tuple[Any, Any]:
        from airflow_provider_rayllm.job import http_pipeline

        return http_pipeline.infer(good, rows, self.http, self.spec.prompt.output_column, LIGHT, watch, checkpoint_uri)

    def details(self, input_tokens: int, output_tokens: int) -> dict[str, Any]:
        from airflow_provider_rayllm.job import http_pipeline

        return {
            "endpoint": self.http.url,
            "estimated_cost": http_pipeline.cost(self.http, input_tokens, output_tokens),
        }

    def versions(self) -> dict[str, str]:
        import aiohttp

        return {"aiohttp": aiohttp.__version__}


class ServePipeline:
    """Requests to an LLM deployment already running on the cluster's Ray Serve."""

    def __init__(self, spec: JobSpec, package_dir: str):
        assert spec.serve is not None
        self.spec, self.serve = spec, spec.serve

    def check(self) -> None:
        from airflow_provider_rayllm.job import serve_pipeline

        serve_pipeline.check(self.serve)
        _say(
            "Serve deployment %s of application %s (model %s); %d actor(s), batches of %d",
            self.serve.deployment_name, self.serve.app_name, self.serve.model, self.serve.concurrency, self.serve.batch_size,
        )

    def lora(self) -> None:
        return None

    def infer(self, good: Any, rows: int, checkpoint_uri: str | None, watch: progress.ProgressLog) -> tuple[Any, Any]:
        from airflow_provider_rayllm.job import serve_pipeline

        return serve_pipeline.infer(good, rows, self.serve, self.spec.prompt.output_column, LIGHT, watch, checkpoint_uri)

    def details(self, input_tokens: int, output_tokens: int) -> dict[str, Any]:
        return {"serve_app": self.serve.app_name, "serve_deployment": self.serve.deployment_name}

    def versions(self) -> dict[str, str]:
        return {}


class Resume:
    """Rows an earlier generation of this run finished (``prompt.id_column``), and where this one saves its own."""

    def __init__(self, id_column: str, uri: str, saved: Any):
        self.id_column, self.uri, self.saved = id_column, uri, saved
        self.saved_rows = saved.num_rows if saved is not None else 0

    @classmethod
    def open(cls, spec: JobSpec, submission_id: str, gen_uri: str) -> Resume | None:
        id_column = spec.prompt.id_column
        if not id_column:
            return None
        generations = io.join(spec.sink.uri, manifest.GENERATIONS)
        published = manifest.read(spec.sink.uri)
        earlier = checkpoint.earlier_generations(
            generations, submission_id, (published or {}).get("submission_id")
        )
        saved = checkpoint.read_saved(
            [checkpoint.checkpoint_uri(io.join(generations, name)) for name in earlier], id_column
        )
        if saved is not None:
            _say("resume: %d row(s) finished by %s are not computed again", saved.num_rows, ", ".join(earlier))
        return cls(id_column, checkpoint.checkpoint_uri(gen_uri), saved)

    def check_unique(self, prepared: Any, rows_in: int) -> None:
        """Ids are read from the prepared rows (already materialized), not from the source again."""
        column = self.id_column
        ids = prepared.map(lambda r: {column: (r[STASH] or {}).get(column)}, **LIGHT)
        distinct = len(ids.unique(column))
        if distinct != rows_in:
            raise JobError(
                f"prompt.id_column {self.id_column!r} must be unique per row: {rows_in} rows have "
                f"{distinct} distinct values"
            )

    def skip_finished(self, good: Any) -> tuple[Any, int]:
        if self.saved is None:
            return good, good.count()
        done = set(self.saved.column(self.id_column).to_pylist())
        column = self.id_column
        remaining = good.filter(lambda r: (r[STASH] or {}).get(column) not in done, **LIGHT).materialize()
        todo = remaining.count()
        _say("resume: %d row(s) left for the engine", todo)
        return remaining, todo

    def with_saved(self, outputs: Any) -> Any:
        if self.saved is None:
            return outputs
        import ray.data

        saved = ray.data.from_arrow(self.saved)
        return saved if outputs is None else outputs.union(saved).materialize()


def open_pipeline(spec: JobSpec, package_dir: str) -> VLLMPipeline | HttpPipeline | ServePipeline:
    pipelines = {"vllm": VLLMPipeline, "http": HttpPipeline, "serve": ServePipeline}
    return pipelines[spec.kind](spec, package_dir)


def run(spec: JobSpec, submission_id: str, package_dir: str) -> dict[str, Any]:
    import ray

    ray.init(log_to_driver=True)
    started = time.time()
    started_at = datetime.now(timezone.utc).isoformat()
    pipeline = open_pipeline(spec, package_dir)

    # 1. Checks that need no engine or endpoint.
    pipeline.check()

    if isinstance(spec.source, SqlSource):
        columns = sql.probe_columns(spec.source)
        _say("source: %s query with columns %s", spec.source.dialect, columns)
        ds = sql.read(spec.source)
        where = "the query"
    else:
        files = io.expand_source(spec.source)
        _say("source: %d file(s), format %s", len(files), io.file_format(spec.source, files))
        ds = io.read_source(spec.source, files)
        columns = _input_columns(ds)
        where = repr(spec.source.uris)
    missing = [c for c in spec.prompt.required_columns() if c not in columns]
    if missing:
        raise JobError(f"prompt needs column(s) {missing!r} that the input lacks; input columns: {columns!r}")
    keep = spec.prompt.keep_columns if spec.prompt.keep_columns is not None else columns
    absent = [c for c in keep if c not in columns]
    if absent:
        raise JobError(f"prompt.keep_columns {absent!r} are not input columns; input columns: {columns!r}")
    clash = {spec.prompt.output_column, OUTPUT_TOKENS_IN, OUTPUT_TOKENS_OUT, ERROR_COLUMN} & set(keep)
    if clash and spec.prompt.postprocess is None:
        raise JobError(
            f"input column(s) {sorted(clash)!r} would be overwritten by outputs; rename them, "
            "set output_column, or limit keep_columns"
        )
    if spec.limits.max_rows:
        ds = ds.limit(spec.limits.max_rows)

    # This generation starts empty; with an id column, rows an earlier attempt finished are read back.
    gen_uri = manifest.generation_uri(spec.sink.uri, submission_id)
    io.delete_dir(gen_uri)
    resume = Resume.open(spec, submission_id, gen_uri)

    # 2. Rows -> requests (a row that cannot be prompted is an error row, not a crash).
    builder = RequestBuilder(spec.prompt, spec.task_type, keep, package_dir, pipeline.lora())
    prepared = ds.map(builder, **LIGHT).materialize()
    rows_in = prepared.count()
    if rows_in == 0:
        raise JobError(f"source: no rows in {where}")
    bad_prompts = prepared.filter(lambda r: r[PRE_ERROR] != "", **LIGHT).materialize()
    good = prepared.filter(lambda r: r[PRE_ERROR] == "", **LIGHT).materialize()
    unpromptable = bad_prompts.count()
    _say("rows in: %d (%d cannot be prompted)", rows_in, unpromptable)
    _check_error_fraction(unpromptable, rows_in, spec.limits.max_error_fraction, "before the engine started")
    errors = bad_prompts.map(lambda r: error_row(r, PRE_ERROR), **LIGHT)
    outputs = None
    todo = rows_in - unpromptable
    if resume is not None:
        resume.check_unique(prepared, rows_in)
        good, todo = resume.skip_finished(good)

    # 3. The engine or endpoint; per-row failures come back as error rows.
    if todo:
        with progress.ProgressLog(todo, _print) as watch:
            outputs, call_errors = pipeline.infer(good, todo, resume.uri if resume is not None else None, watch)
        errors = call_errors.union(errors)
    if resume is not None:
        outputs = resume.with_saved(outputs)
    errors = errors.materialize()
    rows_out, rows_err = (outputs.count() if outputs is not None else 0), errors.count()
    input_tokens, output_tokens = _token_totals(outputs) if rows_out else (0, 0)
    _say("rows out: %d, error rows: %d, tokens in/out: %d/%d", rows_out, rows_err, input_tokens, output_tokens)

    # 4. Write this generation's files; nothing is published yet.
    outputs_uri, errors_uri = io.join(gen_uri, "outputs"), io.join(gen_uri, "errors")
    if rows_out:
        io.write_dataset(outputs, outputs_uri, spec.sink.format)
    if rows_err:
        io.write_dataset(errors, errors_uri, spec.sink.format)
        for row in errors.take(3):
            _say("error row: %s", row.get(ERROR_COLUMN))

    _check_error_fraction(rows_err, rows_in, spec.limits.max_error_fraction, f"error rows are in {errors_uri}")
    table_rows = 0
    if spec.sink.table is not None and outputs is not None and rows_out:
        from airflow_provider_rayllm.job import table_sink

        t = spec.sink.table
        table_rows = table_sink.write(outputs, t.dialect, t.table, t.run_key)
        _say("output table %s: %d rows for run key %s", t.table, table_rows, t.run_key)

    # 5. Publish: the manifest goes last, then older generations are removed.
    body = manifest.build(
        spec=spec,
        submission_id=submission_id,
        outputs_uri=outputs_uri,
        errors_uri=errors_uri,
        output_files=io.list_files(outputs_uri),
        error_files=io.list_files(errors_uri),
        rows_in=rows_in,
        rows_out=rows_out,
        rows_errored=rows_err,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        started_at=started_at,
        wall_time_s=time.time() - started,
        details={
            **pipeline.details(input_tokens, output_tokens),
            "rows_resumed": resume.saved_rows if resume is not None else 0,
        },
        versions={"ray": ray.__version__, **pipeline.versions()},
        table_rows=table_rows,
    )
    manifest.publish(spec.sink.uri, body)
    manifest.remove_stale_generations(spec.sink.uri, submission_id)
    return body


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
    if len(argv) != 1:
        print(f"{ERROR_LOG_PREFIX}usage: python -m airflow_provider_rayllm.job SPEC_FILE", flush=True)
        return 2
    spec_path = os.path.abspath(argv[0])
    package_dir = os.path.dirname(spec_path)
    submission_id = _submission_id()
    from airflow_provider_rayllm.job import compat

    compat.install()
    loaded = secrets.load_into_env(package_dir)
    if loaded:
        _say("secrets loaded into the environment: %s", loaded)
    try:
        with open(spec_path, encoding="utf-8") as handle:
            spec = parse_spec(handle.read())
        _say("submission %s: %s -> %s", submission_id, spec.model_name, spec.output_uri)
        if isinstance(spec, UploadJobSpec):
            from airflow_provider_rayllm.job import upload

            body = upload.run(spec, submission_id)
        else:
            body = run(spec, submission_id, package_dir)
    except (JobError, SpecError) as exc:
        print(f"{ERROR_LOG_PREFIX}{secrets.scrub(str(exc), secrets.secret_values())}", flush=True)
        return 1
    except Exception as exc:  # anything unforeseen still ends with one line the operator can quote
        import traceback

        known = secrets.secret_values()
        print(secrets.scrub(traceback.format_exc(), known), flush=True)
        first_line = (str(exc).strip().splitlines() or [""])[0][:500]
        print(f"{ERROR_LOG_PREFIX}{secrets.scrub(f'{type(exc).__name__}: {first_line}', known)}", flush=True)
        return 1
    print(manifest.log_line(body), flush=True)
    return 0
