"""vLLM's cache folder carried through a bucket, so that an engine on a fresh node starts warm.

vLLM keeps what it compiles (torch.compile's graphs, under ``torch_compile_cache/<hash>``) and what it learns
of a model's class (``modelinfos``) in its cache root, ``VLLM_CACHE_ROOT`` (``~/.cache/vllm``). The entries are
named by vLLM's own hash of the model, the engine settings and the versions, so one folder serves many models
and jobs and a stale entry is never read. On a node that keeps its disk, the root is warm for the next job
already: on one H100 a second job reached its engine 0.44x as soon (docs/PERFORMANCE.md). A node that comes
fresh for each job (an autoscaled or KubeRay worker) starts cold every time.

``compile_cache`` (VLLMBatchOperator) names where the cache lives:
- an absolute path (a volume every engine node mounts): vLLM's cache root, used in place;
- an ``s3://`` or ``gs://`` prefix: each engine actor copies the prefix into a node-local root before its engine
  starts (``restore``), and copies back every file its engine wrote or changed (``Saver``: a thread that looks
  every few seconds, and once more when the actor ends). Objects are put whole, so a reader never sees half a
  file; two engines writing the same entry write the same bytes.

Triton's own cache (``~/.triton/cache`` by default) goes inside the root too, so that kernels compiled outside
torch.compile travel with the rest. On one H100 a node given vLLM's root alone (its own caches emptied) reached
its engine 0.54x as soon as a cold one, and still spent 15 s between CUDA graph capture and the kernel JIT
monitor that a fully warm node did not; what those seconds are is not known, and whether Triton's cache inside
the root removes them was not measured (docs/PERFORMANCE.md).

The engine's runtime_env carries the prefix (``ENV``) and the local root; the job's worker set-up hook (run
first in every worker of the job) starts the copying in the processes that carry it: the engine actors only.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import tempfile
import threading
import time
from typing import Any

from airflow_provider_rayllm.contract.names import COMPILE_CACHE_ENV as ENV
from airflow_provider_rayllm.contract.spec import uri_scheme

CACHE_ROOT_ENV = "VLLM_CACHE_ROOT"
TRITON_CACHE_ENV = "TRITON_CACHE_DIR"
BUCKET_SCHEMES = ("s3", "gs", "gcs")
# How often the saver looks for new files, and how long a file must be left unchanged before it is copied
# (vLLM writes an entry in several steps; a file still growing is taken at the next look).
INTERVAL_S = 5.0
QUIET_S = 2.0


def is_bucket(value: str) -> bool:
    return uri_scheme(value) in BUCKET_SCHEMES


def local_root(uri: str) -> str:
    """The node-local cache root for a bucket prefix: one folder per prefix, kept on the node for its next job."""
    digest = hashlib.sha1(uri.rstrip("/").encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), "rayllm-vllm-cache", digest)


def engine_env(value: str) -> dict[str, str]:
    """The engine actors' environment for ``compile_cache``: vLLM's cache root there, and Triton's cache (the
    kernels vLLM's own warm-up compiles outside torch.compile; by default in ``~/.triton/cache``) inside it."""
    root = local_root(value) if is_bucket(value) else value
    env = {CACHE_ROOT_ENV: root, TRITON_CACHE_ENV: os.path.join(root, "triton_cache")}
    if is_bucket(value):
        env[ENV] = value.rstrip("/")
    return env


def restore(uri: str, root: str) -> tuple[int, int, dict[str, int]]:
    """Copy the prefix's files that the local root lacks (or holds at another size); (files, bytes) copied and
    what the prefix holds (path -> size)."""
    from airflow_provider_rayllm.job import filesystems

    fs, base = filesystems.filesystem_for(uri)
    files = copied = 0
    remote = filesystems.files_under(fs, base)
    for name, size in sorted(remote.items()):
        target = os.path.join(root, name)
        if os.path.isfile(target) and os.path.getsize(target) == size:
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        partial = f"{target}.{os.getpid()}.part"
        with fs.open_input_stream(f"{base}/{name}") as src, open(partial, "wb") as dst:
            dst.write(src.read())
        os.replace(partial, target)  # vLLM never reads a half-copied entry
        files, copied = files + 1, copied + size
    return files, copied, remote


