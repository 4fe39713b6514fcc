"""The ports the embedded stack hands to Ray and the test services."""

from __future__ import annotations

import multiprocessing

from airflow_provider_rayllm.local import cluster


def _choose(count: int) -> list[int]:
    return [port for _ in range(count // 10) for port in cluster._free_ports(10)]


def test_ports_lie_outside_the_kernels_range_and_rays_worker_ports():
    ports = cluster._free_ports(200)
    assert len(set(ports)) == 200
    # Ray's worker processes take 10002-19999; the kernel gives ports from its ephemeral range to any bind(0).
    assert all(cluster.OWN_PORTS_FROM <= port < cluster._ephemeral_start() for port in ports), ports
    assert cluster.OWN_PORTS_FROM > 19999


def test_two_processes_choosing_at_once_never_get_the_same_port():
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        first, second = pool.map(_choose, [400, 400])
    assert len(set(first)) == len(set(second)) == 400
    assert not set(first) & set(second)
