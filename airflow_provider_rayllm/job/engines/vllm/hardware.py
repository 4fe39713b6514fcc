"""The cluster's hardware as the engine settings need it: its GPUs and their card, and whether a CPU computes
in half precision natively."""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("airflow_provider_rayllm.job")


BIG_GPU_GIB = 70


@dataclass(frozen=True)
class GpuCard:
    """A GPU of the cluster, as nvidia-smi names it on its node."""

    name: str
    memory_gib: float

    @property
    def big(self) -> bool:
        return self.memory_gib >= BIG_GPU_GIB and "a100" not in self.name.lower()


def _query_gpus() -> list[tuple[str, float]]:
    import subprocess

    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    cards = []
    for line in out.splitlines():
        name, _, mib = line.rpartition(",")
        if name.strip() and mib.strip().isdigit():
            cards.append((name.strip(), int(mib) / 1024))
    return cards


def probe_gpu(accelerator_type: str | None, timeout_s: float = 60) -> GpuCard | None:
    """The smallest GPU on a node the engines may use, read there with nvidia-smi (a task holding no GPU,
    so it runs beside other work); None, with the reason logged, when it cannot be read."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    wanted = f"accelerator_type:{accelerator_type}" if accelerator_type else None
    nodes = [
        n
        for n in ray.nodes()
        if n.get("Alive")
        and n.get("Resources", {}).get("GPU", 0) > 0
        and (wanted is None or n["Resources"].get(wanted))
    ]
    if not nodes:
        log.warning("no GPU node to read the card from; the engine limits for cards under %d GiB apply", BIG_GPU_GIB)
        return None
    query = ray.remote(num_cpus=0)(_query_gpus).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[0]["NodeID"], soft=False)
    )
    try:
        cards = ray.get(query.remote(), timeout=timeout_s)
    except Exception as exc:  # nvidia-smi missing or failing, or the node busy past the timeout
        log.warning(
            "could not read the GPU's memory on node %s (%s: %s); the engine limits for cards under %d GiB apply",
            nodes[0].get("NodeManagerAddress"),
            type(exc).__name__,
            str(exc)[:200],
            BIG_GPU_GIB,
        )
        return None
    if not cards:
        return None
    name, gib = min(cards, key=lambda c: c[1])
    return GpuCard(name, round(gib, 1))


def cluster_gpus() -> float:
    import ray

    return float(ray.cluster_resources().get("GPU", 0))


def cpu_has_native_half() -> bool:
    """Whether this node's CPU computes in bfloat16 natively (AVX512-BF16 or AMX). Without it PyTorch
    emulates half-precision matmuls: measured on an AVX2-only EPYC, a bfloat16 matmul ran 70x slower
    than float32, and SmolLM2 generated 9 tokens/s instead of 52."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            flags = {f for line in handle if line.startswith("flags") for f in line.split(":", 1)[1].split()}
    except OSError:
        return True  # not Linux: leave the model's own dtype
    return bool({"avx512_bf16", "amx_bf16"} & flags)
