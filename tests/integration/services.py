"""Local S3 and GCS endpoints speaking the real protocols, started and stopped by the tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from airflow_provider_rayllm.local.cluster import free_port


def _wait_http(url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
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
def _process(cmd: list[str], url: str, log: Path, timeout: float = 60.0) -> Iterator[None]:
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        _wait_http(url, timeout, proc)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextmanager
def s3_server(log_dir: Path) -> Iterator[str]:
    """moto's server mode: a real S3 HTTP endpoint on loopback."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with _process(cmd, url, log_dir / "moto.log"):
        yield url


@contextmanager
def gcs_server(log_dir: Path) -> Iterator[str]:
    """gcp-storage-emulator: the GCS JSON API on loopback, in memory."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    binary = Path(sys.executable).with_name("gcp-storage-emulator")
    cmd = [str(binary), "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"]
    with _process(cmd, url, log_dir / "gcs-emulator.log"):
        yield url


@contextmanager
def vllm_openai_server(model_dir: Path, name: str, log_dir: Path) -> Iterator[str]:
    """vLLM's own OpenAI-compatible server on the CPU engine; about 40 s to answer."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", name,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "1024", "--enforce-eager", "--gpu-memory-utilization", "0.15",
    ]
    # /v1/models answers only once the engine is up (about 40 s on 2 cores).
    with _process(cmd, f"http://127.0.0.1:{port}/v1/models", log_dir / "vllm-server.log", timeout=300):
        yield f"http://127.0.0.1:{port}/v1"


@contextmanager
def storm_server(storm_seconds: float, log_dir: Path) -> Iterator[str]:
    port = free_port()
    script = Path(__file__).with_name("storm_server.py")
    with _process([sys.executable, str(script), str(port), str(storm_seconds)], f"http://127.0.0.1:{port}/stats", log_dir / "storm.log"):
        yield f"http://127.0.0.1:{port}"
