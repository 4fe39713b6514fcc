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


def test_the_outage_proxy_refuses_while_down_and_binds_its_port_again():
    """The reliability test's dashboard outage: while down, the proxy's port takes no connection (one pending
    accept must not keep listening), and up() binds the same port again."""
    import socket
    import time

    from tests.integration.services import TcpProxy

    with socket.socket() as target:
        target.bind(("127.0.0.1", 0))
        target.listen(8)
        proxy = TcpProxy("127.0.0.1", target.getsockname()[1])
        try:
            time.sleep(0.1)  # the proxy's accept is waiting on its thread
            proxy.down()
            for _ in range(3):
                try:
                    socket.create_connection(("127.0.0.1", proxy.port), timeout=2).close()
                except ConnectionRefusedError:
                    continue
                raise AssertionError("the proxy accepted a connection while down")
            proxy.up()
            socket.create_connection(("127.0.0.1", proxy.port), timeout=2).close()
        finally:
            proxy.close()
