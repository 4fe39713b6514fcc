"""The job spec: what the operator asks the job to do, validated on both sides.

Imports neither Airflow nor Ray, so the operator, the job and the tests can all use it.
Unknown keys are errors that name the key; every field says what it is for.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from typing import Annotated, Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from airflow_provider_rayllm.contract.names import (
    ERROR_COLUMN,
    OUTPUT_TOKENS_IN,
    OUTPUT_TOKENS_OUT,
    REQUEST_KEY_COLUMN,
    SPEC_VERSION,
)

FileFormat = Literal["parquet", "jsonl", "csv"]
SinkFormat = Literal["parquet", "jsonl"]
TaskType = Literal["generate", "embed", "classify", "score"]
PG_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
URI_SCHEMES = ("s3", "gs", "gcs", "hf", "file")
# Read only: Hugging Face dataset repos (hf://datasets/<org>/<name>[@<revision>]/<path>) are an input, never
# an output or a model bucket.
READ_ONLY_SCHEMES = ("hf",)
HF_DATASET_URI = "hf://datasets/<org>/<name>/<path>"
# The Hub's other repo kinds, named so a misplaced URI is told what it points at.
_HF_OTHER_KINDS = {"spaces": "a Space", "buckets": "a storage bucket", "models": "a model repo"}

# The reference guide's flag names (Ray < 2.60) and the stage configs that replaced them.
GUIDE_STAGE_FLAGS = {
    "apply_chat_template": "chat_template_stage",
    "tokenize": "tokenize_stage",
    "detokenize": "detokenize_stage",
    "has_image": "prepare_multimodal_stage",
}


class SpecError(ValueError):
    """A spec that cannot run. The message names the field and quotes the value."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


def arg(
    name: str | None = None,
    *,
    templated: bool = False,
    renderer: str | None = None,
    hidden: bool = False,
    optional: bool = False,
) -> dict:
    """How a spec field shows as an operator argument (``arguments.py`` reads it): its name when it is not
    the field's, whether Airflow renders it as a template (and how the UI shows it), that the argument is
    optional though the field is required (one of several ways to give it, or a default the operator
    computes), or that it is no argument at all (set from a connection or another argument)."""
    return {
        "operator_arg": {
            "name": name,
            "templated": templated,
            "renderer": renderer,
            "hidden": hidden,
            "optional": optional,
        }
    }


HIDDEN = arg(hidden=True)
# Seconds a Serve deployment may take over one request before it is that row's error.
SERVE_REQUEST_TIMEOUT_S = 600.0


def uri_scheme(uri: str) -> str:
    """``"s3"`` for ``s3://b/k``, ``"file"`` for a plain path."""
    match = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://", uri)
    return match.group(1).lower() if match else "file"


def is_local_path(value: str) -> bool:
    """An explicit path (absolute, relative with ./ or ../, ~, or file://), not a model id or bucket URI."""
    return value.startswith(("/", "./", "../", "~", "file://"))


def hf_dataset(uri: str, field: str = "input_uri") -> tuple[str, str | None, str]:
    """(repo id, revision or None, path in the repo) of ``hf://datasets/<org>/<name>[@<revision>]/<path>``;
    a ValueError naming ``field`` and the URI for anything else (a model repo, a Space, no dataset name)."""
    rest = uri.split("://", 1)[1]
    parts = [p for p in rest.split("/") if p]
    expected = f"expected {HF_DATASET_URI}"
    if not parts:
        raise ValueError(f"{field} {uri!r} names no dataset ({expected})")
    if parts[0] != "datasets":
        kind = _HF_OTHER_KINDS.get(parts[0], "a model repo")
        raise ValueError(f"{field} {uri!r} names {kind}; hf:// input reads dataset repos only ({expected})")
    if len(parts) < 3:
        raise ValueError(f"{field} {uri!r} names no dataset ({expected})")
    org, name = parts[1], parts[2]
    name, _, revision = name.partition("@")
    if not name or "@" in org:
        raise ValueError(f"{field} {uri!r} names no dataset ({expected})")
    return f"{org}/{name}", revision or None, "/".join(parts[3:])


def _check_uri(field: str, uri: str, *, read: bool = False) -> str:
    if not isinstance(uri, str) or not uri.strip():
        raise ValueError(f"{field} must be a non-empty path or URI, got {uri!r}")
    scheme = uri_scheme(uri)
    if scheme not in URI_SCHEMES:
        raise ValueError(
            f"{field} {uri!r} has scheme {scheme!r}; allowed: local paths, " + ", ".join(f"{s}://" for s in URI_SCHEMES)
        )
    if scheme in READ_ONLY_SCHEMES:
        if not read:
            raise ValueError(
                f"{field} {uri!r}: {scheme}:// is read only (an input_uri); write to a path, s3:// or gs://"
            )
        hf_dataset(uri, "input_uri")
    elif scheme != "file" and not uri.split("://", 1)[1].split("/", 1)[0]:
        raise ValueError(f"{field} {uri!r} names no bucket (expected {scheme}://<bucket>/<path>)")
    return uri


def format_from_uri(uri: str) -> FileFormat | None:
    lowered = uri.lower().rstrip("/")
    for suffix, fmt in ((".parquet", "parquet"), (".jsonl", "jsonl"), (".json", "jsonl"), (".csv", "csv")):
        if lowered.endswith(suffix) or lowered.endswith(suffix + ".gz"):
            return fmt  # type: ignore[return-value]
    return None


