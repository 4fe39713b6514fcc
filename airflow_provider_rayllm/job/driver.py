"""One batch job as one lazy plan, run once by Ray Data's streaming executor.

    read -> requests -> engine (vLLM, endpoint or Serve deployment) -> shape and write, file by file

Order matters: every check that needs no engine runs first; the stream writes into this attempt's own
generation folder while it runs (output files appear as answers come in, error rows go to files of their
own); the counts are checked against each other; the publish moves the files to the prefix's top level
and writes the manifest that names them (see ``publish.publisher``). The object store holds a bounded window of rows whatever the input's
size, and the driver holds no rows: the counts come from the stages (see ``progress``) and from the
write tasks' results.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
import warnings
from collections import Counter
from datetime import datetime, timezone
from typing import Any, Iterator

from airflow_provider_rayllm.contract.names import (
    ERROR_COLUMN,
    OUTPUT_TOKENS_IN,
    OUTPUT_TOKENS_OUT,
    REQUEST_KEY_COLUMN,
)
from airflow_provider_rayllm.contract.spec import JobSpec, PromptSpec
from airflow_provider_rayllm.job import canary, secrets
from airflow_provider_rayllm.job.budget import Budget
from airflow_provider_rayllm.job.engines import open_engine
from airflow_provider_rayllm.job.engines.base import Engine
from airflow_provider_rayllm.job.errors import JobError, JobRefused
from airflow_provider_rayllm.job.failpoints import FAILPOINT_ENV, failpoint
from airflow_provider_rayllm.job.progress import AnswerCounter, ProgressLog
from airflow_provider_rayllm.job.publish.publisher import Publisher
from airflow_provider_rayllm.job.requests.keys import request_identity
from airflow_provider_rayllm.job.requests.prefix import PrefixGrouping, window_rows
from airflow_provider_rayllm.job.requests.stage import RequestStage
from airflow_provider_rayllm.job.sinks.files import ResultSink, totals
from airflow_provider_rayllm.job.sources import open_input
from airflow_provider_rayllm.job.stream import ACTOR_RETRIES, ERROR, LIGHT

log = logging.getLogger("airflow_provider_rayllm.job")


def log_info(msg: str, *args: Any) -> None:
    log.info(msg, *args)
    sys.stdout.flush()


def print_line(line: str) -> None:
    """A machine-read line (progress), printed bare so the operator finds it at the start of a line."""
    print(line, flush=True)


def kept_columns(prompt: PromptSpec, columns: list[str]) -> list[str]:
    """The input columns copied to each output row; the prompt's columns must all be there."""
    missing = [c for c in prompt.required_columns() if c not in columns]
    if missing:
        raise JobError(f"prompt needs column(s) {missing!r} that the input lacks; input columns: {columns!r}")
    # An earlier output read as input keeps its rows, not their old request keys (each row gets its own).
    keep = prompt.keep_columns if prompt.keep_columns is not None else [c for c in columns if c != REQUEST_KEY_COLUMN]
    absent = [c for c in keep if c not in columns]
    if absent:
        raise JobError(f"prompt.keep_columns {absent!r} are not input columns; input columns: {columns!r}")
    if REQUEST_KEY_COLUMN in keep:
        raise JobError(
            f"prompt.keep_columns: {REQUEST_KEY_COLUMN!r} is the job's own column (each output row's request key); "
            "leave it out"
        )
    clash = {prompt.output_column, OUTPUT_TOKENS_IN, OUTPUT_TOKENS_OUT, ERROR_COLUMN} & set(keep)
    if clash and prompt.postprocess is None:
        raise JobError(
            f"input column(s) {sorted(clash)!r} would be overwritten by outputs; rename them, "
            "set output_column, or limit keep_columns"
        )
    return list(keep)


