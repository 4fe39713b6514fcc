"""Every operator argument, declared once.

Arguments that end up in the job spec are the spec's own fields (``contract/spec.py``): their name as an argument,
default, description and whether Airflow renders them come from the field (``spec.arg``). Arguments the
Airflow half keeps for itself (connections, waiting) are the fields of the small models below. An
operator lists the groups it takes; its signature, ``template_fields``, renderers and docs/OPERATORS.md are
derived from that list, and an argument outside it is refused with a TypeError naming it.

Part of the contract room: imports neither Airflow nor Ray.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from airflow_provider_rayllm.contract import spec

REQUIRED = inspect.Parameter.empty


@dataclass(frozen=True)
class Argument:
    name: str
    description: str
    default: Any = REQUIRED
    templated: bool = False
    renderer: str | None = None
    # Where the value goes in the job spec: (section, field); None for the Airflow half's own arguments.
    path: tuple[str, str] | None = None
    # The operator attribute holding it, where the name is taken (BaseOperator has a task_type).
    attribute: str = ""

    @property
    def attr(self) -> str:
        return self.attribute or self.name

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def fresh_default(self) -> Any:
        return self.default() if callable(self.default) else copy.deepcopy(self.default)

    def signature_default(self) -> Any:
        return None if callable(self.default) else self.default


def from_model(
    model: type[BaseModel], section: str | None, rename_attr: dict[str, str] | None = None
) -> tuple[Argument, ...]:
    """A model's fields as arguments, as their ``spec.arg`` metadata says (hidden fields left out)."""
    out = []
    for field_name, field in model.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        meta = extra.get("operator_arg") or {}
        if meta.get("hidden"):
            continue
        name = meta.get("name") or field_name
        if field.is_required():
            default: Any = None if meta.get("optional") else REQUIRED
        elif field.default_factory is not None:
            default = field.default_factory
        else:
            default = field.default
        out.append(
            Argument(
                name=name,
                description=field.description or "",
                default=default,
                templated=bool(meta.get("templated")),
                renderer=meta.get("renderer"),
                path=(section, field_name) if section else None,
                attribute=(rename_attr or {}).get(name, ""),
            )
        )
    return tuple(out)


def _own(**kw: Any) -> dict:
    return {"operator_arg": {"templated": kw.get("templated", False), "renderer": kw.get("renderer")}}


class JobSettings(BaseModel):
    """How the task reaches the cluster and waits for its job (every operator)."""

    ray_conn_id: str = Field(
        "ray_default",
        description="Airflow connection of type `ray`: the Jobs API address, token, TLS settings, output_base.",
    )
    deferrable: bool | None = Field(
        None,
        description="Wait for the job in the triggerer instead of holding a worker slot; default: Airflow's "
        "[operators] default_deferrable.",
    )
    poll_interval: float = Field(5.0, description="Seconds between two looks at the job's status.")
    unreachable_timeout: float = Field(
        600.0, description="Seconds the Jobs API may stay unreachable while the task waits before it fails."
    )
    job_runtime_env: dict[str, Any] | None = Field(
        None,
        description="Extra Ray runtime_env for the job's driver (pip, env_vars, ...); working_dir is the operator's.",
        json_schema_extra=_own(templated=True, renderer="json"),
    )
    ship_package: bool = Field(
        True,
        description="Ship this provider's package to the job as a py_module (the cluster then needs no copy of it).",
    )
    aws_conn_id: str | None = Field(
        None, description="Airflow `aws` connection whose credentials the job uses for s3:// (passed as a job secret)."
    )
    gcp_conn_id: str | None = Field(
        None, description="Airflow `google_cloud_platform` connection whose key the job uses for gs:// (job secret)."
    )
    hf_conn_id: str | None = Field(
        None,
        description="Connection whose password is a Hugging Face token, for gated models and hf:// datasets (job "
        "secret); its host, when set, is the Hub's address (a private hub or a mirror: HF_ENDPOINT).",
    )
    entrypoint_num_cpus: float | None = Field(
        None, description="CPUs the job's driver reserves on the cluster (Ray's default: 0)."
    )
    entrypoint_resources: dict[str, float] | None = Field(
        None,
        description='Custom resources the job\'s driver reserves, e.g. `{"rayllm_driver": 1}` so the cluster queues drivers.',
    )