class FileSource(_Strict):
    kind: Literal["files"] = Field(
        "files", description="Input read from files on a path or bucket.", json_schema_extra=HIDDEN
    )
    uris: list[str] = Field(
        description="Files, folders or globs (local paths, s3://, gs://, hf://datasets/); Parquet, JSONL or CSV.",
        min_length=1,
        json_schema_extra=arg("input_uri", templated=True, optional=True),
    )
    format: FileFormat | None = Field(
        None,
        description="parquet, jsonl or csv; inferred from the file extension when omitted.",
        json_schema_extra=arg("input_format"),
    )
    columns: list[str] | None = Field(
        None, description="Read only these columns.", json_schema_extra=arg("input_columns")
    )

    @field_validator("uris", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("uris")
    @classmethod
    def _valid_uris(cls, value: list[str]) -> list[str]:
        return [_check_uri("source.uris", u, read=True) for u in value]

    @model_validator(mode="after")
    def _known_format(self) -> FileSource:
        # File names decide when they can; for folders the job decides from the files it finds.
        if self.format is None:
            formats = {format_from_uri(u) for u in self.uris}
            if len(formats) == 1 and None not in formats:
                self.format = formats.pop()
        return self


class SqlSource(_Strict):
    kind: Literal["sql"] = Field(
        "sql", description="Input from a SQL query the Ray job runs itself.", json_schema_extra=HIDDEN
    )
    sql: str = Field(
        min_length=1,
        description="A SELECT statement the Ray job runs (with sql_conn_id); rows never pass through the Airflow worker.",
        json_schema_extra=arg(templated=True, renderer="sql", optional=True),
    )
    dialect: Literal["postgresql", "mysql", "sqlite"] = Field(
        description="Database kind, from the Airflow connection.", json_schema_extra=HIDDEN
    )
    shard_keys: list[str] | None = Field(
        None,
        description="Columns to split the query into parallel reads sharing one snapshot (PostgreSQL; MySQL and SQLite read with one reader).",
        json_schema_extra=arg("sql_shard_keys"),
    )
    parallelism: int | None = Field(
        None,
        ge=1,
        description="Number of parallel reads when sql_shard_keys are given (default 4).",
        json_schema_extra=arg("sql_parallelism"),
    )

    @field_validator("sql")
    @classmethod
    def _one_statement(cls, value: str) -> str:
        body = value.strip().rstrip(";").strip()
        if ";" in body:
            raise ValueError(f"sql must be one statement, got {value!r}")
        return body


# Rows given inline travel in the spec (and so in the Jobs API's record): small inputs only.
MAX_INLINE_ROWS_BYTES = 1 << 20


class RowsSource(_Strict):
    kind: Literal["rows"] = Field(
        "rows", description="Input given as rows in the task itself (the guide's from_items).", json_schema_extra=HIDDEN
    )
    rows: list[Any] = Field(
        min_length=1,
        description="Small inputs given as rows with the task (the guide's from_items): dicts, or plain values "
        "(each becomes {'item': value}); at most 1 MiB as JSON.",
        json_schema_extra=arg("input_rows", templated=True, renderer="json", optional=True),
    )

    @field_validator("rows")
    @classmethod
    def _small(cls, value: list[Any]) -> list[Any]:
        size = len(json.dumps(value, default=str))
        if size > MAX_INLINE_ROWS_BYTES:
            raise ValueError(
                f"input_rows is {size} bytes as JSON, above the {MAX_INLINE_ROWS_BYTES} byte limit for rows shipped "
                "with the job; write them to a file or a table and give input_uri or sql"
            )
        return [row if isinstance(row, dict) else {"item": row} for row in value]


Source = Annotated[FileSource | SqlSource | RowsSource, Field(discriminator="kind")]


class CallableRef(_Strict):
    """A Python callable the job imports (``module:attr``) or unpickles from the job package."""

    import_path: str | None = Field(None, description="'package.module:function' importable on the cluster.")
    pickled: str | None = Field(None, description="File name of a cloudpickled callable in the job package.")
    digest: str | None = Field(None, description="Hash of the callable's source, so a changed function is a new job.")

    @model_validator(mode="after")
    def _exactly_one(self) -> CallableRef:
        if (self.import_path is None) == (self.pickled is None):
            raise ValueError("a callable reference needs exactly one of import_path or pickled")
        if self.import_path is not None and not re.fullmatch(r"[\w.]+:[\w.]+", self.import_path):
            raise ValueError(f"callable import path {self.import_path!r} must look like 'package.module:function'")
        return self


class PromptSpec(_Strict):
    """How a row becomes a request. Exactly one of the four ways is used."""

    prompt_column: str | None = Field(
        None, description="Column whose text is the user message.", json_schema_extra=arg(templated=True)
    )
    template: str | None = Field(
        None,
        description="str.format template over row columns, e.g. 'Summarize: {text}'.",
        json_schema_extra=arg("prompt_template", templated=True, renderer="jinja"),
    )
    messages_column: str | None = Field(
        None, description="Column holding OpenAI-style chat messages.", json_schema_extra=arg(templated=True)
    )
    preprocess: CallableRef | None = Field(
        None,
        description="Callable row -> request dict, as in the guide (or 'module:function').",
        json_schema_extra=arg(renderer="py"),
    )
    system_prompt: str | None = Field(
        None, description="System message put before the user message.", json_schema_extra=arg(templated=True)
    )
    sampling_params: dict[str, Any] = Field(
        default_factory=dict,
        description="vLLM sampling params per request (structured_outputs and guided_* too).",
        json_schema_extra=arg(templated=True, renderer="json"),
    )
    pooling_params: dict[str, Any] | None = Field(None, description="vLLM pooling params (embed/classify/score).")
    postprocess: CallableRef | None = Field(
        None,
        description="Callable output row -> dict, as in the guide: its dict is the output row, exactly (with "
        "id_column, _request_key is added: a resumed attempt matches saved rows by it).",
        json_schema_extra=arg(renderer="py"),
    )
    lora_column: str | None = Field(
        None, description="Column naming the LoRA adapter for each row; empty means the base model."
    )
    output_column: str = Field("response", description="Column that receives the generated text or embedding.")
    keep_columns: list[str] | None = Field(
        None,
        description="Input columns copied to the output; all input columns when omitted (but an earlier output's "
        "_request_key: each output row carries the key of its own request).",
    )
    id_column: str | None = Field(
        None,
        description="Column with a unique id per row. With it, finished rows are saved as they finish, and a "
        "later attempt of the same run (after a stop or failure) skips them instead of recomputing, as long as "
        "the row's request (its _request_key: prompt, model, sampling) is the same; a changed row is asked again.",
    )
    prefix_window_rows: int | None = Field(
        None,
        ge=0,
        description="Rows read ahead in which requests sharing a prompt prefix (the chat messages before the last, "
        "and the last message's text up to its last blank line) are put next to each other before batching, so the "
        "engine's prefix cache hits; ids and columns are kept, output row order follows the groups. 0 turns it "
        "off; default: 2048 for task_type generate, off for pooling tasks and with image_column (each row carries "
        "its image).",
    )
    image_column: str | None = Field(
        None,
        description="Column with an image per row (bytes, a path or s3:// / gs:// URI the cluster reads, or an "
        "http(s) / data: URL) for a vision-language model; it goes into the user message before the text.",
    )

    image_max_bytes: int = Field(
        20 << 20, ge=1, description="Largest image (bytes) an image_column cell may give; a larger one is an error row."
    )
    image_allow_private_hosts: bool = Field(
        False,
        description="Fetch image_column URLs from loopback, link-local and private addresses too (refused by "
        "default: a URL from the data must not reach into the cluster's own network).",
    )
    image_path_prefixes: list[str] | None = Field(
        None,
        description="Folders and bucket prefixes (e.g. '/data/images', 's3://bucket/images') that image_column "
        "paths and bucket URIs may be read from; a cell naming a file elsewhere is an error row, so the data "
        "cannot make the job read the cluster's own files with its credentials. Default: the folders of "
        "input_uri (none for a SQL input). URLs (http, data:) are not paths and are not affected.",
    )

    @model_validator(mode="after")
    def _one_way(self) -> PromptSpec:
        ways = [
            name
            for name in ("prompt_column", "template", "messages_column", "preprocess")
            if getattr(self, name) is not None
        ]
        if len(ways) != 1:
            raise ValueError(
                f"give exactly one of prompt_column, template, messages_column, preprocess; got {ways or 'none'}"
            )
        if self.image_column is not None and (self.messages_column is not None or self.preprocess is not None):
            raise ValueError(
                "prompt.image_column works with prompt_column or template; with messages_column or "
                "preprocess, put the image in the messages yourself"
            )
        if self.system_prompt is not None and self.messages_column is not None:
            raise ValueError("prompt.system_prompt cannot be combined with messages_column (put it in the messages)")
        if self.id_column is not None and self.keep_columns is not None and self.id_column not in self.keep_columns:
            raise ValueError(
                f"prompt.id_column {self.id_column!r} must be one of keep_columns {self.keep_columns!r} "
                "(saved rows are matched by it)"
            )
        return self

    def template_columns(self) -> list[str]:
        if self.template is None:
            return []
        literal = "write literal braces doubled ({{ and }}), e.g. 'as {{\"answer\": ...}} about {text}'"
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None]
        except ValueError as exc:
            raise SpecError(
                f"prompt.template {self.template!r} is not a valid format string ({exc}); {literal}"
            ) from exc
        names = []
        for field in fields:
            name = re.split(r"[.\[]", field, maxsplit=1)[0]
            if not name or name.isdigit():
                raise SpecError(
                    f"prompt.template {self.template!r} has a positional field {{{field}}}; name a column instead"
                )
            if not name.isidentifier():
                raise SpecError(f"prompt.template {self.template!r}: {{{field}}} is not a column name; {literal}")
            names.append(name)
        return sorted(set(names))

    def required_columns(self) -> list[str]:
        cols = set(self.template_columns())
        for name in (self.prompt_column, self.messages_column, self.lora_column, self.id_column, self.image_column):
            if name:
                cols.add(name)
        return sorted(cols)


