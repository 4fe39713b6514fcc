"""VLLMBatchOperator: the reference guide's vLLM batch pipeline as one Airflow task on a Ray cluster."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow_provider_rayllm.contract.names import ENGINE_SECRET_ENV
from airflow_provider_rayllm.contract.secrets import secret_env_vars, split_secrets
from airflow_provider_rayllm.contract.spec import SpecError, map_guide_flags
from airflow_provider_rayllm.operators import arguments
from airflow_provider_rayllm.operators.batch import BatchOperator

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
        given = {k: processor[k] for k in STAGES if k in self.arguments_given}
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
        return self.batch_body("vllm", {"processor": self.processor_body()}, output_uri, package_dir, context)
