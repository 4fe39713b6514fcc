"""Write docs/OPERATORS.md: every operator argument with its default and what it does.

    python scripts/operator_reference.py          # rewrite the file
    python scripts/operator_reference.py --check  # exit 1 when the file is out of date

Descriptions come from the job spec's own field descriptions where an argument maps onto a spec field,
and from the table below otherwise; an argument with no description is an error, so a new argument
cannot land undocumented (tests/unit/test_docs.py runs --check).
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
OUT = REPO / "docs" / "OPERATORS.md"

OWN = {
    "image_column": "Column with an image per row (bytes, a cluster path or bucket URI, or an http(s)/data: URL) for a vision-language model; turns on the multimodal stage (the guide's `has_image=True`). A cell that is not a readable image becomes an error row.",
    "serve_deployment": "Name of an LLM deployment already running on the cluster's Ray Serve: rows go to it and no engine starts in the job (`model_source` is then the model id it serves).",
    "serve_app": "The Serve application holding `serve_deployment`.",
    "serve_request_timeout_s": "With `serve_deployment`: a request slower than this becomes an error row.",
    "ray_conn_id": "Airflow connection of type `ray`: the Jobs API address, token, TLS settings, output_base.",
    "output_uri": "Output prefix (folder, s3:// or gs://) for this task instance; default `{output_base}/{dag_id}/{run_id}/{task_id}[/map_N]`.",
    "output_format": "`parquet` or `jsonl` for the output and error files.",
    "output_rows_per_file": "Answered rows per output file (files appear as each fills); default 1000, or one engine batch with `id_column` (the files written are what a resumed attempt keeps).",
    "max_error_fraction": "Fail the task (publishing nothing) when more than this share of rows are error rows.",
    "max_rows": "Process at most this many input rows (templated).",
    "deferrable": "Wait for the job in the triggerer instead of holding a worker slot.",
    "poll_interval": "Seconds between two looks at the job's status.",
    "unreachable_timeout": "Seconds the Jobs API may stay unreachable while the task waits before it fails.",
    "job_runtime_env": "Extra Ray runtime_env for the job's driver (pip, env_vars, ...); working_dir is the operator's.",
    "ship_package": "Ship this provider's package to the job as a py_module (the cluster then needs no copy of it).",
    "aws_conn_id": "Airflow `aws` connection whose credentials the job uses for s3:// (passed as a job secret).",
    "gcp_conn_id": "Airflow `google_cloud_platform` connection whose key the job uses for gs:// (job secret).",
    "output_table": "Also write the output rows to this table (created when missing); a rerun replaces its own rows.",
    "output_table_conn_id": "Airflow SQL connection of `output_table`.",
    "hf_conn_id": "Connection whose password is a Hugging Face token, for gated models (job secret).",
    "entrypoint_num_cpus": "CPUs the job's driver reserves on the cluster (Ray's default: 0).",
    "entrypoint_resources": "Custom resources the job's driver reserves, e.g. `{\"rayllm_driver\": 1}` so the cluster queues drivers.",
    "sql_conn_id": "Airflow SQL connection (PostgreSQL, MySQL, SQLite) the job's query runs on (credentials as job secrets).",
    "http_conn_id": "Connection of the OpenAI-compatible endpoint: host = base URL, password = API key (job secret).",
    "prompt_template": "str.format template over row columns, e.g. `'Summarize: {text}'`.",
    "apply_chat_template": "The guide's name for `chat_template_stage` (Ray < 2.60); mapped.",
    "tokenize": "The guide's name for `tokenize_stage`; mapped.",
    "detokenize": "The guide's name for `detokenize_stage`; mapped.",
    "has_image": "The guide's name for `prepare_multimodal_stage`; mapped.",
    "chat_template": "The guide's custom chat template string; mapped into `chat_template_stage`.",
    "concurrency": "Engine replicas (vLLM), or (min, max) to autoscale; for the HTTP operator, actors sending requests.",
    "batch_size": "Rows per batch handed to an engine replica or an HTTP actor.",
    "model": "Model name the endpoint serves.",
}
# Operator argument -> (spec model, field) when the names differ.
RENAMED = {"input_uri": ("FileSource", "uris"), "input_format": ("FileSource", "format"),
           "input_columns": ("FileSource", "columns"), "sql_shard_keys": ("SqlSource", "shard_keys"),
           "sql_parallelism": ("SqlSource", "parallelism")}


def _spec_descriptions() -> dict[str, dict[str, str]]:
    from airflow_provider_rayllm import spec

    models = {}
    for name in ("FileSource", "SqlSource", "PromptSpec", "VLLMProcessorSpec", "HttpProcessorSpec", "UploadJobSpec"):
        model = getattr(spec, name)
        models[name] = {field: (info.description or "") for field, info in model.model_fields.items()}
    return models


def describe(op_name: str, arg: str, models: dict[str, dict[str, str]]) -> str:
    if arg in OWN:
        return OWN[arg]
    if arg in RENAMED:
        model, field = RENAMED[arg]
        return models[model][field]
    order = {"ModelUploadOperator": ["UploadJobSpec"], "HttpLLMBatchOperator": ["HttpProcessorSpec"]}.get(op_name, [])
    for model in [*order, "PromptSpec", "VLLMProcessorSpec", "SqlSource", "FileSource"]:
        if models[model].get(arg):
            return models[model][arg]
    raise SystemExit(f"{op_name}.{arg} has no description: add it to OWN in scripts/operator_reference.py")


def _default(param: inspect.Parameter) -> str:
    if param.default is inspect.Parameter.empty:
        return "**required**"
    return f"`{param.default!r}`"


def render() -> str:
    from airflow_provider_rayllm.operators.base import RayLLMBatchBaseOperator
    from airflow_provider_rayllm.operators.http_batch import HttpLLMBatchOperator
    from airflow_provider_rayllm.operators.model_upload import ModelUploadOperator
    from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

    models = _spec_descriptions()
    parts = [
        "# Operator arguments\n",
        "Generated by `python scripts/operator_reference.py` from the operators' signatures and the job spec's",
        "field descriptions (a unit test keeps it current). Templated fields are marked (T).\n",
    ]
    ops = [
        (VLLMBatchOperator, "Runs ray.data.llm's vLLM processor over files or a SQL query as a Ray job."),
        (HttpLLMBatchOperator, "Sends every row to an OpenAI-compatible endpoint from a pool of Ray actors. Also takes every VLLMBatchOperator argument about input, prompts and output (not the engine's)."),
        (ModelUploadOperator, "Uploads model weights to an s3:// or gs:// prefix as a Ray job, verified file by file."),
        (RayLLMBatchBaseOperator, "Arguments every operator above takes."),
    ]
    for cls, summary in ops:
        templated = set(getattr(cls, "template_fields", ()))
        params = [p for n, p in inspect.signature(cls.__init__).parameters.items() if n not in ("self", "kwargs")]
        title = "Common arguments" if cls is RayLLMBatchBaseOperator else f"`{cls.__name__}`"
        parts += [f"## {title}\n", summary + "\n", "| argument | default | what it does |", "|---|---|---|"]
        for p in params:
            mark = " (T)" if p.name in templated else ""
            text = describe(cls.__name__, p.name, models).replace("|", "\\|")
            parts.append(f"| `{p.name}`{mark} | {_default(p)} | {text} |")
        parts.append("")
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