class VLLMProcessorSpec(_Strict):
    """vLLMEngineProcessorConfig settings under their own names."""

    model_source: str = Field(
        description="Hugging Face id, local path on the cluster, or s3:// / gs:// URI (with serve_deployment: the "
        "model id the deployment serves). Required, here or in processor_config.",
        json_schema_extra=arg(templated=True, optional=True),
    )
    task_type: TaskType = Field("generate", description="generate, embed, classify or score.")
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="vLLM engine arguments; they win over the profile's defaults.",
        json_schema_extra=arg(templated=True, renderer="json"),
    )
    concurrency: int | tuple[int, int] = Field(
        1, description="Engine replicas, or (min, max) to autoscale.", json_schema_extra=arg(templated=True)
    )
    batch_size: int = Field(32, ge=1, description="Rows per batch sent to an engine replica.")
    accelerator_type: str | None = Field(
        None, description="GPU type the engine needs, e.g. 'L4'.", json_schema_extra=arg(templated=True)
    )
    runtime_env: dict[str, Any] | None = Field(
        None, description="Ray runtime_env for the engine stage (the guide's HF_TOKEN there becomes a job secret)."
    )
    max_concurrent_batches: int | None = Field(
        None,
        ge=1,
        description="Batches in flight per engine replica; default: enough for twice the engine's max_num_seqs.",
    )
    max_tasks_in_flight_per_actor: int | None = Field(None, ge=1, description="Ray Data tasks per engine actor.")
    max_pending_requests: int | None = Field(
        None, ge=1, description="Requests the engine holds at once; default: twice its max_num_seqs."
    )
    placement_group_config: dict[str, Any] | None = Field(
        None,
        description="{'bundles': [...]} or {'bundle_per_worker': {...}}, optional 'strategy'.",
        json_schema_extra=arg(templated=True, renderer="json"),
    )
    chat_template_stage: bool | dict[str, Any] = Field(True, description="Chat template stage (bool or config).")
    tokenize_stage: bool | dict[str, Any] = Field(
        False, description="Ray's tokenize stage (bool or config); off: the vLLM engine tokenizes the prompt itself."
    )
    detokenize_stage: bool | dict[str, Any] = Field(
        False, description="Ray's detokenize stage (bool or config); off: the vLLM engine's own text is used."
    )
    prepare_multimodal_stage: bool | dict[str, Any] = Field(False, description="Multimodal stage (bool or config).")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Extra kwargs for apply_chat_template.")
    dynamic_lora_loading_path: str | None = Field(
        None, description="Folder or bucket of LoRA adapters.", json_schema_extra=arg(templated=True)
    )
    lora_adapters: list[str] | None = Field(
        None, description="Adapter names rows may ask for (subfolders of dynamic_lora_loading_path)."
    )

    @field_validator("compile_cache")
    @classmethod
    def _compile_cache(cls, value: str | None) -> str | None:
        if value is None or uri_scheme(value) in ("s3", "gs", "gcs") and value.split("://", 1)[1].strip("/"):
            return value
        if "://" not in value and value.startswith("/"):
            return value
        raise ValueError(
            f"compile_cache must be an s3:// or gs:// prefix or an absolute path on every engine node, got {value!r}"
        )

    @model_validator(mode="after")
    def _one_cache_root(self) -> VLLMProcessorSpec:
        given = ((self.runtime_env or {}).get("env_vars") or {}).keys() & {"VLLM_CACHE_ROOT", "TRITON_CACHE_DIR"}
        if self.compile_cache and given:
            raise ValueError(
                f"compile_cache and runtime_env's {sorted(given)[0]} both name a cache folder of the engine; "
                "give one of them"
            )
        return self

    @field_validator("lora_adapters")
    @classmethod
    def _adapter_names(cls, value: list[str] | None) -> list[str] | None:
        for name in value or []:
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name) or ".." in name:
                raise ValueError(f"LoRA adapter name {name!r} must be a plain folder name (letters, digits, . _ -)")
        return value

    price_per_hour: float | None = Field(
        None,
        ge=0,
        description="Price of one GPU-hour (one CPU-hour on a CPU cluster), for the manifest's estimated_cost (the "
        "engine actors' lifetime x the GPUs (CPUs) each reserves x this price) and max_cost; default: the ray "
        "connection's extra price_per_hour.",
    )
    log_engine_metrics: bool = Field(False, description="Export vLLM metrics through Ray's Prometheus endpoint.")
    usage_stats: bool = Field(
        False, description="Let Ray and vLLM send usage statistics (off: the engine gets the opt-out variables)."
    )
    compile_cache: str | None = Field(
        None,
        description="Where vLLM keeps what it compiles and learns of the model, for the next job's engines: an "
        "s3:// or gs:// prefix (copied to each engine's node before the engine starts, and what the engine writes "
        "saved back) or an absolute path every engine node mounts; default: vLLM's own folder on each node.",
        json_schema_extra=arg(templated=True),
    )
    resource_profile: Literal["auto", "cpu", "gpu"] = Field(
        "auto",
        description="Engine defaults: 'cpu' (CPU vLLM build), 'gpu', or 'auto' = 'gpu' when the cluster has GPUs.",
    )

    @field_validator("concurrency")
    @classmethod
    def _concurrency(cls, value: int | tuple[int, int]) -> int | tuple[int, int]:
        if isinstance(value, int):
            if value < 1:
                raise ValueError(f"concurrency must be >= 1, got {value!r}")
        else:
            low, high = value
            if low < 1 or low > high:
                raise ValueError(f"concurrency (min, max) needs 1 <= min <= max, got {value!r}")
        return value

    @field_validator("model_source")
    @classmethod
    def _model_source(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("model_source must not be empty")
        return value

    @model_validator(mode="after")
    def _placement(self) -> VLLMProcessorSpec:
        pg = self.placement_group_config
        sizes = {}
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = self.engine_kwargs.get(key, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"engine_kwargs {key}={value!r} must be a whole number >= 1")
            sizes[key] = value
        tp, pp = sizes["tensor_parallel_size"], sizes["pipeline_parallel_size"]
        if pg is None:
            return self
        allowed = {"bundles", "bundle_per_worker", "strategy"}
        unknown = sorted(set(pg) - allowed)
        if unknown:
            raise ValueError(f"placement_group_config has unknown key(s) {unknown!r}; allowed: {sorted(allowed)!r}")
        if ("bundles" in pg) == ("bundle_per_worker" in pg):
            raise ValueError("placement_group_config needs exactly one of 'bundles' or 'bundle_per_worker'")
        strategy = pg.get("strategy", "PACK")
        if strategy not in PG_STRATEGIES:
            raise ValueError(f"placement_group_config.strategy {strategy!r} is not one of {list(PG_STRATEGIES)!r}")
        bundles = pg.get("bundles")
        if bundles is not None:
            if not isinstance(bundles, list) or not bundles or not all(isinstance(b, dict) for b in bundles):
                raise ValueError(f"placement_group_config.bundles must be a non-empty list of dicts, got {bundles!r}")
            if len(bundles) != tp * pp:
                raise ValueError(
                    f"placement_group_config.bundles has {len(bundles)} bundle(s) but tensor_parallel_size x "
                    f"pipeline_parallel_size = {tp} x {pp} = {tp * pp} workers need one each"
                )
        return self

    def gpus_per_replica(self) -> float:
        pg = self.placement_group_config
        if pg is None:
            tp = int(self.engine_kwargs.get("tensor_parallel_size", 1) or 1)
            pp = int(self.engine_kwargs.get("pipeline_parallel_size", 1) or 1)
            return float(tp * pp)
        if "bundles" in pg:
            return float(sum(b.get("GPU", 0) for b in pg["bundles"]))
        tp = int(self.engine_kwargs.get("tensor_parallel_size", 1) or 1)
        pp = int(self.engine_kwargs.get("pipeline_parallel_size", 1) or 1)
        return float(pg["bundle_per_worker"].get("GPU", 0)) * tp * pp


class TableSinkSpec(_Strict):
    table: str = Field(description="Table that receives the output rows (created when missing).")
    dialect: Literal["postgresql", "mysql", "sqlite"] = Field(description="Database kind, from the connection.")
    run_key: str = Field(description="Identifies this run's rows; a rerun replaces rows with the same key.")

    @field_validator("table")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?", value):
            raise ValueError(f"output_table {value!r} must be a plain table name (schema.table allowed)")
        return value


HttpEndpoint = Literal["chat/completions", "completions", "embeddings"]


class HttpProcessorSpec(_Strict):
    """Calls to an OpenAI-compatible endpoint. The base URL comes from the Airflow connection only."""

    base_url: str = Field(
        description="Endpoint base, e.g. 'http://127.0.0.1:8000/v1' (from the connection).", json_schema_extra=HIDDEN
    )
    endpoint: HttpEndpoint = Field("chat/completions", description="chat/completions, completions or embeddings.")
    model: str = Field(
        min_length=1, description="Model name the endpoint serves.", json_schema_extra=arg(templated=True)
    )
    concurrency: int = Field(1, ge=1, description="Ray actors sending requests.")
    batch_size: int = Field(
        256,
        ge=1,
        description="Rows per batch; each actor sends several batches at once (twice max_in_flight rows queued).",
    )
    max_in_flight: int = Field(
        64, ge=1, le=4096, description="Requests in flight per actor.", json_schema_extra=arg(templated=True)
    )
    qps: float | None = Field(
        None,
        gt=0,
        description="Requests per second for the whole job, shared across actors.",
        json_schema_extra=arg(templated=True),
    )
    max_retries: int = Field(6, ge=0, le=100, description="Retries per row on 408/429/5xx and connection errors.")
    max_total_wait_s: float = Field(300.0, gt=0, description="Give a row up after this long, retries included.")
    timeout_s: float = Field(120.0, gt=0, description="Timeout of one request.")
    backoff_base_s: float = Field(0.5, gt=0, description="First backoff ceiling (doubles per retry, full jitter).")
    backoff_max_s: float = Field(30.0, gt=0, description="Longest wait between two attempts.")
    price_per_1k_input_tokens: float | None = Field(
        None,
        ge=0,
        description="Price of 1000 prompt tokens, for the manifest's estimated_cost and max_cost; default: the "
        "endpoint connection's extra of the same name.",
    )
    price_per_1k_output_tokens: float | None = Field(
        None,
        ge=0,
        description="Price of 1000 generated tokens, for the manifest's estimated_cost and max_cost; default: the "
        "endpoint connection's extra of the same name.",
    )

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not re.match(r"^https?://[^/\s]+", value):
            raise ValueError(f"base_url must be an http(s) URL, got {value!r}")
        return value.rstrip("/")

    @property
    def url(self) -> str:
        return f"{self.base_url}/{self.endpoint}"

    def qps_per_actor(self) -> float | None:
        return self.qps / self.concurrency if self.qps else None


class ServeProcessorSpec(_Strict):
    """Requests to an LLM deployment already running on the cluster's Ray Serve (the guide's "batch
    inference with a Serve deployment"): no engine starts in the job, and several jobs (or the turns of a
    conversation, task after task) share the deployment's engine."""

    deployment_name: str = Field(
        min_length=1,
        description="Name of an LLM deployment already running on the cluster's Ray Serve: rows go to it and no "
        "engine starts in the job (model_source is then the model id it serves).",
        json_schema_extra=arg("serve_deployment", templated=True, optional=True),
    )
    app_name: str = Field(
        "default",
        min_length=1,
        description="The Serve application holding serve_deployment.",
        json_schema_extra=arg("serve_app", templated=True),
    )
    model: str = Field(
        min_length=1,
        description="Model id the deployment serves (its model_loading_config.model_id).",
        json_schema_extra=HIDDEN,
    )
    endpoint: Literal["chat", "completions", "embeddings"] = Field(
        "chat",
        description="With serve_deployment: the deployment method the rows call (chat, completions; "
        "embeddings for task_type 'embed').",
        json_schema_extra=arg("serve_method"),
    )
    concurrency: int = Field(
        1, ge=1, description="Ray Data actors holding a handle to the deployment.", json_schema_extra=HIDDEN
    )
    batch_size: int = Field(16, ge=1, description="Rows handed to an actor at a time.", json_schema_extra=HIDDEN)
    request_timeout_s: float = Field(
        SERVE_REQUEST_TIMEOUT_S,
        gt=0,
        description="With serve_deployment: a request slower than this (seconds) becomes an error row, so a "
        "deployment that never answers cannot hold the job.",
        json_schema_extra=arg("serve_request_timeout_s"),
    )


class SinkSpec(_Strict):
    uri: str = Field(
        description="Output prefix (folder, s3:// or gs://) of this task instance; default "
        "{output_base}/{dag_id}/{run_id}/{task_id}[/map_N] from the ray connection.",
        json_schema_extra=arg("output_uri", templated=True, optional=True),
    )
    format: SinkFormat = Field(
        "parquet",
        description="parquet or jsonl, for the output and error files.",
        json_schema_extra=arg("output_format"),
    )
    rows_per_file: int | None = Field(
        None,
        ge=1,
        le=10_000_000,
        description="Answered rows gathered into one output file; files appear as each fills, while the job runs. "
        "They are also what a resumed attempt keeps (id_column). Default: 1000, or one engine batch with id_column.",
        json_schema_extra=arg("output_rows_per_file"),
    )
    table: TableSinkSpec | None = Field(
        None, description="Also write the output rows to a warehouse table.", json_schema_extra=HIDDEN
    )

    @field_validator("uri")
    @classmethod
    def _uri(cls, value: str) -> str:
        return _check_uri("output_uri", value).rstrip("/")


class QualityGate(_Strict):
    """What the canary's answers must meet before the full input is read (each test given is applied)."""

    max_error_rate: float | None = Field(
        None, ge=0.0, le=1.0, description="Largest share of the canary's rows that may be error rows."
    )
    min_json_schema_pass_rate: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="Smallest share of the canary's answered rows whose answer parses as JSON valid against the "
        "schema asked for in sampling_params (structured_outputs json, or guided_json).",
    )
    min_mean_output_chars: float | None = Field(
        None, ge=0.0, description="Smallest mean length, in characters, of the canary's answers (output_column)."
    )
    check: CallableRef | None = Field(
        None,
        description="'package.module:function' run inside the job on the canary's output rows (a list of dicts); "
        "it returns (passed: bool, reason: str).",
    )

    @field_validator("check", mode="before")
    @classmethod
    def _import_path(cls, value: Any) -> Any:
        return {"import_path": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _something(self) -> QualityGate:
        if all(getattr(self, name) is None for name in type(self).model_fields):
            raise ValueError(
                "quality_gate sets no test; give max_error_rate, min_json_schema_pass_rate, min_mean_output_chars "
                "or check"
            )
        return self


# The canary is a sample checked before the run, not a run of its own: its rows pass through the driver.
MAX_CANARY_ROWS = 10_000


class LimitsSpec(_Strict):
    max_error_fraction: float = Field(
        0.1, ge=0.0, le=1.0, description="Fail the task (publishing nothing) when error rows / input rows exceeds this."
    )
    max_rows: int | None = Field(
        None, ge=1, description="Process at most this many input rows.", json_schema_extra=arg(templated=True)
    )
    object_store_window_mb: int | None = Field(
        None,
        ge=1,
        description="Object store (MiB) the job's rows in flight may fill on the cluster: Ray Data holds back its "
        "read and request steps beyond it. Default: Ray Data's own share of the cluster's object store.",
        json_schema_extra=arg(templated=True),
    )
    canary_rows: int | None = Field(
        None,
        ge=1,
        le=MAX_CANARY_ROWS,
        description="Answer the first N rows first and check them against quality_gate (without one: against "
        "max_error_fraction) before the rest of the input is read. A failing canary fails the task with no retry, "
        "costing only its own rows; a passing one's rows are part of the output, not answered again.",
    )
    quality_gate: QualityGate | None = Field(
        None,
        description="The canary's tests: max_error_rate, min_json_schema_pass_rate, min_mean_output_chars and/or "
        "check ('module:function' returning (passed, reason)). Needs canary_rows.",
    )
    max_tokens_budget: int | None = Field(
        None,
        ge=1,
        description="Stop the run (publishing nothing, no retry) once its input + output tokens pass this; "
        "checked as answers arrive.",
    )
    max_cost: float | None = Field(
        None,
        gt=0,
        description="Stop the run (publishing nothing, no retry) once its estimated cost passes this; checked as "
        "answers arrive. Needs a price (price_per_hour, or price_per_1k_input/output_tokens).",
    )
    stall_timeout_s: float | None = Field(
        3600.0,
        gt=0,
        description="Fail the job (publishing nothing; a retry resumes from the rows saved) when no row has been "
        "answered for this many seconds since the stream started or its last answer: an engine or endpoint that "
        "stopped answering ends the job instead of holding the cluster for ever. None: no limit.",
    )


class IncrementalSpec(_Strict):
    """Reuse the answers of the task's last published run for the rows whose request is unchanged."""

    enabled: bool = Field(
        False,
        description="Send only new and changed rows to the engine: a row whose id (id_column; without one, the "
        "whole row) and request key (rendered prompt or messages, model, sampling, preprocess/postprocess code) "
        "match a row of the base run's output keeps that answer. The base is incremental_from, else the "
        "output prefix this task's latest earlier successful run pushed (XCom outputs_folder), else the "
        "output prefix's own published run; none found means a full run. The manifest's `incremental` "
        "section counts the rows reused, computed and dropped.",
        json_schema_extra=arg("incremental"),
    )
    base: str | None = Field(
        None,
        description="With incremental: the run to reuse answers from, as its output prefix or its "
        "_manifest.json URI (e.g. 's3://b/reviews/{{ prev_ds }}'); a prefix with no manifest means a full run.",
        json_schema_extra=arg("incremental_from", templated=True),
    )

    @field_validator("base")
    @classmethod
    def _base(cls, value: str | None) -> str | None:
        return None if value is None else _check_uri("incremental_from", value).rstrip("/")

    @model_validator(mode="after")
    def _needs_enabled(self) -> IncrementalSpec:
        if self.base is not None and not self.enabled:
            raise ValueError(f"incremental_from {self.base!r} needs incremental=True")
        return self


class RunSpec(_Strict):
    """Who asked for the job; recorded in the manifest, never used to read data."""

    dag_id: str = ""
    run_id: str = ""
    task_id: str = ""
    map_index: int = -1
    try_number: int = 0
    clear_number: int = 0  # the dag run's: raised by Airflow each time the run's tasks are cleared


class JobSpec(_Strict):
    version: Literal[1] = Field(SPEC_VERSION, description="Spec version; the job refuses other versions.")
    kind: Literal["vllm", "http", "serve"] = Field("vllm", description="Which pipeline the job runs.")
    source: Source
    prompt: PromptSpec
    processor: VLLMProcessorSpec | None = Field(None, description="vLLM engine settings (kind 'vllm').")
    http: HttpProcessorSpec | None = Field(None, description="Endpoint settings (kind 'http').")
    serve: ServeProcessorSpec | None = Field(None, description="Serve deployment settings (kind 'serve').")
    sink: SinkSpec
    limits: LimitsSpec = Field(default_factory=LimitsSpec)
    incremental: IncrementalSpec | None = Field(
        None, description="Reuse the base run's answers for unchanged rows (None: every row is computed)."
    )
    run: RunSpec = Field(default_factory=RunSpec)

    @model_validator(mode="before")
    @classmethod
    def _source_kind(cls, data: Any) -> Any:
        # A source with uris and no kind is a file source (the common case, and older specs).
        if isinstance(data, dict) and isinstance(data.get("source"), dict) and "kind" not in data["source"]:
            source = data["source"]
            kind = "sql" if "sql" in source else "rows" if "rows" in source else "files"
            data = {**data, "source": {**source, "kind": kind}}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        p = self.prompt
        sections = {"vllm": self.processor, "http": self.http, "serve": self.serve}
        if any((kind == self.kind) != (section is not None) for kind, section in sections.items()):
            raise ValueError(
                f"a {self.kind!r} job needs exactly its own settings section ('processor', 'http' or 'serve')"
            )
        if self.task_type != "generate" and p.messages_column is not None:
            raise ValueError(f"prompt.messages_column needs task_type 'generate', got {self.task_type!r}")
        if p.image_column is not None and self.task_type != "generate":
            raise ValueError(f"prompt.image_column needs task_type 'generate', got {self.task_type!r}")
        if p.lora_column is not None and self.processor is None:
            raise ValueError("prompt.lora_column is for vLLM jobs")
        if p.lora_column is not None and self.processor is not None:
            if not self.processor.engine_kwargs.get("enable_lora"):
                raise ValueError("prompt.lora_column needs engine_kwargs enable_lora=True")
            if not self.processor.dynamic_lora_loading_path:
                raise ValueError(
                    "prompt.lora_column needs dynamic_lora_loading_path (the folder or bucket of adapters)"
                )
        reserved = {OUTPUT_TOKENS_IN, OUTPUT_TOKENS_OUT, ERROR_COLUMN, REQUEST_KEY_COLUMN}
        if p.output_column in reserved:
            raise ValueError(f"prompt.output_column {p.output_column!r} is reserved; pick another name")
        p.template_columns()  # raises a SpecError on a broken template
        self._check_limits()
        return self

    def _check_limits(self) -> None:
        limits = self.limits
        gate = limits.quality_gate
        if gate is not None and limits.canary_rows is None:
            raise ValueError("limits.quality_gate needs limits.canary_rows (the rows it judges)")
        if gate is not None and gate.min_json_schema_pass_rate is not None and self.json_schema() is None:
            raise ValueError(
                "limits.quality_gate min_json_schema_pass_rate needs a JSON schema in prompt.sampling_params "
                "(structured_outputs={'json': schema} or guided_json)"
            )
        if limits.max_cost is not None and not self.has_price():
            raise ValueError(
                f"limits.max_cost={limits.max_cost!r} needs a price: price_per_hour for a vLLM job, "
                "price_per_1k_input_tokens / price_per_1k_output_tokens for an endpoint"
            )

    def has_price(self) -> bool:
        if self.processor is not None:
            return self.processor.price_per_hour is not None
        if self.http is not None:
            return self.http.price_per_1k_input_tokens is not None or self.http.price_per_1k_output_tokens is not None
        return False

    def json_schema(self) -> dict[str, Any] | None:
        """The JSON schema the rows' answers are asked to follow (structured output), if any."""
        params = self.prompt.sampling_params or {}
        structured = params.get("structured_outputs") or params.get("guided_decoding") or {}
        schema = structured.get("json") if isinstance(structured, dict) else None
        schema = schema if schema is not None else params.get("guided_json")
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError:
                return None
        return schema if isinstance(schema, dict) else None

    @property
    def task_type(self) -> str:
        if self.processor is not None:
            return self.processor.task_type
        endpoint = (
            self.http.endpoint if self.http is not None else self.serve.endpoint if self.serve is not None else ""
        )
        return "embed" if endpoint == "embeddings" else "generate"

    @property
    def model_name(self) -> str:
        if self.processor is not None:
            return self.processor.model_source
        return (self.http or self.serve).model  # type: ignore[union-attr]

    @property
    def output_uri(self) -> str:
        return self.sink.uri

    @property
    def is_incremental(self) -> bool:
        return self.incremental is not None and self.incremental.enabled

    @property
    def gated(self) -> bool:
        """Whether one actor sees every row's id and key: with id_column (uniqueness, resume) or incremental."""
        return self.prompt.id_column is not None or self.is_incremental

    def content_hash(self) -> str:
        """Hash of what the job computes; the run section is excluded (and incremental when unset, so the
        hash of a spec that never used it is what it was before the section existed)."""
        exclude = {"run"} if self.incremental is not None else {"run", "incremental"}
        body = self.model_dump(mode="json", exclude=exclude)
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)


