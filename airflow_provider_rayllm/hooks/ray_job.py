"""RayJobHook: the Ray Jobs API for the ``ray`` connection, sync for workers and async for triggers.

Connection fields: host = dashboard URL (http or https), password = Ray auth token, extra =
``verify`` (bool), ``ca_bundle`` (path), ``headers`` (dict), ``output_base`` (default output prefix).
"""

from __future__ import annotations

import asyncio
import json
import ssl
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


def _check_auth(status: int, body: str, address: str) -> None:
    if status in (401, 403):
        word = "missing or unknown" if status == 401 else "refused"
        raise RayAuthError(
            f"the Ray Jobs API at {address} answered {status}: the auth token is {word}. Set the Ray auth "
            f"token as the password of the `ray` connection. Server said: {body[:200]}"
        )


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


class RayJobHook(BaseHook):
    """Submit, watch, stop and read Ray jobs through the dashboard's Jobs API."""

    conn_name_attr = "ray_conn_id"
    default_conn_name = "ray_default"
    conn_type = "ray"
    hook_name = "Ray"

    def __init__(self, ray_conn_id: str = default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ray_conn_id = ray_conn_id

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

    # --- sync client (Airflow worker) -----------------------------------------------------------
    @cached_property
    def client(self) -> Any:
        from ray.job_submission import JobSubmissionClient

        s = self.settings
        try:
            return JobSubmissionClient(address=s.address, headers=s.request_headers(), verify=s.verify)
        except Exception as exc:
            message = str(exc)
            if "401" in message or "403" in message or "Unauthorized" in message or "authentication" in message.lower():
                raise RayAuthError(
                    f"the Ray Jobs API at {s.address} refused the connection {self.ray_conn_id!r}: {message[:300]}"
                ) from None
            raise RayLLMError(f"cannot reach the Ray Jobs API at {s.address}: {message[:300]}") from None

    def get_conn(self) -> Any:
        return self.client

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
        return self.client.submit_job(
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
        import requests

        s = self.settings
        resp = requests.get(
            f"{s.address}/api/jobs/{submission_id}", headers=s.request_headers(), verify=s.verify, timeout=30
        )
        _check_auth(resp.status_code, resp.text, s.address)
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise RayApiError(f"GET /api/jobs/{submission_id} answered {resp.status_code}: {resp.text[:300]}")
        return resp.json()

    def get_job_status(self, submission_id: str) -> str:
        info = self.get_job_info(submission_id)
        if info is None:
            raise RayLLMError(f"the Ray cluster has no job {submission_id!r}")
        return str(info["status"])

    def stop_job(self, submission_id: str) -> bool:
        return bool(self.client.stop_job(submission_id))

    def get_job_logs(self, submission_id: str) -> str:
        return str(self.client.get_job_logs(submission_id))

    def test_connection(self) -> tuple[bool, str]:
        try:
            version = self.client.get_version()
            self.client.list_jobs()
        except Exception as exc:
            return False, str(exc)
        return True, f"Ray Jobs API {self.settings.address} answered (version {version})"

    # --- async (triggerer): aiohttp, never blocking the event loop ------------------------------
    def _ssl(self, s: RayConnSettings) -> ssl.SSLContext | bool:
        if isinstance(s.verify, str):
            return ssl.create_default_context(cafile=s.verify)
        return bool(s.verify)

    async def _arequest(self, method: str, path: str, timeout: float = 30.0) -> tuple[int, str]:
        import aiohttp

        s = await self.asettings()
        client_timeout = aiohttp.ClientTimeout(total=timeout)
        async with aiohttp.ClientSession(timeout=client_timeout, headers=s.request_headers()) as session:
            async with session.request(method, f"{s.address}{path}", ssl=self._ssl(s)) as resp:
                body = await resp.text()
                _check_auth(resp.status, body, s.address)
                return resp.status, body

    async def aget_job_info(self, submission_id: str) -> dict[str, Any] | None:
        status, body = await self._arequest("GET", f"/api/jobs/{submission_id}")
        if status == 404:
            return None
        if status != 200:
            raise RayApiError(f"GET /api/jobs/{submission_id} answered {status}: {body[:300]}")
        return json.loads(body)

    async def astop_job(self, submission_id: str) -> bool:
        status, body = await self._arequest("POST", f"/api/jobs/{submission_id}/stop")
        if status == 404:
            return False
        if status != 200:
            raise RayApiError(f"POST /api/jobs/{submission_id}/stop answered {status}: {body[:300]}")
        return bool(json.loads(body).get("stopped"))

    async def aget_job_logs(self, submission_id: str) -> str:
        status, body = await self._arequest("GET", f"/api/jobs/{submission_id}/logs", timeout=60)
        if status != 200:
            return ""
        return str(json.loads(body).get("logs", ""))

    async def await_terminal(self, submission_id: str, poll_interval: float) -> dict[str, Any] | None:
        """Poll until the job is terminal; None if the cluster forgot the job."""
        while True:
            info = await self.aget_job_info(submission_id)
            if info is None or info.get("status") in TERMINAL_STATES:
                return info
            await asyncio.sleep(poll_interval)
