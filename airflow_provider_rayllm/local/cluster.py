"""A local Ray head on loopback with the Jobs API, free ports and token auth, started and stopped by us.

State (ports, token file, logs) lives in one folder so a second process can find and stop the cluster:
``python -m airflow_provider_rayllm.local start|stop|status``. ``start --worker-nodes N`` adds N more
raylets on the same machine: a multi-node cluster for placement groups, custom node resources and engine
replicas spread over nodes.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_STATE_DIR = Path(
    os.environ.get("RAYLLM_LOCAL_DIR", Path.home() / ".cache" / "airflow_provider_rayllm" / "local")
)

# Idle task workers a raylet keeps. Ray's default is one per CPU: on this 2-CPU head a streaming job's tasks
# (read, requests, repartition, progress tap, write) run beside the engine's actors in more processes than
# that, so the raylet killed the idle ones a second later and started new ones for the next tasks, a worker
# process every 10 s or so, each paying its Python and Ray imports again.
IDLE_WORKERS = 8

# Ray's log monitor looks for new log files on every 0.1 s loop until its folder holds this many, then every
# 0.5 s. Each look globs the whole folder, which keeps a log for every worker process the session started (455
# entries after a CI run), so a long-lived head spent 2.4 CPU-s a minute idle on it; at 0 it spends 0.64 (73 %
# less; benchmarks/log_monitor_bench.py, results/2026-12-03-log-monitor.json). A new worker's output reaches the
# job log up to 0.5 s after the worker starts; lines of files already open are not delayed.
LOG_MONITOR_MANY_FILES = 0


# The ports we choose for Ray and the test services lie between Ray's worker ports (its --min/--max-worker-port
# defaults, 10002-19999) and the kernel's ephemeral range (from 32768 here). A port the kernel hands out for a
# bind to port 0 comes from that range and can be handed out again once released: in CI a worker raylet's object
# manager, which binds port 0, took the dashboard agent port chosen for that node a moment before, and the node
# never started ("Failed to bind to address 0.0.0.0:37523"). Ports handed out here are remembered for a while
# in one file, under a lock, so two processes choosing at once (the two pytest workers) never get the same one.
OWN_PORTS_FROM = 20000
PORT_CLAIMS = Path(tempfile.gettempdir()) / "rayllm-port-claims.json"
PORT_CLAIM_S = 600.0


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; IANA's range starts at 49152


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports nothing listens on, outside the kernel's ephemeral range and Ray's worker ports,
    and not handed out by this function in the last ten minutes."""
    low, high = OWN_PORTS_FROM, _ephemeral_start() - 1
    if high - low < 1000:  # an unusual kernel range: leave the choice to the kernel
        return sorted(_kernel_ports(count))
    with open(PORT_CLAIMS.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        now = time.time()
        try:
            claims = {int(p): t for p, t in json.loads(PORT_CLAIMS.read_text()).items() if now - t < PORT_CLAIM_S}
        except (OSError, ValueError, AttributeError):
            claims = {}
        chosen: list[int] = []
        pick = secrets.SystemRandom()
        for _ in range(50 * count):
            port = pick.randint(low, high)
            if port not in claims and port not in chosen and _bindable(port):
                chosen.append(port)
                if len(chosen) == count:
                    break
        else:
            raise RuntimeError(f"no {count} free ports between {low} and {high}")
        claims.update((port, now) for port in chosen)
        PORT_CLAIMS.write_text(json.dumps(claims))
    return sorted(chosen)


def _kernel_ports(count: int) -> set[int]:
    ports: set[int] = set()
    while len(ports) < count:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            ports.add(int(sock.getsockname()[1]))
    return ports


def free_port() -> int:
    return _free_ports(1)[0]


@dataclass
class ClusterInfo:
    gcs_address: str
    dashboard_url: str
    token_file: str
    temp_dir: str
    num_cpus: int
    ports: list[int] | None = None  # gcs, dashboard, agent http, agent grpc, runtime env agent, metrics, client
    worker_nodes: list[dict] | None = None  # one {"temp_dir", "num_cpus", "resources"} per extra raylet

    @property
    def token(self) -> str:
        return Path(self.token_file).read_text().strip()

    def processes(self) -> list:
        """This cluster's processes (psutil), and no other Ray's on the machine: those naming one of its temp
        dirs or its GCS address, and all their descendants (workers, engines)."""
        import psutil

        port = self.gcs_address.rsplit(":", 1)[1]
        gcs_address = re.compile(rf"[0-9.]+:{port}(?![0-9])")
        own_dirs = [self.temp_dir, *(node["temp_dir"] for node in self.worker_nodes or [])]
        found: dict[int, psutil.Process] = {}
        for proc in psutil.process_iter(["cmdline"]):
            cmdline = " ".join(proc.info.get("cmdline") or [])
            # Ray may name the GCS by the machine's address instead of 127.0.0.1 (the client server does).
            if not (any(d in cmdline for d in own_dirs) or gcs_address.search(cmdline)):
                continue
            try:
                found[proc.pid] = proc
                for child in proc.children(recursive=True):
                    found[child.pid] = child
            except psutil.NoSuchProcess:
                continue
        return list(found.values())

    def airflow_conn_uri(self, output_base: str | None = None) -> str:
        """The ``ray_default`` connection as a JSON value for ``AIRFLOW_CONN_RAY_DEFAULT``."""
        extra: dict[str, object] = {}
        if output_base:
            extra["output_base"] = output_base
        return json.dumps({"conn_type": "ray", "host": self.dashboard_url, "password": self.token, "extra": extra})


class LocalRayCluster:
    """Start/stop one local head. ``num_cpus`` defaults to the machine's cores."""

    def __init__(
        self,
        state_dir: str | Path = DEFAULT_STATE_DIR,
        num_cpus: int | None = None,
        resources: dict | None = None,
        num_gpus: int = 0,
        object_store_memory: int | None = None,
    ):
        self.state_dir = Path(state_dir)
        self.num_cpus = num_cpus or os.cpu_count() or 2
        self.resources = resources or {}
        self.num_gpus = num_gpus
        # Bytes for the head's object store (Ray's default: 30% of the machine's memory).
        self.object_store_memory = object_store_memory

    def add_node(self, num_cpus: int, resources: dict | None = None, timeout: float = 120.0) -> dict:
        """Start one more raylet on this machine and join it to the running head.

        Each extra raylet gets its own temp dir. Sharing the head's would also share its session folder,
        runtime_env packages included, and the new node's runtime-env agent deletes packages it does not
        use itself: a job driver on the head then lost its working directory a few seconds after
        ``ray.init()`` (its next torch import died with "Intel oneMKL FATAL ERROR: Cannot load
        libtorch_cpu.so").
        """
        info = self.info()
        if info is None:
            raise RuntimeError(f"no running head in {self.state_dir}; start() it first")
        nodes = list(info.worker_nodes or [])
        port = info.gcs_address.rsplit(":", 1)[1]
        temp_dir = f"/tmp/rayllm-{port}-w{len(nodes) + 1}"
        agent_http, agent_grpc, runtime_env_agent, metrics = _free_ports(4)
        cmd = [
            self._ray_bin(),
            "start",
            f"--address={info.gcs_address}",
            "--node-ip-address=127.0.0.1",
            f"--dashboard-agent-listen-port={agent_http}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--runtime-env-agent-port={runtime_env_agent}",
            f"--metrics-export-port={metrics}",
            f"--num-cpus={num_cpus}",
            "--num-gpus=0",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
        ]
        if resources:
            cmd.append(f"--resources={json.dumps(resources)}")
        self._ray_start(cmd, self.state_dir / f"ray-start-w{len(nodes) + 1}.log", timeout)
        node = {"temp_dir": temp_dir, "num_cpus": num_cpus, "resources": dict(resources or {})}
        nodes.append(node)
        info.worker_nodes = nodes
        self.info_file.write_text(json.dumps(asdict(info), indent=2))
        deadline = time.time() + timeout
        while len(self.alive_nodes(info)) < len(nodes) + 1:
            if time.time() > deadline:
                raise RuntimeError(f"the raylet in {temp_dir} did not join {info.gcs_address} within {timeout:.0f} s")
            time.sleep(1)
        return node

    @staticmethod
    def state_list(info: ClusterInfo, resource: str, timeout: float = 10) -> list[dict]:
        """One of Ray's state API listings (`nodes`, `workers`, ...) in detail, or [] when the head does not answer."""
        request = urllib.request.Request(
            f"{info.dashboard_url}/api/v0/{resource}?detail=1&limit=10000",
            headers={"Authorization": f"Bearer {info.token}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                return list(json.loads(resp.read())["data"]["result"]["result"])
        except (urllib.error.URLError, OSError, KeyError, ValueError):
            return []

    @classmethod
    def alive_nodes(cls, info: ClusterInfo) -> list[dict]:
        """The cluster's live nodes as Ray's state API lists them (node id, resources, head or not)."""
        return [n for n in cls.state_list(info, "nodes") if n.get("state") == "ALIVE"]

    @property
    def info_file(self) -> Path:
        return self.state_dir / "cluster.json"

    def info(self) -> ClusterInfo | None:
        if not self.info_file.exists():
            return None
        return ClusterInfo(**json.loads(self.info_file.read_text()))

    def env(self) -> dict[str, str]:
        """The environment for Ray processes and clients of this cluster: token auth on, our venv first."""
        env = dict(os.environ)
        env["RAY_AUTH_MODE"] = "token"
        env["RAY_AUTH_TOKEN_PATH"] = str(self.state_dir / "auth_token")
        env.pop("RAY_AUTH_TOKEN", None)
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        env["RAY_num_workers_soft_limit"] = str(IDLE_WORKERS)
        env.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", str(LOG_MONITOR_MANY_FILES))
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        # Jobs on the embedded stack use the same interpreter and packages as this process.
        env["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
        return env

    def _ray_start(self, cmd: list[str], log_path: Path, timeout: float) -> None:
        with open(log_path, "w") as log:
            proc = subprocess.run(cmd, env=self.env(), stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(
                f"`{' '.join(cmd[1:3])}` failed with exit code {proc.returncode}; see {log_path}:\n{log_path.read_text()[-3000:]}"
            )

    def _ray_bin(self) -> str:
        candidate = Path(sys.executable).with_name("ray")
        return str(candidate) if candidate.exists() else shutil.which("ray") or "ray"

    def start(self, timeout: float = 120.0, _ports: list[int] | None = None) -> ClusterInfo:
        existing = self.info()
        if existing is not None and self._healthy(existing):
            return existing
        self.state_dir.mkdir(parents=True, exist_ok=True)
        token_file = self.state_dir / "auth_token"
        if _ports is None or not token_file.exists():
            token_file.write_text(secrets.token_hex(32))
        token_file.chmod(0o600)
        ports = list(_ports) if _ports else _free_ports(7)
        gcs, dash, agent_http, agent_grpc, runtime_env_agent, metrics, client = ports
        # Ray's session folder path must stay short (unix socket paths are limited to 107 bytes).
        temp_dir = Path("/tmp") / f"rayllm-{gcs}"
        cmd = [
            self._ray_bin(),
            "start",
            "--head",
            "--node-ip-address=127.0.0.1",
            f"--port={gcs}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            f"--dashboard-agent-listen-port={agent_http}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--runtime-env-agent-port={runtime_env_agent}",
            f"--metrics-export-port={metrics}",
            f"--ray-client-server-port={client}",
            f"--num-cpus={self.num_cpus}",
            f"--num-gpus={self.num_gpus}",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
        ]
        if self.resources:
            cmd.append(f"--resources={json.dumps(self.resources)}")
        if self.object_store_memory:
            cmd.append(f"--object-store-memory={int(self.object_store_memory)}")
        self._ray_start(cmd, self.state_dir / "ray-start.log", timeout)
        info = ClusterInfo(
            gcs_address=f"127.0.0.1:{gcs}",
            dashboard_url=f"http://127.0.0.1:{dash}",
            token_file=str(token_file),
            temp_dir=str(temp_dir),
            num_cpus=self.num_cpus,
            ports=ports,
        )
        self.info_file.write_text(json.dumps(asdict(info), indent=2))
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self._healthy(info):
                return info
            time.sleep(1)
        raise RuntimeError(f"the Jobs API at {info.dashboard_url} did not answer within {timeout:.0f} s")

    def restart(self, timeout: float = 120.0) -> ClusterInfo:
        """Stop the head and start a fresh one on the same ports with the same token.

        Clients keep their address and token; everything the old head knew (jobs, actors, objects) is gone.
        """
        info = self.info()
        if info is None or not info.ports:
            raise RuntimeError(f"no running cluster with known ports in {self.state_dir}")
        self.stop()
        deadline = time.time() + timeout
        while True:  # the old processes' sockets must be released before `ray start` binds them again
            try:
                return self.start(timeout=max(10.0, deadline - time.time()), _ports=info.ports)
            except RuntimeError:
                if time.time() > deadline:
                    raise
                time.sleep(2)

    @staticmethod
    def _healthy(info: ClusterInfo) -> bool:
        request = urllib.request.Request(
            f"{info.dashboard_url}/api/jobs/", headers={"Authorization": f"Bearer {info.token}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=5) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, FileNotFoundError):
            return False

    def stop(self, timeout: float = 10.0) -> None:
        """Stop this cluster only (``ray stop`` would stop every Ray on the machine)."""
        import psutil

        info = self.info()
        if info is None:
            return
        victims = info.processes()
        for proc in victims:
            try:
                proc.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(victims, timeout=timeout)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        self.info_file.unlink(missing_ok=True)
        shutil.rmtree(info.temp_dir, ignore_errors=True)
        for node in info.worker_nodes or []:
            shutil.rmtree(node["temp_dir"], ignore_errors=True)
