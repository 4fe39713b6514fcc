"""Write docs/OPERATORS.md: every operator argument with its default and what it does, and what each operator
pushes to XCom.

    python scripts/operator_reference.py          # rewrite the file
    python scripts/operator_reference.py --check  # exit 1 when the file is out of date

Everything comes from the argument declarations (``airflow_provider_rayllm/operators/arguments.py``: the job spec's
fields and the Airflow half's own settings); an argument without a description is an error, so a new
argument cannot land undocumented (tests/unit/test_docs.py runs --check).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
OUT = REPO / "docs" / "OPERATORS.md"

# The run report: what the page shows and where its link leads (links.report_browser_url).
REPORT = """## The run report

Each successful publish writes `_report.html` beside `_manifest.json` in the output prefix, just before the
manifest, which names it (`report_uri`); folder readers skip it like every `_` name. It is one self-contained
page (inline CSS and SVG, no script, a Content-Security-Policy that forbids scripts and fetches), made from the
manifest's body alone by `airflow_provider_rayllm.contract.report.render(manifest)`, so it can be made again
from any published `_manifest.json`. It shows:

- rows out / in / errored / resumed, tokens in and out, output tokens per second of answering (from the
  engine ready, or the stream's start for an endpoint, to the stream's end), wall time;
- the estimated cost when a price was given (`price_per_hour`, `price_per_1k_input_tokens`,
  `price_per_1k_output_tokens`), else "not priced";
- rows answered over time (`rows_over_time`: at most 60 samples of the answered batches), with the moments
  the engine was ready, the first file was written and the stream ended;