class UploadJobSpec(_Strict):
    """Copy model weights to a bucket, verified file by file (the guide's upload_model, as a job)."""

    version: Literal[1] = Field(
        SPEC_VERSION, description="Spec version; the job refuses other versions.", json_schema_extra=HIDDEN
    )
    kind: Literal["upload"] = Field("upload", description="Which job runs.", json_schema_extra=HIDDEN)
    model_source: str = Field(
        min_length=1, description="Hugging Face id or a folder on the cluster.", json_schema_extra=arg(templated=True)
    )
    bucket_uri: str = Field(
        description="s3:// or gs:// prefix that receives the model's files.", json_schema_extra=arg(templated=True)
    )
    revision: str | None = Field(
        None, description="Hugging Face revision (branch, tag or commit).", json_schema_extra=arg(templated=True)
    )
    allow_patterns: list[str] | None = Field(None, description="Only files matching these globs.")
    ignore_patterns: list[str] | None = Field(None, description="Leave out files matching these globs.")
    overwrite: bool = Field(False, description="Replace a destination that holds a different model.")
    run: RunSpec = Field(default_factory=RunSpec, json_schema_extra=HIDDEN)

    @field_validator("bucket_uri")
    @classmethod
    def _bucket(cls, value: str) -> str:
        _check_uri("bucket_uri", value)
        if uri_scheme(value) not in ("s3", "gs", "gcs", "file"):
            raise ValueError(f"bucket_uri {value!r} must be an s3:// or gs:// prefix")
        return value.rstrip("/")

    @property
    def output_uri(self) -> str:
        return self.bucket_uri

    @property
    def model_name(self) -> str:
        return self.model_source

    def content_hash(self) -> str:
        body = self.model_dump(mode="json", exclude={"run"})
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)


