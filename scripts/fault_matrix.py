"""Write the fault matrix at the top of docs/RELIABILITY.md from what the fault-injection tests measured.

`make test` leaves build/reliability-figures.json (each test's `record_figure`); this script turns it into one
table: each fault, how the test injects it, rows in / out / lost / duplicated, seconds to a clear end, and the
secrets found on the cluster after the end. A figure a test did not record shows as "-" with no guess.

    .venv/bin/python scripts/fault_matrix.py [--figures build/reliability-figures.json]
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "RELIABILITY.md"
FIGURES = REPO / "build" / "reliability-figures.json"
START, END = "<!-- fault-matrix:start -->", "<!-- fault-matrix:end -->"

Figures = dict[str, Any]


@dataclass
class Fault:
    item: str  # the seams issue's item, or the earlier table's number
    fault: str
    injected: str
    test: str
    key: str  # the scenario name the test records
    rows: Callable[[Figures], tuple[Any, Any, Any, Any]] | None = None  # in, out, lost, duplicated
    seconds: Callable[[Figures], Any] | None = None
    secrets: Callable[[Figures], Any] | None = None
    detail: Callable[[Figures], str] | None = None  # measured figures the columns have no place for


def _rows(n: str, out: str | None = None, lost: str | None = None, dup: str | None = None) -> Callable:
    def get(f: Figures) -> tuple[Any, Any, Any, Any]:
        rows_in, rows_out = f.get(n), f.get(out) if out else None
        rows_lost = f.get(lost) if lost else (rows_in - rows_out if None not in (rows_in, rows_out) else None)
        rows_dup = f.get(dup) if dup else (max(0, rows_out - rows_in) if None not in (rows_in, rows_out) else None)
        return rows_in, rows_out, rows_lost, rows_dup

    return get


def _kept(n: str) -> Callable[[Figures], tuple[Any, Any, Any, Any]]:
    """Every row of ``n`` published (the fault costs time): lost and duplicated as the test counted them."""
    return lambda f: (f.get(n), f.get(n), f.get("rows_lost"), f.get("duplicate_rows"))


def _answered(n: str) -> Callable[[Figures], tuple[Any, Any, Any, Any]]:
    """Every row of ``n`` answered once; the test does not count duplicates."""
    return lambda f: (f.get(n), f.get(n), 0 if n in f else None, None)


def _stopped(n: str) -> Callable[[Figures], tuple[Any, Any, Any, Any]]:
    """A run stopped on purpose: ``n`` rows in, nothing published."""
    return lambda f: (f.get(n), 0 if n in f else None, None, None)


def _accounted(answered: str, errored: str) -> Callable[[Figures], tuple[Any, Any, Any, Any]]:
    """Rows in; out = answered + error rows (an error row is published with its reason); lost = the rest."""

    def get(f: Figures) -> tuple[Any, Any, Any, Any]:
        if None in (f.get("rows"), f.get(answered), f.get(errored)):
            return f.get("rows"), None, None, None
        out = f[answered] + f[errored]
        return f["rows"], out, f["rows"] - out, 0

    return get


def _refused(f: Figures) -> list[str]:
    return sorted(k.removeprefix("refused ") for k in f if k.startswith("refused "))


def _key(name: str) -> Callable[[Figures], Any]:
    return lambda f: f.get(name)


def _crash(dialect: str, point: str) -> Fault:
    where = (
        "rows staged, manifest not written"
        if point == "after_table_stage"
        else "manifest written, switch not committed"
    )
    return Fault(
        "2",
        f"Driver dies between the table and the manifest ({dialect}, {where})",
        f"`RAYLLM_FAILPOINT={point}` ends the driver there; then a retry",
        "test_reliability::test_a_crash_between_the_table_and_the_manifest_leaves_them_agreeing_and_the_next_run_both_new",
        f"table_manifest_crash_{dialect}_{point}",
        rows=lambda f: (
            f.get("rows"),
            f.get("table_rows_after_retry"),
            f["rows"] - f["rows_from_the_published_generation"] if "rows" in f else None,
            f["table_rows_after_retry"] - f["rows"] if "rows" in f else None,
        ),
    )


FAULTS: list[Fault] = [
    Fault(
        "1",
        "Three runs of one date under new run ids, one output prefix",
        "`dag.test()` three times (new run ids), prefix read as a plain folder with pyarrow",
        "test_reliability::test_three_runs_of_one_date_under_new_run_ids_read_as_one_answer",
        "three_runs_one_prefix",
        rows=_rows("input_rows", "rows_read_from_the_prefix"),
    ),
    Fault(
        "1",
        "Two run ids writing one prefix at once",
        "two task instances started together into one `output_uri`",
        "test_reliability::test_two_runs_into_one_prefix_at_once_both_publish_and_the_prefix_reads_as_the_published_one",
        "shared_prefix",
        rows=_rows("rows_each", "rows_read_from_the_prefix"),
    ),
    *[_crash(d, p) for d in ("postgresql", "mysql") for p in ("after_table_stage", "after_manifest")],
    Fault(
        "3",
        "A map actor that dies on every start",
        "`RAYLLM_FAILPOINT` kills the caller actor in its constructor",
        "test_reliability::test_an_actor_that_dies_on_every_start_ends_the_job_in_bounded_time",
        "actor_dies_on_every_start",
        seconds=_key("seconds_to_fail"),
    ),
    Fault(
        "3",
        "An endpoint that never answers (each request held 600 s, request deadline 900 s)",
        "echo prompts `[sleep 600]`, `stall_timeout_s=6`",
        "test_reliability::test_an_endpoint_that_never_answers_ends_the_job_at_its_stall_timeout",
        "endpoint_never_answers",
        rows=_stopped("rows"),
        seconds=_key("seconds_to_fail"),
    ),
    Fault(
        "3",
        "Jobs API unreachable while the deferred task waits",
        "the dashboard's port closed for 20 s",
        "test_reliability::test_a_20_second_dashboard_outage_is_waited_out_by_the_deferred_task",
        "dashboard_outage",
        rows=_answered("rows_out"),
        seconds=_key("job_wall_time_s"),
    ),
    Fault(
        "3",
        "The Ray head restarts mid-job",
        "`ray stop` and a new head on the same ports",
        "test_reliability::test_a_restarted_head_is_job_lost_and_the_retry_runs_a_new_job",
        "lost_cluster",
        rows=_kept("retry_rows_out"),
        seconds=_key("seconds_from_restart_to_task_failure"),
    ),
    Fault(
        "3",
        "One row answered after 20 s on the HTTP path",
        "the echo endpoint holds row 0",
        "test_http_batch::test_a_slow_row_holds_back_only_its_own_batch",
        "slow_row",
        rows=_answered("rows"),
    ),
    *[
        Fault(
            "3",
            f"Task stopped ({how})",
            how,
            "test_reliability::test_stopping_the_task_stops_the_job_and_frees_the_cluster",
            f"stop: {how}",
            seconds=_key("seconds_to_stopped"),
        )
        for how in ("killed while polling", "killed while deferred", "execution_timeout while deferred")
    ],
    *[
        Fault(
            "3",
            f"Ray token {which}",
            f"the `ray` connection with {which} token",
            "test_reliability::test_a_bad_ray_token_fails_fast_without_a_retry_loop",
            f"auth: {which} token",
            seconds=_key("seconds_to_fail"),
        )
        for which in ("wrong", "no")
    ],
    *[
        Fault(
            "4",
            f"Secrets after a job that {case}",
            "canaries in the endpoint's API key and a runtime_env token; every node file and store package read",
            "test_secrets::test_no_secret_survives_a_job_that_succeeds_fails_or_is_stopped",
            f"secrets: job {case}",
            secrets=_key("secrets_left"),
        )
        for case in ("succeeded", "failed", "stopped")
    ],
    Fault(
        "4",
        "Secrets after a driver SIGKILLed (no cleanup runs), then the next job",
        "`kill -9` of the driver mid-job",
        "test_secrets::test_secrets_a_killed_driver_left_are_removed_by_the_next_job",
        "secrets: driver SIGKILLed, then the next job",
        secrets=_key("secrets_left"),
    ),
    Fault(
        "4",
        "Secrets after a job stopped while PENDING (its driver never ran)",
        "`entrypoint_resources` no node has, then `on_kill`",
        "test_secrets::test_a_job_stopped_while_pending_leaves_no_secret_once_on_kills_sweep_ran",
        "secrets: stopped while pending",
        seconds=_key("seconds_to_swept"),
        secrets=_key("secrets_left"),
    ),
    Fault(
        "3",
        "An image server that sends its body one byte at a time",
        "a local server drips a byte every 0.05 s; fetch deadline 1.5 s",
        "test_prompts::test_a_server_that_drips_one_byte_at_a_time_is_an_error_row_in_bounded_time",
        "image_server_drips",
        seconds=_key("seconds_to_error"),
        detail=lambda f: "the row's error: the fetch took longer than its deadline",
    ),
    *[
        Fault(
            "3",
            f"A {name} server that accepts the connection and never answers",
            "a loopback socket that never speaks; connect deadline 2 s",
            "test_sql_deadlines::test_a_server_that_never_answers_ends_the_connect_within_its_deadline",
            f"sql_server_silent_{dialect}",
            seconds=_key("seconds_to_error"),
        )
        for dialect, name in (("postgresql", "PostgreSQL"), ("mysql", "MySQL"))
    ],
    Fault(
        "5",
        "An HTTP answer over the body cap and one that is not UTF-8, in a batch with a good one",
        "a local endpoint answers one row with a body over `max_response_bytes=4096`, one with latin-1 bytes",
        "test_http_client::test_a_body_over_the_cap_or_not_utf8_is_an_error_row_for_that_row_only",
        "http_response_bounds",
        rows=_accounted("answered", "error_rows"),
        seconds=_key("seconds"),
        detail=lambda f: f"{f.get('error_rows')} error rows, {f.get('answered')} answered",
    ),
    Fault(
        "6",
        "An image URL at an address that is not public (shared, documentation, private, loopback)",
        "`image_column` URL `http://<address>/cat.png`, one address a case",
        "test_prompts::test_only_globally_routable_addresses_are_fetched",
        "image_fetch_not_public",
        rows=lambda f: (len(_refused(f)),) * 2 + (0, 0),
        detail=lambda f: "refused before any connection: " + ", ".join(_refused(f)),
    ),
    Fault(
        "6",
        "An image path outside the input's folders",
        "`image_column` naming a file beside the inputs folder",
        "test_prompts::test_an_image_path_outside_the_inputs_folder_is_an_error_row_and_inside_is_read",
        "image_path_outside_prefixes",
        rows=_accounted("read", "error_rows"),
        detail=lambda f: f"{f.get('error_rows')} error row, {f.get('read')} read",
    ),
    Fault(
        "7",
        "A model uploaded over another model at the same prefix",
        "`overwrite=True` with a model that drops one of the old files and adds one",
        "test_upload_job::test_an_overwrite_leaves_no_file_of_the_old_model",
        "model_overwrite",
        detail=lambda f: (
            f"old model's files left {f.get('old_files_left')}; files under the prefix "
            f"{f.get('files_under_the_prefix')}, the new model's {f.get('new_model_files')}; "
            f"files failing verification {f.get('unverified_files')}"
        ),
    ),
    *[
        Fault(
            "8",
            f"Rows changed by another session during a sharded read ({dialect})",
            "every row moved to another shard, 40 deleted, 40 inserted while the read is paused",
            "test_sql_reads::test_rows_changed_while_the_read_runs_are_neither_lost_nor_read_twice",
            f"sql_snapshot_{dialect}",
            rows=_rows("rows", "rows_read", lost="rows_lost", dup="duplicate_rows"),
            detail=lambda f: f"{f.get('readers')} reader(s) in one snapshot",
        )
        for dialect in ("postgresql", "mysql", "sqlite")
    ],
    *[
        Fault(
            "8",
            f"A result larger than the socket buffers ({dialect})",
            "20,000 rows of about 1 kB read with a server-side cursor",
            "test_sql_reads::test_a_table_larger_than_a_chunk_is_fetched_a_chunk_at_a_time_from_a_server_side_cursor",
            f"sql_chunks_{dialect}",
            rows=_rows("rows", "rows_read", dup="duplicate_rows"),
            detail=lambda f: f"{f.get('blocks')} blocks, one fetch of {f.get('rows_per_fetch')} rows each",
        )
        for dialect in ("postgresql", "mysql", "sqlite")
    ],
    Fault(
        "-",
        "A pipeline worker SIGKILLed mid-job",
        "`kill -9` of the caller actor's process",
        "test_reliability::test_a_killed_pipeline_worker_costs_time_not_rows",
        "worker_death",
        rows=_kept("rows"),
        seconds=_key("seconds"),
    ),
    Fault(
        "-",
        "The vLLM engine process SIGKILLed mid-job",
        "`kill -9` of `VLLM::EngineCore`",
        "test_reliability::test_a_killed_vllm_engine_is_resumed_without_recomputing_finished_rows",
        "engine_death",
        rows=_kept("rows"),
    ),
    Fault(
        "9",
        "Stopped midway, input changed, run again",
        "stop after 36 requests, 8 prompts changed, retry",
        "test_reliability::test_a_stopped_job_run_again_does_not_recompute_finished_rows",
        "resume",
        rows=_kept("rows"),
        seconds=_key("resumed_job_seconds"),
    ),
    Fault(
        "-",
        "Crash right after submission, then a failure, then retries",
        "the worker process dies after submitting; a failed attempt; retries",
        "test_reliability::test_a_retry_after_a_crash_reattaches_and_after_a_failure_runs_a_new_generation",
        "retry_and_reattach",
        rows=lambda f: (None, None, f.get("rows_lost"), f.get("duplicate_rows")),
    ),
    Fault(
        "-",
        "Canary answers break the JSON schema",
        "`canary_rows=5` with a schema the echo endpoint cannot meet",
        "test_canary_and_budget::test_a_canary_whose_answers_break_the_schema_stops_the_job_before_the_rest",
        "canary_fails",
        rows=_stopped("rows"),
        seconds=_key("seconds"),
    ),
    *[
        Fault(
            "-",
            f"A run passes `{budget}`",
            "a budget far below the input's tokens",
            "test_canary_and_budget::test_a_run_that_passes_its_budget_stops_and_publishes_nothing",
            key,
            rows=_stopped("rows"),
        )
        for budget, key in (("max_tokens_budget", "budget_tokens"), ("max_cost", "budget_cost"))
    ],
    Fault(
        "-",
        "Shell metacharacters in templates, data, system prompt and run id",
        "payloads that would touch a file if run",
        "test_reliability::test_shell_metacharacters_in_templates_and_data_execute_nothing",
        "injection",
    ),
]


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def render(figures: dict[str, Figures]) -> str:
    stamps = sorted(f["measured_at"][:10] for f in figures.values() if "measured_at" in f)
    when = f"measured {stamps[0]} to {stamps[-1]}" if stamps else "none recorded yet"
    lines = [
        START,
        "## Fault matrix",
        "",
        f"Written by `scripts/fault_matrix.py` from `build/reliability-figures.json`, the figures the tests recorded "
        f"in `make test` ({when}). Rows: in / out (published) / lost / duplicated. A stop on purpose (canary, "
        "budget) publishes nothing: its out is 0 and the earlier publish stays. Secrets left: the jobs of "
        "test_reliability carry a canary API key, and after each test every file under the cluster's Ray temp "
        "dirs and every package in its store is read for it (a stopped driver given up to 20 s to clean up); "
        'test_secrets does the same with its own canaries. "-": the test does not measure it (a job without a '
        "secret has none to leave). The tables after this one say how each guarantee is made.",
        "",
        "| # | Fault | How it is injected | Test | Rows in / out / lost / dup | Seconds to a clear end | Secrets left |",
        "|---|---|---|---|---|---|---|",
    ]
    for fault in FAULTS:
        f = figures.get(fault.key)
        if f is None:
            measured = ["not in this run's figures"] * 3
        else:
            rows = fault.rows(f) if fault.rows else (None,) * 4
            measured = [
                " / ".join(_cell(v) for v in rows),
                _cell(fault.seconds(f) if fault.seconds else None),
                # The reliability tests' jobs carry a canary key: their fixture adds what it found after each.
                _cell(fault.secrets(f) if fault.secrets else f.get("secrets_left")),
            ]
        name = fault.fault + (f" ({fault.detail(f)})" if fault.detail and f is not None else "")
        lines.append(f"| {fault.item} | {name} | {fault.injected} | `{fault.test}` | " + " | ".join(measured) + " |")
    return "\n".join([*lines, END])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--figures", type=Path, default=FIGURES)
    figures = json.loads(parser.parse_args().figures.read_text())
    doc = DOC.read_text()
    table = render(figures)
    if START in doc:
        doc = re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: table, doc, flags=re.S)
    else:  # first time: after the title and its paragraph, before the first table
        head, _, rest = doc.partition("\n| # |")
        doc = f"{head.rstrip()}\n\n{table}\n\n## Details: each guarantee and its test\n\n| # |{rest}"
    DOC.write_text(doc)
    print(f"wrote the fault matrix ({len(FAULTS)} faults) into {DOC.relative_to(REPO)}")


if __name__ == "__main__":
    main()
