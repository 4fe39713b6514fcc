"""RayJobHook: the Ray Jobs API for the ``ray`` connection, through Ray's own client, for workers and triggers.

Connection fields: host = dashboard URL (http or https), password = Ray auth token, extra =
``verify`` (bool), ``ca_bundle`` (path), ``headers`` (dict), ``output_base`` (default output prefix).
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_rayllm.exceptions import RayLLMError

if TYPE_CHECKING:
    from airflow.sdk import Connection

TERMINAL_STATES = frozenset({"SUCCEEDED", "FAILED", "STOPPED"})
ACTIVE_STATES = frozenset({"PENDING", "RUNNING"})


class RayAuthError(RayLLMError, AirflowFailException):
    """The Jobs API refused our credentials (401/403). Retrying will not help."""


class RayApiError(RayLLMError):
    """The Jobs API answered with an unexpected status."""


@dataclass(frozen=True)
class RayConnSettings:
    """Everything needed to reach a Jobs API; built once from the Airflow connection."""

    address: str
    token: str | None = None
    verify: bool | str = True
    headers: dict[str, str] = field(default_factory=dict)
    output_base: str | None = None

    def request_headers(self) -> dict[str, str]:
        headers = dict(self.headers)
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def dashboard_job_url(self, submission_id: str) -> str:
        return f"{self.address}/#/jobs/{submission_id}"

    @classmethod
    def from_connection(cls, conn: Connection) -> RayConnSettings:
        host = (conn.host or "").strip()
        if not host:
            raise RayLLMError(f"connection {conn.conn_id!r}: host (the Ray dashboard URL) is empty")
        extra = conn.extra_dejson or {}
        if "://" not in host:
            host = f"{'http' if _is_loopback(host) else 'https'}://{host}"
        if conn.port and host.count(":") < 2:
            host = f"{host}:{conn.port}"
        if (
            host.startswith("http://")
            and not _is_loopback(host)
            and not _as_bool(extra.get("allow_insecure_http", False))
        ):
            raise RayLLMError(
                f"connection {conn.conn_id!r}: {host} is plain http to another machine, so the Ray auth token would "
                "cross the network in clear; use https, or set the connection's extra allow_insecure_http=true "
                "where the network between Airflow and Ray is trusted"
            )
        headers = extra.get("headers") or {}
        if isinstance(headers, str):
            try:
                headers = json.loads(headers)
            except json.JSONDecodeError as exc:
                raise RayLLMError(f"connection {conn.conn_id!r}: extra.headers is not a JSON object") from exc
        if not isinstance(headers, dict):
            raise RayLLMError(f"connection {conn.conn_id!r}: extra.headers must be a JSON object")
        verify: bool | str = extra.get("ca_bundle") or _as_bool(extra.get("verify", True))
        return cls(
            address=host.rstrip("/"),
            token=conn.password or None,
            verify=verify,
            headers={str(k): str(v) for k, v in headers.items()},
            output_base=extra.get("output_base") or None,
        )


def _is_loopback(address: str) -> bool:
    import ipaddress
    import urllib.parse

    host = urllib.parse.urlsplit(address if "://" in address else f"//{address}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() not in {"false", "0", "no", "off"}
    return bool(value)


def lost_message(submission_id: str) -> str:
    return f"job lost: the Ray cluster no longer knows {submission_id!r} (was the head restarted?)"


class OutageClock:
    """While waiting for a job: how long the Jobs API has gone without answering.

    ``answered()`` after each answer; ``failed(exc)`` after each error returns None to keep waiting, or
    the message to end the wait with once ``limit_s`` seconds passed without an answer. An auth error
    is never waited out: it is raised at once.
    """

    def __init__(self, submission_id: str, limit_s: float):
        self.submission_id = submission_id
        self.limit_s = limit_s
        self.last_answer = time.monotonic()

    def answered(self) -> None:
        self.last_answer = time.monotonic()

    @property
    def silent_s(self) -> float:
        return time.monotonic() - self.last_answer

    def failed(self, exc: Exception) -> str | None:
        if isinstance(exc, RayAuthError):
            raise exc
        if self.silent_s > self.limit_s:
            return f"the Ray Jobs API did not answer for {self.silent_s:.0f} s while waiting for {self.submission_id!r}: {exc}"
        return None


# Seconds one Jobs API request may take (connect and answer); a cluster that holds a request longer is away.
REQUEST_TIMEOUT_S = 30.0
# Seconds a log tail waits before it reconnects after its connection broke.
TAIL_RECONNECT_S = 2.0
# Seconds an ended job's log tail may take to deliver its last lines, where the whole log cannot be read.
LAST_LINES_WAIT_S = 5.0
# How often a waiting trigger looks whether the job's log tail has closed.
TAIL_LOOK_S = 1.0


def _jobs_client(settings: RayConnSettings, timeout_s: float) -> Any:
    """Ray's JobSubmissionClient for these settings, each of its requests bounded by ``timeout_s``."""
    from ray.job_submission import JobSubmissionClient

    class _Client(JobSubmissionClient):
        def _do_request(self, method: str, endpoint: str, **kwargs: Any) -> Any:
            kwargs.setdefault("timeout", timeout_s)
            return super()._do_request(method, endpoint, **kwargs)

    client = _Client(address=settings.address, headers=settings.request_headers(), verify=settings.verify)
    if not settings.token:
        # The connection is the only source of the token: Ray's client would add this machine's own
        # (~/.ray/auth_token) to a connection that has none.
        headers = getattr(client, "_headers", {})
        for name in [k for k in headers if k.lower() == "authorization"]:
            del headers[name]
    return client