def local_files(root: str) -> dict[str, tuple[int, int]]:
    """Files under the local root: path relative to it -> (size, mtime in ns); our own partial copies left out."""
    found: dict[str, tuple[int, int]] = {}
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith(".part"):
                continue
            path = os.path.join(folder, name)
            try:
                stat = os.stat(path)
            except OSError:
                continue
            found[os.path.relpath(path, root)] = (stat.st_size, stat.st_mtime_ns)
    return found


class Saver:
    """Copies the local root's new and changed files to the prefix: every ``interval_s`` from a thread, and
    once more on ``close`` (or at the process's exit)."""

    def __init__(
        self,
        uri: str,
        root: str,
        remote: dict[str, int] | None = None,
        interval_s: float = INTERVAL_S,
        quiet_s: float = QUIET_S,
    ):
        self.uri, self.root, self.interval_s, self.quiet_s = uri, root, interval_s, quiet_s
        # Local files the prefix holds already (at the same size): not copied again.
        self.saved: dict[str, tuple[int, int]] = {
            name: state for name, state in local_files(root).items() if (remote or {}).get(name) == state[0]
        }
        self.files_saved = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="rayllm-compile-cache", daemon=True)
        self._store: tuple[Any, str] | None = None  # the prefix's filesystem, made once at the first copy

    def start(self) -> Saver:
        self._thread.start()
        atexit.register(self.close)
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.save()

    def save(self, everything: bool = False) -> int:
        """Copy the files changed since the last copy and left alone for ``quiet_s`` (``everything``: all
        changed files); the number copied. A failed copy is tried again at the next look."""
        from airflow_provider_rayllm.job import filesystems

        with self._lock:
            now_ns = time.time_ns()
            copied = 0
            for name, state in sorted(local_files(self.root).items()):
                if self.saved.get(name) == state:
                    continue
                if not everything and now_ns - state[1] < self.quiet_s * 1e9:
                    continue
                try:
                    # An object is put whole (no folder markers: the prefix holds the cache's files only).
                    if self._store is None:
                        self._store = filesystems.filesystem_for(self.uri)
                    fs, base = self._store
                    with (
                        open(os.path.join(self.root, name), "rb") as handle,
                        fs.open_output_stream(f"{base}/{name}") as out,
                    ):
                        out.write(handle.read())
                except Exception as exc:  # the cache only speeds a later start; the job goes on without it
                    print(f"rayllm compile cache: could not save {name} to {self.uri}: {exc}", flush=True)
                    continue
                self.saved[name] = state
                copied += 1
            self.files_saved += copied
            return copied

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        copied = self.save(everything=True)
        if copied or self.files_saved:
            print(f"rayllm compile cache: {self.files_saved} file(s) saved to {self.uri}", flush=True)


_SAVER: Saver | None = None


def start_if_asked(environ: Any = os.environ) -> Saver | None:
    """In an engine actor whose runtime_env names a prefix: restore it into the local root, then keep saving
    what the engine writes there. Elsewhere nothing. A prefix that cannot be read is said in the log; the engine
    then starts cold."""
    global _SAVER
    uri = environ.get(ENV)
    root = environ.get(CACHE_ROOT_ENV)
    if not uri or not root or _SAVER is not None:
        return _SAVER
    os.makedirs(root, exist_ok=True)
    began = time.monotonic()
    remote: dict[str, int] = {}
    try:
        files, size, remote = restore(uri, root)
        print(
            f"rayllm compile cache: restored {files} file(s) ({size / 2**20:.1f} MiB) from {uri} into {root} "
            f"in {time.monotonic() - began:.1f} s",
            flush=True,
        )
    except Exception as exc:
        print(f"rayllm compile cache: could not read {uri} ({type(exc).__name__}: {exc}); starting cold", flush=True)
    _SAVER = Saver(uri, root, remote).start()
    return _SAVER
