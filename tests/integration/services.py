"""Local S3 and GCS endpoints speaking the real protocols, started and stopped by the tests."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from airflow_provider_rayllm.local.cluster import free_port
from airflow_provider_rayllm.local.services import s3_server, vllm_openai_server, wait_http
from airflow_provider_rayllm.local.services import server_process as _process

__all__ = ["s3_server", "vllm_openai_server", "wait_http"]


@contextmanager
def hf_hub_server(
    log_dir: Path,
    repo_id: str | None,
    model_dir: Path | None,
    token: str,
    datasets: dict[str, Path] | None = None,
    public_datasets: dict[str, Path] | None = None,
) -> Iterator[tuple[str, Path]]:
    """A Hugging Face Hub serving `model_dir` as the gated model `repo_id`, each folder of `datasets` as a gated
    dataset repo and each of `public_datasets` as one anyone may read (hf_hub_server.py); yields its URL and
    the file where it logs each request and whether it carried the token."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    requests = log_dir / f"hub-requests-{port}.jsonl"
    repos = [f"model:{repo_id}={model_dir}"] if repo_id and model_dir else []
    repos += [f"dataset:{name}={folder}" for name, folder in (datasets or {}).items()]
    repos += [f"public-dataset:{name}={folder}" for name, folder in (public_datasets or {}).items()]
    cmd = [sys.executable, str(Path(__file__).with_name("hf_hub_server.py")), str(port), str(requests), *repos]
    with _process(cmd, url, log_dir / "hf-hub.log", env={"HUB_TOKEN": token}):
        yield url, requests


@contextmanager
def gcs_server(log_dir: Path) -> Iterator[str]:
    """gcp-storage-emulator: the GCS JSON API on loopback, in memory, one thread per request."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    script = Path(__file__).with_name("gcs_emulator.py")
    cmd = [sys.executable, str(script), "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"]
    with _process(cmd, url, log_dir / "gcs-emulator.log"):
        yield url


@contextmanager
def storm_server(storm_seconds: float, log_dir: Path) -> Iterator[str]:
    port = free_port()
    script = Path(__file__).with_name("storm_server.py")
    with _process(
        [sys.executable, str(script), str(port), str(storm_seconds)],
        f"http://127.0.0.1:{port}/stats",
        log_dir / "storm.log",
    ):
        yield f"http://127.0.0.1:{port}"


@contextmanager
def oauth_token_server(log_dir: Path) -> Iterator[str]:
    """An OAuth 2.0 token endpoint on loopback (the refresh-token grant), for `authorized_user` credentials.

    The GCS emulator takes any bearer token, but Google's C++ client (pyarrow's GCS filesystem, which Ray's
    model loader uses) must first obtain one from the credentials' token_uri; this serves it locally.
    """
    port = free_port()
    script = Path(__file__).with_name("token_server.py")
    with _process([sys.executable, str(script), str(port)], f"http://127.0.0.1:{port}/token", log_dir / "oauth.log"):
        yield f"http://127.0.0.1:{port}/token"


def authorized_user_keyfile(token_uri: str, revoked: bool = False) -> dict[str, str]:
    """Google `authorized_user` credentials whose token comes from the local token endpoint."""
    return {
        "type": "authorized_user",
        "client_id": "rayllm-tests",
        "client_secret": "local-client-secret",
        "refresh_token": "revoked-refresh-token" if revoked else "local-refresh-token",
        "token_uri": token_uri,
    }


@contextmanager
def echo_server(delay_s: float, log_dir: Path, count: bool = True) -> Iterator[str]:
    """A chat endpoint that echoes each prompt after ``delay_s``; GET /stats counts requests per prompt
    (unless ``count`` is False)."""
    port = free_port()
    script = Path(__file__).with_name("echo_server.py")
    cmd = [sys.executable, str(script), str(port), str(delay_s), *([] if count else ["nocount"])]
    with _process(cmd, f"http://127.0.0.1:{port}/stats", log_dir / "echo.log"):
        yield f"http://127.0.0.1:{port}"


class TcpProxy:
    """A TCP relay on loopback that can go dark: while down, its port refuses connections (nothing listens)
    and open connections are cut, as when a dashboard host drops off the network."""

    def __init__(self, target_host: str, target_port: int):
        import socket
        import threading

        self.target = (target_host, target_port)
        self.port = free_port()
        self._socket, self._threading = socket, threading
        self._conns: list = []
        self._lock = threading.Lock()
        self._listener = None
        self._up = threading.Event()
        self.up()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        socket = self._socket
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        self._threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            # Shut down first: close() alone leaves the accept() blocked on another thread holding the socket,
            # which goes on listening (and accepts a connection) until that accept returns, and the port
            # cannot be bound again meanwhile.
            try:
                listener.shutdown(self._socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            try:
                conn.close()
            except OSError:
                pass

    def _accept(self, listener) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by down()
            try:
                upstream = self._socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                self._threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src, dst) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        self.down()
