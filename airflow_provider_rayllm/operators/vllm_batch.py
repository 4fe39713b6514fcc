"""VLLMBatchOperator: the reference guide's vLLM batch pipeline as one Airflow task on a Ray cluster."""

from __future__ import annotations

import hashlib
import inspect
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from airflow_provider_rayllm.operators import credentials
from airflow_provider_rayllm.operators.base import RayLLMBatchBaseOperator
from airflow_provider_rayllm.spec import SpecError, map_guide_flags

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


def _callable_ref(fn: Callable | str | None, name: str, package_dir: Path) -> dict[str, Any] | None:
    """A callable travels as 'module:function' or cloudpickled into the job package."""
    if fn is None:
        return None
    if isinstance(fn, str):
        return {"import_path": fn}
    if not callable(fn):
        raise TypeError(f"{name} must be a callable or a 'module:function' string, got {fn!r}")

    file_name = f"{name}.pkl"
    (package_dir / file_name).write_bytes(_pickle_by_value(fn))
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        code = getattr(fn, "__code__", None)
        source = repr(code.co_code + repr(code.co_consts).encode()) if code else repr(fn)
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    return {"pickled": file_name, "digest": digest}


class VLLMBatchOperator(RayLLMBatchBaseOperator):
    """Run ray.data.llm's vLLM processor over files as a Ray job; return the manifest.

    Prompt building: one of ``prompt_column``, ``prompt_template`` (``"Summarize: {text}"``),
    ``messages_column`` or ``preprocess`` (a callable row -> request, as in the guide), plus
    ``system_prompt`` and ``sampling_params``. ``postprocess`` shapes output rows.

    ``id_column`` (a column with a unique id per row) makes the job resumable: finished rows are
    saved as they finish, and a retry after a stop or failure sends only the other rows to the engine.

    Processor settings keep the guide's names: ``model_source``, ``engine_kwargs``, ``concurrency``,
    ``batch_size``, ``accelerator_type``, ``runtime_env``, ``max_concurrent_batches``,
    ``placement_group_config``, ``task_type``; the guide's ``apply_chat_template``, ``tokenize``,
    ``detokenize``, ``has_image`` and ``chat_template`` are accepted and mapped to Ray 2.60's stage
    configs.

    With ``serve_deployment`` (and ``serve_app``), no engine starts in the job: the rows go to an LLM
    deployment already running on the cluster's Ray Serve (the guide's "batch inference with a Serve
    deployment"); ``model_source`` is then the model id the deployment serves.
    """

    template_fields: Sequence[str] = (
        "input_uri",
        "sql",
        "output_uri",
        "output_table",
        "model_source",
        "serve_deployment",
        "serve_app",
        "prompt_column",
        "prompt_template",
        "messages_column",
        "system_prompt",
        "sampling_params",
        "engine_kwargs",
        "dynamic_lora_loading_path",
        "max_rows",
        "concurrency",
        "placement_group_config",
        "accelerator_type",
        "job_runtime_env",
    )
    template_fields_renderers = {
        "sampling_params": "json",
        "engine_kwargs": "json",
        "placement_group_config": "json",
        "prompt_template": "jinja",
        "sql": "sql",
    }

    def __init__(
        self,
        *,
        model_source: str,
        input_uri: str | list[str] | None = None,
        sql: str | None = None,
        sql_conn_id: str | None = None,
        sql_shard_keys: list[str] | None = None,
        sql_parallelism: int | None = None,
        input_format: str | None = None,
        input_columns: list[str] | None = None,
        prompt_column: str | None = None,
        prompt_template: str | None = None,
        messages_column: str | None = None,
        preprocess: Callable[[dict], dict] | str | None = None,
        postprocess: Callable[[dict], dict] | str | None = None,
        system_prompt: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        pooling_params: dict[str, Any] | None = None,
        output_column: str = "response",
        lora_column: str | None = None,
        lora_adapters: list[str] | None = None,
        keep_columns: list[str] | None = None,
        id_column: str | None = None,
        image_column: str | None = None,
        task_type: str = "generate",
        engine_kwargs: dict[str, Any] | None = None,
        concurrency: int | tuple[int, int] = 1,
        batch_size: int = 32,
        accelerator_type: str | None = None,
        runtime_env: dict[str, Any] | None = None,
        max_concurrent_batches: int | None = None,
        max_tasks_in_flight_per_actor: int | None = None,
        max_pending_requests: int | None = None,
        placement_group_config: dict[str, Any] | None = None,
        chat_template_stage: bool | dict[str, Any] | None = None,
        tokenize_stage: bool | dict[str, Any] | None = None,
        detokenize_stage: bool | dict[str, Any] | None = None,
        prepare_multimodal_stage: bool | dict[str, Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        dynamic_lora_loading_path: str | None = None,
        log_engine_metrics: bool = False,
        resource_profile: str = "auto",
        usage_stats: bool = False,
        apply_chat_template: bool | None = None,
        tokenize: bool | None = None,
        detokenize: bool | None = None,
        has_image: bool | None = None,
        chat_template: str | None = None,
        serve_deployment: str | None = None,
        serve_app: str = "default",
        serve_request_timeout_s: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.serve_deployment = serve_deployment
        self.serve_app = serve_app
        self.serve_request_timeout_s = serve_request_timeout_s
        self.input_uri = input_uri
        self.sql = sql
        self.sql_conn_id = sql_conn_id
        self.sql_shard_keys = sql_shard_keys
        self.sql_parallelism = sql_parallelism
        self.model_source = model_source
        self.input_format = input_format
        self.input_columns = input_columns
        self.prompt_column = prompt_column
        self.prompt_template = prompt_template
        self.messages_column = messages_column
        self.preprocess = preprocess
        self.postprocess = postprocess
        self.system_prompt = system_prompt
        self.sampling_params = sampling_params or {}
        self.pooling_params = pooling_params
        self.output_column = output_column
        self.lora_column = lora_column
        self.lora_adapters = lora_adapters
        self.keep_columns = keep_columns
        self.id_column = id_column
        self.image_column = image_column
        # BaseOperator already has a `task_type` property (the class name).
        self.engine_task_type = task_type
        self.engine_kwargs = engine_kwargs or {}
        self.concurrency = concurrency
        self.batch_size = batch_size
        self.accelerator_type = accelerator_type
        self.runtime_env = runtime_env
        self.max_concurrent_batches = max_concurrent_batches
        self.max_tasks_in_flight_per_actor = max_tasks_in_flight_per_actor
        self.max_pending_requests = max_pending_requests
        self.placement_group_config = placement_group_config
        self.stage_settings = {
            "chat_template_stage": chat_template_stage,
            "tokenize_stage": tokenize_stage,
            "detokenize_stage": detokenize_stage,
            "prepare_multimodal_stage": prepare_multimodal_stage,
            "apply_chat_template": apply_chat_template,
            "tokenize": tokenize,
            "detokenize": detokenize,
            "has_image": has_image,
            "chat_template": chat_template,
        }
        self.chat_template_kwargs = chat_template_kwargs
        self.dynamic_lora_loading_path = dynamic_lora_loading_path
        self.log_engine_metrics = log_engine_metrics
        self.resource_profile = resource_profile
        self.usage_stats = usage_stats

    def source_body(self) -> dict[str, Any]:
        if (self.input_uri is None) == (self.sql is None):
            raise SpecError("give exactly one of input_uri (files) or sql (with sql_conn_id)")
        if self.sql is None:
            return {"kind": "files", "uris": self.input_uri, "format": self.input_format, "columns": self.input_columns}
        if not self.sql_conn_id:
            raise SpecError("sql needs sql_conn_id, the Airflow connection of the database")
        dialect, _ = credentials.sql_source(self.sql_conn_id)
        return {
            "kind": "sql",
            "sql": self.sql,
            "dialect": dialect,
            "shard_keys": self.sql_shard_keys,
            "parallelism": self.sql_parallelism,
        }

    def lineage_inputs(self) -> list[str]:
        # A SQL query names no single table; files and bucket prefixes are reported as read.
        if self.input_uri is None:
            return []
        return [self.input_uri] if isinstance(self.input_uri, str) else list(self.input_uri)

    def job_secrets(self) -> dict[str, str]:
        env = super().job_secrets()
        if self.sql is not None and self.sql_conn_id:
            env.update(credentials.sql_source(self.sql_conn_id)[1])
        # The guide's runtime_env={"env_vars": {"HF_TOKEN": ...}}: accepted, but the token travels as a job
        # secret, not in the runtime_env that Ray shows. A connection (hf_conn_id) wins over it.
        for name, value in _guide_tokens(self.runtime_env).items():
            env.setdefault(name, value)
        return env

    def _runtime_env_without_tokens(self) -> dict[str, Any] | None:
        """The engine's runtime_env as the spec carries it; job_secrets() carries the tokens taken out.
        Said once per submission (job_secrets() runs again when the result is published)."""
        tokens = _guide_tokens(self.runtime_env)
        if not tokens:
            return self.runtime_env
        self.log.warning(
            "runtime_env.env_vars %s: moved to the job's secrets (Ray would show runtime_env env vars); "
            "an Airflow connection passed as hf_conn_id keeps the token out of the DAG file too",
            sorted(tokens),
        )
        env_vars = {k: v for k, v in self.runtime_env["env_vars"].items() if k not in HF_TOKEN_VARS}  # type: ignore[index]
        return {**self.runtime_env, "env_vars": env_vars}  # type: ignore[dict-item]

    def spec_body(self, context: Context, output_uri: str, package_dir: Path) -> dict[str, Any]:
        stages = map_guide_flags({k: v for k, v in self.stage_settings.items() if v is not None})
        if self.image_column and "prepare_multimodal_stage" not in stages:
            # The guide's has_image=True: images reach the engine through Ray's multimodal stage.
            stages["prepare_multimodal_stage"] = True
        processor: dict[str, Any] = {
            "model_source": self.model_source,
            "task_type": self.engine_task_type,
            "engine_kwargs": self.engine_kwargs,
            "concurrency": self.concurrency,
            "batch_size": self.batch_size,
            "accelerator_type": self.accelerator_type,
            "runtime_env": self._runtime_env_without_tokens(),
            "max_concurrent_batches": self.max_concurrent_batches,
            "max_tasks_in_flight_per_actor": self.max_tasks_in_flight_per_actor,
            "max_pending_requests": self.max_pending_requests,
            "placement_group_config": self.placement_group_config,
            "chat_template_kwargs": self.chat_template_kwargs,
            "dynamic_lora_loading_path": self.dynamic_lora_loading_path,
            "lora_adapters": self.lora_adapters,
            "log_engine_metrics": self.log_engine_metrics,
            "resource_profile": self.resource_profile,
            "usage_stats": self.usage_stats,
            **stages,
        }
        body = {
            "kind": "vllm",
            "source": self.source_body(),
            "prompt": {
                "prompt_column": self.prompt_column,
                "template": self.prompt_template,
                "messages_column": self.messages_column,
                "preprocess": _callable_ref(self.preprocess, "preprocess", package_dir),
                "postprocess": _callable_ref(self.postprocess, "postprocess", package_dir),
                "system_prompt": self.system_prompt,
                "sampling_params": self.sampling_params,
                "pooling_params": self.pooling_params,
                "output_column": self.output_column,
                "lora_column": self.lora_column,
                "keep_columns": self.keep_columns,
                "id_column": self.id_column,
                "image_column": self.image_column,
            },
            "processor": processor,
            "limits": {"max_error_fraction": self.max_error_fraction, "max_rows": self.max_rows},
        }
        if self.serve_deployment:
            body["kind"] = "serve"
            body.pop("processor")
            body["serve"] = self.serve_body()
        return body

    def serve_body(self) -> dict[str, Any]:
        engine_only = {
            "engine_kwargs": self.engine_kwargs,
            "placement_group_config": self.placement_group_config,
            "dynamic_lora_loading_path": self.dynamic_lora_loading_path,
            "lora_column": self.lora_column,
            "accelerator_type": self.accelerator_type,
        }
        given = sorted(name for name, value in engine_only.items() if value)
        if given:
            raise SpecError(
                f"{', '.join(given)} configure an engine the job starts; with serve_deployment="
                f"{self.serve_deployment!r} the deployment's own engine answers (configure it in its LLMConfig)"
            )
        if self.engine_task_type not in ("generate", "embed"):
            raise SpecError(f"task_type={self.engine_task_type!r}: a Serve deployment answers 'generate' or 'embed'")
        return {
            "deployment_name": self.serve_deployment,
            "app_name": self.serve_app,
            "model": self.model_source,
            "endpoint": "embeddings" if self.engine_task_type == "embed" else "chat",
            "concurrency": self.concurrency if isinstance(self.concurrency, int) else max(self.concurrency),
            "batch_size": self.batch_size,
            "request_timeout_s": self.serve_request_timeout_s,
        }


HF_TOKEN_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


def _guide_tokens(runtime_env: dict[str, Any] | None) -> dict[str, str]:
    env_vars = (runtime_env or {}).get("env_vars") or {}
    return {k: str(env_vars[k]) for k in HF_TOKEN_VARS if env_vars.get(k)}