def plan(
    spec: JobSpec, engine: Engine, ds: Any, keep: list[str], package_dir: str, counts: Any, saved: list[str]
) -> Any:
    """The lazy plan up to the sink: rows -> requests -> blocks of one engine batch -> answered rows, counted
    (and held to the budgets) as they leave the engine."""
    stage = dict(
        prompt=spec.prompt,
        task_type=spec.task_type,
        keep=keep,
        package_dir=package_dir,
        counts=counts,
        lora=engine.lora(),
        saved_files=saved,
        identity=request_identity(spec),
        gated=spec.gated,
        wire=engine.wire_body(),
    )
    if spec.gated:
        # One actor sees every id: the uniqueness check and the resume and incremental skips need one place.
        import ray.data

        ds = ds.map_batches(
            RequestStage,
            fn_constructor_kwargs=stage,
            batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=1),
            **ID_GATE,
            **ACTOR_RETRIES,
        )
    else:
        ds = ds.map_batches(RequestStage(**stage), batch_format="pyarrow", **LIGHT)
    window = window_rows(spec.prompt.prefix_window_rows, spec.task_type, spec.prompt.image_column is not None)
    if window:
        # Before the repartition, which cuts the window in order: a prefix's rows fill consecutive blocks.
        ds = ds.map_batches(PrefixGrouping(), batch_size=window, batch_format="pyarrow", **GROUPING)
    # Blocks of one engine batch: answers leave the engine batch by batch, not when a whole input file is
    # done (a streaming repartition: no block waits for the others).
    ds = ds.repartition(target_num_rows_per_block=engine.block_rows())
    budget = job_budget(spec, engine)
    tap = AnswerCounter(counts, ERROR, engine.tokens_out(), engine.tokens_in(), budget if budget.active else None)
    return engine.answer(ds, tap)


def job_budget(spec: JobSpec, engine: Engine) -> Budget:
    """The run's budgets (``max_tokens_budget``, ``max_cost``) at the engine's prices."""
    return Budget(spec.limits.max_tokens_budget, spec.limits.max_cost, engine.prices())


# The write tasks ask for a different share of a CPU than the stages before them, so that Ray Data keeps
# them apart: fused into the write, the progress tap would wait with it until rows_per_file rows are in.
WRITE = {"num_cpus": 0.1}
# Prefix grouping asks for a hair less than the light stages, so that Ray Data keeps it an operator of its own.
# Fused with the steps before it (for Parquet and CSV the read task itself: read -> requests -> window-sized
# batches), the read's tasks ran on past Ray Data's memory budget: the object store held the whole input's
# requests (134 MB at 10^6 rows, 40 MB at 300,000; docs/PERFORMANCE.md, Scale), growing with the input.
GROUPING = {"num_cpus": LIGHT["num_cpus"] - 0.01}
# Ray Data's streaming repartition (blocks of one engine batch) runs as tasks of a whole CPU.
REPARTITION_CPUS = 1.0
# The one actor that sees every id (with id_column) holds its share for the whole job, as the engine does:
# a tenth, so that a CPU engine, its stages and the gate leave the repartition its CPU on a 2-CPU node.
ID_GATE = {"num_cpus": 0.1}


def check_free_cpus(engine: Engine, spec: JobSpec) -> None:
    """A cluster whose CPUs the engine's actors hold entirely would never run the stream's other steps
    (the job would wait forever): refuse it, naming the numbers."""
    import ray

    total = float(ray.cluster_resources().get("CPU", 0))
    held = engine.reserved_cpus() + (ID_GATE["num_cpus"] if spec.gated else 0)
    needed = REPARTITION_CPUS + LIGHT["num_cpus"]
    if total - held < needed - 1e-6:  # shares are tenths: 2 - 0.8 is 1.1999999999999997
        raise JobError(
            f"the Ray cluster has {total:g} CPU(s) and the engine's actors hold {held:g} for the whole job; the "
            f"stream's other steps need {needed:g} more (a CPU for Ray Data's repartition, a fraction for reading "
            "and writing). Add CPUs, lower concurrency, or reserve fewer CPUs in placement_group_config"
        )


ROWS_PER_FILE = 1000


def rows_per_file(spec: JobSpec, engine: Engine) -> int:
    """Rows per output file: the user's; else 1000, or one engine batch when the job is resumable (the files
    written so far are what a later attempt keeps, so smaller files lose less to a stop)."""
    if spec.sink.rows_per_file:
        return spec.sink.rows_per_file
    return engine.block_rows() if spec.prompt.id_column else ROWS_PER_FILE


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """An error and everything under it (causes, contexts, Ray's wrapped cause), each once."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        stack += [current.__cause__, current.__context__, getattr(current, "cause", None)]


def job_error_in(exc: BaseException) -> JobError | None:
    """Our own error raised inside a stage, under Ray's wrappers."""
    for current in _chain(exc):
        if isinstance(current, JobError):
            return current
    # Raised in a stage's actor, it may come back only as text in Ray's wrapper.
    found = re.search(r"(?:^|\.)(JobError|JobRefused|BudgetExceeded): (.+)", _chain_text(exc), re.MULTILINE)
    if not found:
        return None
    return (JobError if found.group(1) == "JobError" else JobRefused)(found.group(2).strip())