AnySpec = JobSpec | UploadJobSpec


def validate_body(data: str | dict[str, Any]) -> AnySpec:
    """The spec model for the body's kind; pydantic's ValidationError on bad input."""
    if isinstance(data, str):
        data = json.loads(data)
    if isinstance(data, dict) and data.get("kind") == "upload":
        return UploadJobSpec.model_validate(data)
    return JobSpec.model_validate(data)


def map_guide_flags(settings: dict[str, Any]) -> dict[str, Any]:
    """Accept the guide's flag names and turn them into Ray 2.60's stage configs.

    ``apply_chat_template=False`` -> ``chat_template_stage=False``; ``has_image=True`` ->
    ``prepare_multimodal_stage=True``; ``chat_template="..."`` -> the chat template stage's template.
    Giving both the old and the new name is an error.
    """
    out = dict(settings)
    for old, new in GUIDE_STAGE_FLAGS.items():
        if old in out:
            value = out.pop(old)
            if new in out and out[new] is not None:
                raise SpecError(f"give either {old!r} (guide name) or {new!r}, not both")
            if not isinstance(value, bool):
                raise SpecError(f"{old} must be True or False, got {value!r}")
            out[new] = value
    if "chat_template" in out:
        template = out.pop("chat_template")
        if template is not None:
            stage = out.get("chat_template_stage", True)
            if stage is False:
                raise SpecError("chat_template is set but the chat template stage is disabled")
            stage = dict(stage) if isinstance(stage, dict) else {}
            stage["chat_template"] = template
            out["chat_template_stage"] = stage
    return out