- where the seconds went, from the driver's `timeline`: start-up and checks (to the plan's start), engine
  start (the input is read meanwhile), streaming (to `stream_done_s`), checks and publish (to the manifest);
  the seconds before the driver connected to Ray (the Jobs API's queue, the runtime environment) are not in it;
- error rows by reason (`errors_by_reason`) with the error files, and the output files.

The task's "Report" link (Details tab) opens it where a browser can:

| output | link |
|---|---|
| local path | `file://` URL. Browsers do not follow a `file://` link from the UI's http page: open it (copy the address) in a browser on the machine that holds the file. |
| s3:// behind `endpoint_url` (MinIO, a test server) | the object's path-style URL on that endpoint; it shows where the bucket may be read unsigned. |
| s3:// on AWS | the object's page in the AWS console ("Open" shows the page). |
| gs:// on GCS | `https://storage.cloud.google.com/<bucket>/<key>`: shown to a signed-in user who may read it. |
| gs:// behind an emulator | the object's media URL on the emulator. |

On S3 and GCS the page is stored with `Content-Type: text/html`. `make ui` serves Airflow's UI over the
demo's run (docs/DEPLOYING.md).
"""

XCOM = [
    (
        "VLLMBatchOperator, HttpLLMBatchOperator",
        "`return_value`",
        "The manifest: `output_uri` (the task's prefix), `outputs_folder` (the prefix itself: its visible files are the published rows) and `errors_folder` (`<prefix>/_errors`), `output_files` / `error_files` (URI, rows, bytes each), `rows_in` / `rows_out` / `rows_errored` / `rows_resumed` / `rows_resume_stale` (saved rows dropped as their request changed), `errors_by_reason`, token totals, `timeline` and `rows_over_time`, `report_uri`, the engine's resolved settings, `estimated_cost` (None without a price) and, with `canary_rows`, `canary` (its figures and verdict).",
    ),
    (
        "VLLMBatchOperator, HttpLLMBatchOperator",
        "`report_url`",
        "The run's report page (`<prefix>/_report.html`) at an address a browser opens; the task's \"Report\" link.",
    ),
    (
        "VLLMBatchOperator, HttpLLMBatchOperator",
        "`outputs_folder`",
        "The folder of the published output files: the output prefix itself (hidden `_` names aside).",
    ),
    (
        "VLLMBatchOperator, HttpLLMBatchOperator",
        "`output_console_url`",
        "The outputs folder in the AWS or Google Cloud console (s3:// and gs:// outputs without a custom endpoint).",
    ),
    (
        "ModelUploadOperator",
        "`return_value`",
        "The model manifest: the bucket URI, files, bytes, checksum, and whether the upload was skipped (same content already there).",
    ),
    (
        "ModelUploadOperator",
        "`model_uri`",
        "The bucket URI holding the model: give it as `model_source` of VLLMBatchOperator.",
    ),
    (
        "every operator",
        "`submission_id`, `ray_job_url`",
        "The Ray job's submission id and its page in the Ray dashboard.",
    ),
]

# How the Limits group's canary, gate, prices and budgets work together (the tables say each one alone).
CANARY_AND_BUDGETS = [
    "## Canary, quality gate, cost and budgets\n",
    "With `canary_rows=N` the job answers the first N input rows first and judges them against `quality_gate`",
    "(without one, against `max_error_fraction`). `quality_gate` is a `QualityGate` or a dict with any of",
    "`max_error_rate`, `min_json_schema_pass_rate` (needs a JSON schema in `sampling_params`:",
    "`structured_outputs={'json': schema}` or `guided_json`), `min_mean_output_chars`, and `check`: a",
    "`'package.module:function'` (or a function, pickled with the job) called inside the job with the canary's",
    "output rows, returning `(passed, reason)`.\n",
    "- A failing canary stops the job before the rest of the input is read: only the canary's rows are sent. It",
    "  writes `_canary.json` (gate, figures, reasons, a few failing rows, tokens, estimated cost) to",
    "  `<output_uri>/_generations/<attempt>/`, logs the failing rows, publishes nothing (an earlier publish",
    "  stays as it was) and fails the task with `RayJobRefused` (an `AirflowFailException`: no retry).",
    "- A passing canary's rows are part of the output: the rest of the input is read without them (matched by",
    "  each row's content, once per canary row), so every row is answered once. The manifest's `canary` key",
    "  holds its verdict and figures. With a vLLM engine the canary and the rest are two streams, so the",
    "  engine starts twice; an endpoint costs nothing more.\n",
    "Every manifest has `estimated_cost` (None without a price): engine time x `price_per_hour` for vLLM",
    "(default: the `ray` connection's extra `price_per_hour`), tokens x `price_per_1k_input_tokens` /",
    "`price_per_1k_output_tokens` for an endpoint (default: the endpoint connection's extras).",
    "`max_tokens_budget` (input + output tokens) and `max_cost` are checked as each batch of answers arrives",
    "(the canary's included): a run that passes one stops there, publishes nothing and fails the task with",
    "`RayJobRefused` naming the budget and what was spent. What is spent beyond the budget is at most the",
    "batches in flight when it passed.\n",
    "`stall_timeout_s` (default 3600 s) ends a job in which no row has been answered for that long since its",
    "stream started (engine start-up included) or its last answer: an engine or endpoint that stopped answering",
    "fails the task with `no row answered for N s (stall_timeout_s=N)` instead of holding the cluster; nothing is",
    "published, and a retry resumes from the rows saved. `None` sets no limit.\n",
]


# What prefix_window_rows does to the stream and to the output's row order (the table says the setting alone).
PREFIX_GROUPING = [
    "## Prefix grouping\n",
    "Rows that share a long prompt prefix (a system prompt with few-shot examples, one document asked many",
    "questions) are put next to each other before they are cut into engine batches, so the engine's prefix",
    "cache computes the prefix once for them instead of once per row. It happens in a window of",
    '`prefix_window_rows` rows (default 2,048 for `task_type="generate"`; off for pooling tasks, and with',
    "`image_column`, whose rows carry their images; `0` turns it off): the stream stays a stream, with no sort",
    "over the whole input. A row's prefix is its model (a LoRA",
    "adapter's), every chat message but the last, and the last message's text up to and including its last",
    'blank line (`"\\n\\n"`); a prompt\'s text up to its last blank line. So',
    '`prompt_template="{document}\\n\\nQuestion: {question}"` groups by document, and `system_prompt` before',
    "single questions groups by the system prompt; a question with a blank line of its own splits its",
    "document's group (no harm beyond fewer cache hits). A `preprocess` that returns neither messages nor a",
    "prompt leaves its rows where they are. The window is cut into engine batches in order: a group fills",
    "consecutive batches (with `concurrency` > 1 they may go to different replicas, each computing the prefix",
    "once), and the first rows reach the engine when a window has been read (or the input ends).\n",
    "Rows keep their ids and every column; only the order changes: same-prefix rows leave together, groups in",
    "the order their first row came, rows of a group in their own order. The output was never in input order",
    "(Ray Data runs without `preserve_order`); match rows by `id_column` or your own key column.",
    'Measured gain: docs/PERFORMANCE.md ("Prefix grouping").\n',
]


def _default(argument: object) -> str:
    if argument.required:
        return "**required**"
    if callable(argument.default):
        return f"`{argument.default()!r}`"
    return f"`{argument.default!r}`"


# The groups a reader looks for, in the order of a job's flow (section of the job spec -> heading).
GROUPS = {
    "files": "Input",
    "sql": "Input",
    "rows": "Input",
    "prompt": "Prompt and sampling",
    "processor": "Engine: the guide's `vLLMEngineProcessorConfig` fields",
    "serve": "Engine: a Ray Serve deployment instead of an engine in the job",
    "http": "Engine: the guide's HTTP processor (an OpenAI-compatible endpoint)",
    "upload": "Model",
    "sink": "Output",
    "incremental": "Incremental runs: reuse the last published run's answers",
    "limits": "Limits",
}
# Arguments the Airflow half keeps for itself, by the group they belong to.
OWN_GROUP = {"sql_conn_id": "files", "output_table": "sink", "output_table_conn_id": "sink", "http_conn_id": "http"}


def _group(argument: object) -> str:
    if argument.path:
        return argument.path[0]
    return OWN_GROUP.get(argument.name, "processor")  # the guide's flag names map to the engine's stages


def _type(cls: type, name: str) -> str:
    import inspect

    for owner in cls.__mro__:
        init = owner.__dict__.get("__init__")
        if init is None:
            continue
        param = inspect.signature(init).parameters.get(name)
        if param is not None and param.annotation is not inspect.Parameter.empty:
            return f"`{param.annotation}`".replace("|", chr(92) + "|")
    raise SystemExit(f"{cls.__name__}.{name} is not a typed parameter of its __init__")


def _row(cls: type, a: object) -> str:
    if not a.description:
        raise SystemExit(f"{cls.__name__}.{a.name} has no description: give its field one")
    mark = " (T)" if a.templated else ""
    return f"| `{a.name}`{mark} | {_type(cls, a.name)} | {_default(a)} | {a.description.replace('|', chr(92) + '|')} |"


def render() -> str:
    from airflow_provider_rayllm.operators.arguments import JOB, operator_arguments
    from airflow_provider_rayllm.operators.base import RayJobOperator
    from airflow_provider_rayllm.operators.http_batch import HttpLLMBatchOperator
    from airflow_provider_rayllm.operators.model_upload import ModelUploadOperator
    from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

    common = {a.name for a in JOB}
    ops = [
        (
            VLLMBatchOperator,
            "vllm",
            "Runs ray.data.llm's vLLM processor over files, a SQL query or given rows as a Ray job.",
        ),
        (HttpLLMBatchOperator, "http", "Sends every row to an OpenAI-compatible endpoint from a pool of Ray actors."),
        (
            ModelUploadOperator,
            "upload",
            "Uploads model weights to an s3:// or gs:// prefix as a Ray job, verified file by file.",
        ),
    ]
    parts = [
        "# Operator arguments\n",
        "Generated by `python scripts/operator_reference.py` from the operators' typed `__init__` signatures and",
        "the argument declarations (the job spec's fields and the Airflow half's own settings); a unit test keeps",
        "it current. Each operator writes these parameters, typed, in its own `__init__`, so an editor shows them",
        "and `mypy` rejects a misspelled or mistyped one; an argument an operator does not take is also refused",
        "at parse time with a TypeError naming the operator that takes it. Templated arguments are marked (T):",
        "they also take a Jinja string, rendered before the settings are checked.\n",
    ]
    for cls, kind, summary in ops:
        parts += [f"## `{cls.__name__}`\n", summary + "\n"]
        arguments = [a for a in operator_arguments(kind) if a.name not in common]
        for heading in dict.fromkeys(GROUPS[_group(a)] for a in arguments):
            rows = [_row(cls, a) for a in arguments if GROUPS[_group(a)] == heading]
            parts += [f"### {heading}\n", "| argument | type | default | what it does |", "|---|---|---|---|"]
            parts += rows + [""]
    parts += [
        "## Common arguments\n",
        "Every operator above takes these (typed as `RayJobArgs`, with Airflow's own `BaseOperator` arguments).\n",
        "| argument | type | default | what it does |",
        "|---|---|---|---|",
    ]
    parts += [_row(RayJobOperator, a) for a in JOB]
    parts += ["", *CANARY_AND_BUDGETS]
    parts += PREFIX_GROUPING
    parts += ["## XCom\n", "| operator | key | value |", "|---|---|---|"]
    parts += [f"| {op} | {key} | {value} |" for op, key, value in XCOM]
    parts += ["", REPORT]
    return "\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT.relative_to(REPO)} is out of date: run python scripts/operator_reference.py")
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