def input_error_in(exc: BaseException, spec: JobSpec) -> JobError | None:
    """A reader's error that is the input's fault (text that is not UTF-8), said of the input."""
    text = _chain_text(exc)
    if "UnicodeDecodeError" not in text:
        return None
    where = getattr(spec.source, "uris", None) or "the query's rows"
    kind = getattr(spec.source, "format", None) or "text"
    found = re.search(r"UnicodeDecodeError: (.*)", text)
    return JobError(
        f"input_uri {where!r}: a {kind} file is not UTF-8 text ({found.group(1).strip() if found else 'undecodable bytes'}). "
        "Re-encode it as UTF-8, e.g. `iconv -f latin1 -t utf-8`; nothing was published"
    )


def _chain_text(exc: BaseException) -> str:
    """The text of an error and everything under it: Ray passes a worker's traceback on as text (a stage's
    exception loses its own causes when it is pickled back to the driver)."""
    return "\n".join(f"{type(current).__name__}: {current}" for current in _chain(exc))


def _configure_ray_data(spec: JobSpec) -> None:
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    # The job prints its own progress lines; Ray Data would say at WARNING that its bars are off.
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
    # Ray 2.60 takes a map actor's restarts only among ray_remote_args, which it calls deprecated (there is no
    # named parameter for them yet); the job's actors get a few restarts on purpose (stream.ACTOR_RETRIES).
    warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
    window = spec.limits.object_store_window_mb
    if window:
        limits = ctx.execution_options.resource_limits
        ctx.execution_options.resource_limits = limits.copy(object_store_memory=window * 2**20)
        log_info("object store window: %d MiB for the rows in flight", window)


def preflight(spec: JobSpec, package_dir: str) -> tuple[Any, list[str], Engine]:
    """Every check that needs no engine, no endpoint and no rows, in a connected Ray driver: the input's
    first (file heads and footers, a one-row query), then the engine's settings (which loads vLLM for its
    own judgement) and the cluster's room for them. With a canary, the input comes without max_rows: the
    canary applies it (see ``canary.run``)."""
    if spec.limits.canary_rows:
        spec = spec.model_copy(update={"limits": spec.limits.model_copy(update={"max_rows": None})})
    source = open_input(spec)
    keep = kept_columns(spec.prompt, source.columns)
    log_info("input: %s", source.description)
    engine = open_engine(spec, package_dir)
    engine.check()
    check_free_cpus(engine, spec)
    log_info("%s", engine.describe())
    window = window_rows(spec.prompt.prefix_window_rows, spec.task_type, spec.prompt.image_column is not None)
    if window:
        log_info("prefix grouping: requests sharing a prompt prefix put together in windows of %d rows", window)
    else:
        log_info(
            "prefix grouping: off (prefix_window_rows=%r, task_type %s)", spec.prompt.prefix_window_rows, spec.task_type
        )
    return source, keep, engine


def with_image_folders(spec: JobSpec, folders: list[str]) -> JobSpec:
    """The spec the row stages see: image_column paths may be read under the input's own folders unless the
    task named its own prefixes (a SQL input or rows given with the task have none)."""
    prompt = spec.prompt
    if prompt.image_column is None or prompt.image_path_prefixes is not None:
        return spec
    log_info("image_column paths are read only under the input's folder(s) %s (image_path_prefixes)", folders)
    return spec.model_copy(update={"prompt": prompt.model_copy(update={"image_path_prefixes": folders})})


def _spent(engine: Engine, written: dict[str, Any]) -> float | None:
    """The estimated cost so far of what ``written`` answered (None without a price)."""
    if not engine.spec.has_price():
        return None
    return round(engine.prices().cost(written["input_tokens"], written["output_tokens"], time.time()), 6)


def _sweep_leftover_secrets() -> None:
    """Beside the job: the secrets an earlier job left on the nodes when its driver was killed."""
    try:
        removed = secrets.sweep_leftovers()
    except Exception as exc:  # never fails the job; said, not hidden
        print(f"WARNING: could not sweep secrets left by ended jobs: {type(exc).__name__}: {exc}", flush=True)
        return
    if removed:
        log_info("removed %d secrets file(s) that ended jobs left on the cluster's nodes", len(removed))


# Runs beside the job from its start; the entrypoint waits for it (a while) before the job's own cleanup.
SWEEPER = threading.Thread(target=_sweep_leftover_secrets, name="rayllm-secrets-sweep", daemon=True)


