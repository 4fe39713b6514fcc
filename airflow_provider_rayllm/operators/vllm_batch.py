"""VLLMBatchOperator: the reference guide's vLLM batch pipeline as one Airflow task on a Ray cluster."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

from typing_extensions import Unpack

from airflow_provider_rayllm.contract.names import ENGINE_SECRET_ENV
from airflow_provider_rayllm.contract.secrets import secret_env_vars, split_secrets
from airflow_provider_rayllm.contract.spec import (
    FileFormat,
    QualityGate,
    SinkFormat,
    SpecError,
    TaskType,
    map_guide_flags,
)
from airflow_provider_rayllm.operators import arguments
from airflow_provider_rayllm.operators.batch import BatchOperator, connection_price
from airflow_provider_rayllm.operators.guide_config import VLLM_FIELDS
from airflow_provider_rayllm.operators.task_args import RayJobArgs

if TYPE_CHECKING:
    from airflow.sdk import Context

GUIDE_FLAGS = ("apply_chat_template", "tokenize", "detokenize", "has_image", "chat_template")
STAGES = ("chat_template_stage", "tokenize_stage", "detokenize_stage", "prepare_multimodal_stage")
# Settings of an engine the job starts; with serve_deployment the deployment's own engine answers.
ENGINE_ONLY = (
    "engine_kwargs",
    "placement_group_config",
    "dynamic_lora_loading_path",
    "lora_column",
    "accelerator_type",
    "compile_cache",
)


class VLLMBatchOperator(BatchOperator):
    """Run ray.data.llm's vLLM processor over files, a query or given rows as a Ray job; return the manifest.

    Prompt building: one of ``prompt_column``, ``prompt_template`` (``"Summarize: {text}"``),
    ``messages_column`` or ``preprocess`` (a callable row -> request, as in the guide), plus
    ``system_prompt`` and ``sampling_params``. ``postprocess`` shapes output rows.

    Processor settings keep the guide's names (``model_source``, ``engine_kwargs``, ``concurrency``,
    ``batch_size``, ``accelerator_type``, ``runtime_env``, ``placement_group_config``, ``task_type``...); the
    guide's ``apply_chat_template``, ``tokenize``, ``detokenize``, ``has_image`` and ``chat_template`` are
    mapped to Ray 2.60's stage configs. With ``serve_deployment`` no engine starts in the job: the rows go
    to an LLM deployment already running on the cluster's Ray Serve. Every argument: docs/OPERATORS.md.
    """

    arguments = arguments.operator_arguments("vllm")

    def __init__(
        self,
        *,
        input_uri: str | list[str] | None = None,
        input_format: FileFormat | None = None,
        input_columns: list[str] | None = None,
        sql: str | None = None,
        sql_shard_keys: list[str] | None = None,
        sql_parallelism: int | None = None,
        sql_conn_id: str | None = None,
        input_rows: list[Any] | str | None = None,
        prompt_column: str | None = None,
        prompt_template: str | None = None,
        messages_column: str | None = None,
        preprocess: Callable[..., Any] | str | None = None,
        system_prompt: str | None = None,
        sampling_params: dict[str, Any] | str | None = None,
        pooling_params: dict[str, Any] | None = None,
        postprocess: Callable[..., Any] | str | None = None,
        lora_column: str | None = None,
        output_column: str = "response",
        keep_columns: list[str] | None = None,
        id_column: str | None = None,
        prefix_window_rows: int | None = None,
        image_column: str | None = None,
        image_max_bytes: int = 20971520,
        image_allow_private_hosts: bool = False,
        image_path_prefixes: list[str] | None = None,
        model_source: str | None = None,
        task_type: TaskType = "generate",
        engine_kwargs: dict[str, Any] | str | None = None,
        concurrency: int | tuple[int, int] | list[int] | str = 1,
        batch_size: int = 32,
        accelerator_type: str | None = None,
        runtime_env: dict[str, Any] | None = None,
        max_concurrent_batches: int | None = None,
        max_tasks_in_flight_per_actor: int | None = None,
        max_pending_requests: int | None = None,
        placement_group_config: dict[str, Any] | str | None = None,
        chat_template_stage: bool | dict[str, Any] | None = None,
        tokenize_stage: bool | dict[str, Any] | None = None,
        detokenize_stage: bool | dict[str, Any] | None = None,
        prepare_multimodal_stage: bool | dict[str, Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        dynamic_lora_loading_path: str | None = None,
        lora_adapters: list[str] | None = None,
        price_per_hour: float | None = None,
        log_engine_metrics: bool = False,
        usage_stats: bool = False,
        compile_cache: str | None = None,
        resource_profile: Literal["auto", "cpu", "gpu"] = "auto",
        apply_chat_template: bool | None = None,
        tokenize: bool | None = None,
        detokenize: bool | None = None,
        has_image: bool | None = None,
        chat_template: str | None = None,
        processor_config: Any = None,
        serve_deployment: str | None = None,
        serve_app: str = "default",
        serve_method: Literal["chat", "completions", "embeddings"] = "chat",
        serve_request_timeout_s: float = 600.0,
        output_uri: str | None = None,
        output_format: SinkFormat = "parquet",
        output_rows_per_file: int | None = None,
        output_table: str | None = None,
        output_table_conn_id: str | None = None,
        incremental: bool = False,
        incremental_from: str | None = None,
        max_error_fraction: float = 0.1,
        max_rows: int | str | None = None,
        object_store_window_mb: int | str | None = None,
        canary_rows: int | None = None,
        quality_gate: QualityGate | dict[str, Any] | None = None,
        max_tokens_budget: int | None = None,
        max_cost: float | None = None,
        stall_timeout_s: float | None = 3600.0,
        **kwargs: Unpack[RayJobArgs],
    ) -> None:
        super().__init__(**kwargs)
        given = locals()
        self.take_arguments(given)
        self.take_guide_config(processor_config, VLLM_FIELDS, given)
        if self.model_source is None:
            raise TypeError(f"VLLMBatchOperator (task_id {self.task_id!r}): missing argument 'model_source'")

    def job_secrets(self) -> dict[str, str]:
        env = super().job_secrets()
        # The guide's runtime_env={"env_vars": {"HF_TOKEN": ...}} and a secret in engine_kwargs (vLLM's
        # hf_token): accepted, but they travel as job secrets, not in what Ray shows or keeps in the spec.
        # A connection (hf_conn_id) wins over them.
        for name, value in {
            **secret_env_vars(self.runtime_env)[1],
            **split_secrets(self.engine_kwargs, ENGINE_SECRET_ENV)[1],
        }.items():
            env.setdefault(name, value)
        return env

    def _engine_runtime_env(self) -> dict[str, Any] | None:
        kept, moved = secret_env_vars(self.runtime_env)
        if moved:
            self.log.warning(
                "runtime_env.env_vars %s: moved to the job's secrets (Ray would show runtime_env env vars); "
                "an Airflow connection passed as hf_conn_id keeps the token out of the DAG file too",
                sorted(moved),
            )
        return kept

    def processor_body(self) -> dict[str, Any]:
        processor = self.section("processor")
        # A stage left as None takes the spec's default; one given may not be given again by its guide name.
        given = {k: processor.pop(k) for k in STAGES if processor[k] is not None}
        for k in STAGES:
            processor.pop(k, None)
        given.update({k: getattr(self, k) for k in GUIDE_FLAGS if getattr(self, k) is not None})
        processor.update(map_guide_flags(given))
        if self.image_column and "prepare_multimodal_stage" not in given and "has_image" not in given:
            # The guide's has_image=True: images reach the engine through Ray's multimodal stage.
            processor["prepare_multimodal_stage"] = True
        processor["runtime_env"] = self._engine_runtime_env()
        processor["engine_kwargs"], _ = split_secrets(processor["engine_kwargs"], ENGINE_SECRET_ENV)
        return processor

    def serve_body(self) -> dict[str, Any]:
        given = sorted(name for name in ENGINE_ONLY if getattr(self, name))
        if given:
            raise SpecError(
                f"{', '.join(given)} configure an engine the job starts; with serve_deployment="
                f"{self.serve_deployment!r} the deployment's own engine answers (configure it in its LLMConfig)"
            )
        if self.engine_task_type not in ("generate", "embed"):
            raise SpecError(f"task_type={self.engine_task_type!r}: a Serve deployment answers 'generate' or 'embed'")
        serve = self.section("serve")
        if self.engine_task_type == "embed":
            serve["endpoint"] = "embeddings"
        return {
            **serve,
            "model": self.model_source,
            "concurrency": self.concurrency if isinstance(self.concurrency, int) else max(self.concurrency),
            "batch_size": self.batch_size,
        }

    def spec_body(self, context: Context, output_uri: str, package_dir: Path) -> dict[str, Any]:
        if self.serve_deployment:
            return self.batch_body("serve", {"serve": self.serve_body()}, output_uri, package_dir, context)
        processor = self.processor_body()
        if processor["price_per_hour"] is None:
            # A cluster's price is the cluster's: the ray connection may carry it for every task.
            processor["price_per_hour"] = connection_price(self.ray_conn_id, "price_per_hour")
        return self.batch_body("vllm", {"processor": processor}, output_uri, package_dir, context)