def _field_path(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc]
    # A discriminated union puts the chosen tag in the path: source.files.uris -> source.uris.
    if len(parts) > 1 and parts[0] == "source" and parts[1] in ("files", "sql", "rows"):
        del parts[1]
    return ".".join(p for p in parts if not p.startswith("function-"))


_SPEC_PATH = re.compile(r"\b(?:source|prompt|processor|sink|limits|http|serve|upload)\.[a-z_]+\b")


def format_validation_error(exc: ValidationError, rename: Callable[[str], str] | None = None) -> str:
    """One clause per problem: the field (as the user named it), what is wrong, and the value given."""
    clauses = []
    for err in exc.errors():
        path = _field_path(err["loc"]) or "spec"
        field = rename(path) if rename else path
        value = err.get("input")
        if err["type"] == "extra_forbidden":
            clauses.append(f"{field}: unknown setting (value {value!r})")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        if path == "spec":
            # A check across fields names its fields in the message: name them as the user wrote them.
            if rename:
                msg = _SPEC_PATH.sub(lambda m: rename(m.group(0)), msg)
            clauses.append(msg)
            continue
        shown = "" if isinstance(value, dict) or "input" not in err else f" (got {value!r})"
        clauses.append(f"{field}: {msg}{shown}")
    return "; ".join(clauses)


def parse_spec(data: str | dict[str, Any]) -> AnySpec:
    """Validate a spec, turning pydantic's errors into one SpecError naming each field."""
    try:
        return validate_body(data)
    except ValidationError as exc:
        raise SpecError(f"invalid job spec: {format_validation_error(exc)}") from None
    except json.JSONDecodeError as exc:
        raise SpecError(f"the job spec is not JSON: {exc}") from None