def run(spec: JobSpec, submission_id: str, package_dir: str) -> dict[str, Any]:
    import ray

    ray.init(log_to_driver=True)
    SWEEPER.start()
    _configure_ray_data(spec)
    started = time.time()
    started_at = datetime.now(timezone.utc).isoformat()

    # 1. Checks that need no engine, no endpoint and no rows.
    try:
        source, keep, engine = preflight(spec, package_dir)
    except JobRefused:
        raise
    except JobError as exc:
        raise JobRefused(str(exc)) from None

    # 2. This attempt's own folder; with an id column, the answers an earlier attempt saved.
    publisher = Publisher.start(spec, submission_id)
    saved = publisher.find_saved()
    for repaired in publisher.repair_table():
        log_info("output table: %s", repaired)
    base = publisher.base
    if base is not None and base.warning:
        log.warning("%s", base.warning)
    elif base is not None:
        log_info("%s", base.note)
    from_base = len(base.files) if base is not None else 0
    log_info(
        "writing generation %s (%d saved file(s) of earlier attempts to resume from, %d of the incremental base)",
        publisher.uri,
        len(saved) - from_base,
        from_base,
    )

    # 3. The stream, once (with a canary: the canary's rows first, judged, then the others).
    rows_spec = with_image_folders(spec, source.folders)
    with ProgressLog(
        print_line,
        log_info,
        engine.actor_name(),
        stall_timeout_s=spec.limits.stall_timeout_s,
        totals_per_answer=job_budget(spec, engine).active,
    ) as progress:

        def stream(ds: Any, folder: str) -> list[dict[str, Any]]:
            sink = ResultSink(folder, spec.sink.format, rows_per_file(spec, engine), engine.shaper(), progress.counts)
            try:
                with progress.stoppable():
                    plan(rows_spec, engine, ds, keep, package_dir, progress.counts, saved).write_datasink(
                        sink, ray_remote_args=WRITE
                    )
            except Exception as exc:
                ours = job_error_in(exc) or input_error_in(exc, spec)
                if ours is not None:
                    raise (JobRefused if isinstance(ours, JobRefused) else JobError)(str(ours)) from None
                raise
            return sink.results

        results: list[dict[str, Any]] = []
        rest, tried = source.ds, None
        try:
            if spec.limits.canary_rows:
                tried = canary.run(
                    spec, source.ds, publisher.uri, package_dir, stream, lambda w: _spent(engine, w), log_info
                )
                rest, results = tried.rest, list(tried.results)
            if rest is not None:
                results += stream(rest, publisher.uri)
                if tried is not None and spec.limits.max_rows is None:
                    canary.check_all_dropped(tried.keys, tried.read)
        finally:
            source.close()
        stream_done = time.time()
        counted = progress.finish()
        timeline = progress.timeline(counted, started)
        timeline["stream_done_s"] = round(stream_done - started, 3)
        series = progress.series(started)
        reused = progress.reused_pairs() if saved else Counter()
    written = totals(results)
    for example in written["error_examples"]:
        log_info("error row: %s", example)

    # 4. Counts agree, the error gate; nothing is published before both pass.
    publisher.adopt_saved(reused)
    if publisher.stale_rows:
        log_info(
            "saved row(s) of earlier attempts or the incremental base left out, as their request changed or their "
            "id left the input: %d",
            publisher.stale_rows,
        )
    rows_in = publisher.check(counted, written)

    # 5. Publish: the table's rows staged, then the files to the prefix and the manifest (the table switched
    # with it), then older generations go.
    table_rows = publisher.stage_table(written)
    if table_rows is not None and spec.sink.table is not None:
        t = spec.sink.table
        log_info("output table %s: %d rows staged for run key %s", t.table, table_rows, t.run_key)
        failpoint("after_table_stage")
    body = publisher.publish(
        written,
        lambda files: publisher.build_manifest(
            submission_id=submission_id,
            written=files,
            rows_in=rows_in,
            started_at=started_at,
            wall_time_s=time.time() - started,
            timeline=timeline,
            rows_over_time=series,
            details=engine.details(files),
            versions={"ray": ray.__version__, **engine.versions()},
            table_rows=table_rows or 0,
            canary=tried.body if tried is not None else None,
            counted=counted,
        ),
    )
    if body.get("incremental"):
        inc = body["incremental"]
        log_info(
            "incremental: %d rows reused, %d computed, %d dropped (base %s)",
            inc["rows_reused"],
            inc["rows_computed"],
            inc["rows_dropped"],
            inc["base"],
        )
    removed = publisher.remove_older()
    log_info(
        "published %s: %d rows in, %d out (%d resumed), %d error rows, tokens in/out %d/%d, %.1f s; older generations removed: %d",
        spec.sink.uri,
        rows_in,
        written["rows_out"],
        publisher.adopted_rows,
        written["rows_errored"],
        written["input_tokens"],
        written["output_tokens"],
        time.time() - started,
        len(removed),
    )
    return body


__all__ = ["FAILPOINT_ENV", "run"]