def _auth_error(exc: Exception, address: str) -> RayAuthError | None:
    """Ray's refusal of our token (its AuthenticationError, or a 401/403 status in its message) as ours."""
    message = str(exc)
    if "Authentication failed" in message or "status code 403" in message:
        status, word = 403, "refused"
    elif type(exc).__name__ == "AuthenticationError" or "status code 401" in message or "Unauthorized" in message:
        status, word = 401, "missing or unknown"
    else:
        return None
    said = (message.strip().splitlines() or [""])[0][:200]
    return RayAuthError(
        f"the Ray Jobs API at {address} answered {status}: the auth token is {word}. Set the Ray auth token as "
        f"the password of the `ray` connection. Server said: {said}"
    )


def _as_dict(details: Any) -> dict[str, Any]:
    dump = getattr(details, "model_dump", None)
    return dump(mode="json") if dump else json.loads(details.json())


class JobLogTail:
    """A job's log as it grows, each part read once: Ray's log tail (a websocket the Jobs API closes when the
    job ends) followed in a thread of its own, whole lines handed over by ``lines()``. A broken connection is
    opened again after ``TAIL_RECONNECT_S``; the tail then starts from the log's beginning, and what was
    already read is skipped."""

    def __init__(self, client: Any, submission_id: str) -> None:
        self.client = client
        self.submission_id = submission_id
        self._queue: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._ended = threading.Event()
        self._stop = threading.Event()
        # Lines handed over so far, and whether ``last_lines`` took over: the thread hands over nothing after.
        self._lock = threading.Lock()
        self._handed = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"ray-log-tail-{submission_id}", daemon=True)

    def start(self) -> JobLogTail:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    @property
    def ended(self) -> bool:
        """The Jobs API closed the tail: the job has ended and every line was handed over."""
        return self._ended.is_set()

    def wait_ended(self, timeout_s: float) -> bool:
        return self._ended.wait(timeout_s)

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` between two looks at the job's status, or less: the tail closing means the job
        ended, so the next look comes at once. Once it has closed, the whole interval is slept again."""
        if self._ended.is_set():
            time.sleep(seconds)
        else:
            self._ended.wait(seconds)

    async def asleep(self, seconds: float) -> None:
        """``sleep`` for an event loop that must not block (the triggerer's): the tail's closing is seen within
        ``TAIL_LOOK_S`` (a flag read, no call)."""
        if self._ended.is_set():
            await asyncio.sleep(seconds)
            return
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0 and not self._ended.is_set():
            await asyncio.sleep(min(TAIL_LOOK_S, left))

    def last_lines(self, whole_log: str) -> list[str]:
        """An ended job's lines not yet handed over, from its whole log (``get_job_logs``): the Jobs API closes
        the tail only some seconds after the job ends, and its last lines are in the log already. The tail
        stops here and hands over nothing more."""
        with self._lock:
            self._closed = True
            self._stop.set()
            return self.lines() + whole_log.splitlines()[self._handed :]

    def lines(self) -> list[str]:
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def _run(self) -> None:
        # Ray's client says at INFO that the tail closed, each time a job ends: the task log has its own end.
        logging.getLogger("ray.dashboard.modules.job.sdk").setLevel(logging.WARNING)
        asyncio.run(self._follow())

    def _hand_over(self, text: str) -> bool:
        """Queue ``text``'s lines unless ``last_lines`` took over; False once it has."""
        with self._lock:
            if self._closed:
                return False
            lines = text.splitlines()
            for line in lines:
                self._queue.put(line)
            self._handed += len(lines)
            return True

    async def _follow(self) -> None:
        read = 0  # characters of the log handed over, whole lines only
        while not self._stop.is_set():
            received, pending = 0, ""  # this connection's characters, and the line not yet whole
            try:
                async for chunk in self.client.tail_job_logs(self.submission_id):
                    if self._stop.is_set():
                        return
                    start, received = received, received + len(chunk)
                    if received <= read:
                        continue  # a reconnected tail starts from the beginning
                    pending += chunk[max(0, read - start) :]
                    whole = pending.rfind("\n") + 1
                    if not self._hand_over(pending[:whole]):
                        return
                    read += whole
                    pending = pending[whole:]
                if pending:
                    self._hand_over(pending)
                self._ended.set()
                return
            except Exception:  # the dashboard may be restarting: the status poll decides how long to wait
                await asyncio.sleep(TAIL_RECONNECT_S)


class RayJobHook(BaseHook):
    """Submit, watch, stop and read Ray jobs through Ray's own Jobs API client (``JobSubmissionClient``).

    Every request has a deadline (``request_timeout_s``); the trigger runs the same calls in a thread.
    """

    conn_name_attr = "ray_conn_id"
    default_conn_name = "ray_default"
    conn_type = "ray"
    hook_name = "Ray"

    def __init__(
        self, ray_conn_id: str = default_conn_name, request_timeout_s: float = REQUEST_TIMEOUT_S, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.ray_conn_id = ray_conn_id
        self.request_timeout_s = request_timeout_s

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        return {
            "hidden_fields": ["schema", "login", "port"],
            "relabeling": {"host": "Ray dashboard URL", "password": "Ray auth token"},
        }

    # --- settings -------------------------------------------------------------------------------
    @cached_property
    def settings(self) -> RayConnSettings:
        return RayConnSettings.from_connection(self.get_connection(self.ray_conn_id))

    async def asettings(self) -> RayConnSettings:
        if "settings" not in self.__dict__:
            conn = await self.aget_connection(self.ray_conn_id)
            self.__dict__["settings"] = RayConnSettings.from_connection(conn)
        return self.settings

    # --- the client -----------------------------------------------------------------------------
    @cached_property
    def client(self) -> Any:
        s = self.settings
        try:
            return _jobs_client(s, self.request_timeout_s)
        except Exception as exc:
            refused = _auth_error(exc, s.address)
            if refused:
                raise refused from None
            raise RayLLMError(f"cannot reach the Ray Jobs API at {s.address}: {str(exc)[:300]}") from None

    def get_conn(self) -> Any:
        return self.client

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self.client, method)(*args, **kwargs)
        except RayLLMError:
            raise
        except Exception as exc:
            refused = _auth_error(exc, self.settings.address)
            if refused:
                raise refused from None
            raise

    def submit_job(
        self,
        *,
        entrypoint: str,
        submission_id: str,
        runtime_env: dict[str, Any] | None = None,
        metadata: dict[str, str] | None = None,
        entrypoint_num_cpus: float | None = None,
        entrypoint_memory: int | None = None,
        entrypoint_resources: dict[str, float] | None = None,
    ) -> str:
        return self._call(
            "submit_job",
            entrypoint=entrypoint,
            submission_id=submission_id,
            runtime_env=runtime_env,
            metadata=metadata,
            entrypoint_num_cpus=entrypoint_num_cpus,
            entrypoint_memory=entrypoint_memory,
            entrypoint_resources=entrypoint_resources,
        )

    def get_job_info(self, submission_id: str) -> dict[str, Any] | None:
        """The job's record as a dict, or None when the cluster does not know the id."""
        try:
            return _as_dict(self._call("get_job_info", submission_id))
        except RuntimeError as exc:
            if "status code 404" in str(exc):
                return None
            raise RayApiError(f"the Ray Jobs API answered for {submission_id!r}: {str(exc)[:300]}") from None

    def get_job_status(self, submission_id: str) -> str:
        info = self.get_job_info(submission_id)
        if info is None:
            raise RayLLMError(f"the Ray cluster has no job {submission_id!r}")
        return str(info["status"])

    def stop_job(self, submission_id: str) -> bool:
        return bool(self._call("stop_job", submission_id))

    def get_job_logs(self, submission_id: str) -> str:
        """The whole log, once (a job's end, its error line); a wait follows the log with ``tail_job_logs``."""
        return str(self._call("get_job_logs", submission_id))

    def tail_job_logs(self, submission_id: str) -> JobLogTail:
        """The job's log as it grows, read once, in a thread of its own (started)."""
        return JobLogTail(self.client, submission_id).start()

    def ended_job_lines(self, tail: JobLogTail) -> list[str]:
        """An ended job's lines its tail has not handed over yet, read from its whole log at once rather than
        waited for (the Jobs API closes the tail some seconds after the job ends)."""
        if tail.ended:
            return tail.lines()
        try:
            return tail.last_lines(self.get_job_logs(tail.submission_id))
        except Exception:  # the log is a courtesy: what the tail brings in a short wait
            tail.wait_ended(LAST_LINES_WAIT_S)
            return tail.lines()

    def test_connection(self) -> tuple[bool, str]:
        try:
            version = self.client.get_version()
            self.client.list_jobs()
        except Exception as exc:
            return False, str(exc)
        return True, f"Ray Jobs API {self.settings.address} answered (version {version})"

    # --- the triggerer: the same calls in a thread, never blocking the event loop -----------------
    async def aget_job_info(self, submission_id: str) -> dict[str, Any] | None:
        await self.asettings()
        return await asyncio.to_thread(self.get_job_info, submission_id)

    async def astop_job(self, submission_id: str) -> bool:
        await self.asettings()
        return await asyncio.to_thread(self.stop_job, submission_id)

    async def atail_job_logs(self, submission_id: str) -> JobLogTail:
        await self.asettings()
        return await asyncio.to_thread(self.tail_job_logs, submission_id)