class SqlSettings(BaseModel):
    sql_conn_id: str | None = Field(
        None,
        description="Airflow SQL connection (PostgreSQL, MySQL, SQLite) the job's query runs on (credentials as job secrets).",
    )


class TableSettings(BaseModel):
    output_table: str | None = Field(
        None,
        description="Also write the output rows to this table (created when missing); a rerun replaces its own rows.",
        json_schema_extra=_own(templated=True),
    )
    output_table_conn_id: str | None = Field(None, description="Airflow SQL connection of `output_table`.")


class HttpSettings(BaseModel):
    http_conn_id: str = Field(
        "llm_endpoint_default",
        description="Connection of the OpenAI-compatible endpoint: host = base URL, password = API key (job secret). "
        "The requests and the key go to this host only.",
    )


class GuideFlags(BaseModel):
    """The reference guide's names for Ray 2.60's stage configs, accepted and mapped (``spec.map_guide_flags``)."""

    apply_chat_template: bool | None = Field(
        None, description="The guide's name for `chat_template_stage` (Ray < 2.60); mapped."
    )
    tokenize: bool | None = Field(None, description="The guide's name for `tokenize_stage`; mapped.")
    detokenize: bool | None = Field(None, description="The guide's name for `detokenize_stage`; mapped.")
    has_image: bool | None = Field(None, description="The guide's name for `prepare_multimodal_stage`; mapped.")
    chat_template: str | None = Field(
        None, description="The guide's custom chat template string; mapped into `chat_template_stage`."
    )


class VLLMGuideConfig(BaseModel):
    processor_config: Any = Field(
        None,
        description="The guide's `vLLMEngineProcessorConfig` as you already have it (or a dict of its fields): each "
        "field it sets fills the argument of the same name; one given both ways with two values is an error.",
    )


class HttpGuideConfig(BaseModel):
    processor_config: Any = Field(
        None,
        description="The guide's `HttpRequestProcessorConfig` as you already have it (or a dict of its fields): "
        "qps, concurrency, batch_size, max_retries and base_retry_wait_time_in_s (as backoff_base_s) fill those "
        "arguments; its url and headers belong in http_conn_id.",
    )


JOB = from_model(JobSettings, None)
SOURCE = (
    from_model(spec.FileSource, "files")
    + from_model(spec.SqlSource, "sql")
    + from_model(SqlSettings, None)
    + from_model(spec.RowsSource, "rows")
)
PROMPT = from_model(spec.PromptSpec, "prompt")
SINK = from_model(spec.SinkSpec, "sink") + from_model(TableSettings, None)
LIMITS = from_model(spec.LimitsSpec, "limits")
INCREMENTAL = from_model(spec.IncrementalSpec, "incremental")
VLLM = (
    from_model(spec.VLLMProcessorSpec, "processor", rename_attr={"task_type": "engine_task_type"})
    + from_model(GuideFlags, None)
    + from_model(VLLMGuideConfig, None)
    + from_model(spec.ServeProcessorSpec, "serve")
)
HTTP = from_model(spec.HttpProcessorSpec, "http") + from_model(HttpSettings, None) + from_model(HttpGuideConfig, None)
UPLOAD = from_model(spec.UploadJobSpec, "upload")
# Prompt arguments that only an engine the job starts can use.
ENGINE_ONLY_PROMPT = ("lora_column",)


def operator_arguments(kind: Literal["vllm", "http", "upload"]) -> tuple[Argument, ...]:
    if kind == "upload":
        return UPLOAD + JOB
    prompt = PROMPT if kind == "vllm" else tuple(a for a in PROMPT if a.name not in ENGINE_ONLY_PROMPT)
    engine = VLLM if kind == "vllm" else HTTP
    args = SOURCE + prompt + engine + SINK + INCREMENTAL + LIMITS + JOB
    names = [a.name for a in args]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    assert not duplicated, f"arguments declared twice: {duplicated}"
    return args
