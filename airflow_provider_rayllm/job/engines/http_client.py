"""Polite, fast calls to an OpenAI-compatible endpoint from inside a Ray actor.

Many requests in flight per actor (aiohttp's pooled connections), a requests-per-second cap,
retries on 408/429/5xx and connection errors that honour Retry-After with jittered exponential
backoff, and a cap on the total time a row may spend waiting. A row that still fails is
returned as an error with its status code and reason; the API key never appears in it.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import random
import time
from dataclasses import dataclass
from typing import Any

from airflow_provider_rayllm.contract.secrets import redact

RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})


class RetryableStatus(Exception):
    def __init__(self, status: int, reason: str, retry_after: float | None):
        super().__init__(f"HTTP {status}: {reason}")
        self.status, self.reason, self.retry_after = status, reason, retry_after


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header: delta-seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return max(0.0, when - (now if now is not None else time.time()))


class RateLimiter:
    """At most ``qps`` request starts per second: consecutive starts are at least ``1/qps`` apart.

    The spacing is measured from when a start actually happened, not from when it was scheduled, so a
    late wake-up (a busy event loop, a slow host) never lets two starts bunch up; None means no cap.
    """

    def __init__(self, qps: float | None):
        self.interval = 1.0 / qps if qps else 0.0
        self.last_start: float | None = None
        self.lock = asyncio.Lock()

    async def wait(self) -> None:
        if not self.interval:
            return
        async with self.lock:
            if self.last_start is not None:
                delay = self.last_start + self.interval - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            self.last_start = time.monotonic()


@dataclass
class CallResult:
    ok: bool
    body: dict[str, Any] | None
    status: int
    error: str
    attempts: int
    seconds: float
    # The answer's JSON text as the server sent it (the body above, parsed from it): passed on as it is, so a
    # row's answer is not written out as JSON a second time.
    text: str = ""


# The largest response body a row may get (an error row above it, for that row only): a chat answer or
# one embedding is kilobytes; a server that streams without end must not fill the caller's memory.
MAX_RESPONSE_BYTES = 16 << 20


class EndpointClient:
    def __init__(
        self,
        url: str,
        api_key: str | None,
        max_in_flight: int,
        qps: float | None,
        max_retries: int,
        max_total_wait_s: float,
        timeout_s: float,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 30.0,
        extra_headers: dict[str, str] | None = None,
        userinfo: str | None = None,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
    ):
        self.url = url
        self.headers = {"Content-Type": "application/json", **(extra_headers or {})}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        elif userinfo:
            import base64

            self.headers["Authorization"] = "Basic " + base64.b64encode(userinfo.encode()).decode("ascii")
        self.semaphore = asyncio.Semaphore(max_in_flight)
        self.limiter = RateLimiter(qps)
        self.max_retries = max_retries
        self.max_total_wait_s = max_total_wait_s
        self.timeout_s = timeout_s
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.max_in_flight = max_in_flight
        self.max_response_bytes = max_response_bytes
        self.session: Any = None

    async def __aenter__(self) -> EndpointClient:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=self.max_in_flight, keepalive_timeout=30)
        self.session = aiohttp.ClientSession(
            connector=connector, headers=self.headers, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
        )
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.session.close()

    def _backoff(self, exc: BaseException, attempt: int) -> float:
        """Retry-After when the server gave one, else full-jitter exponential backoff."""
        hinted = getattr(exc, "retry_after", None)
        if hinted is not None:
            return float(min(hinted + random.uniform(0, 0.1 * max(hinted, 0.1)), self.backoff_max_s))
        ceiling = min(self.backoff_max_s, self.backoff_base_s * 2 ** (attempt - 1))
        return random.uniform(0, ceiling)

    async def _once(self, body: bytes) -> tuple[int, dict[str, Any], str]:
        import aiohttp

        await self.limiter.wait()
        # Redirects are not followed: the key would go with the request to wherever the redirect points.
        async with self.session.post(self.url, data=body, allow_redirects=False) as resp:
            raw = await resp.content.read(self.max_response_bytes + 1)
            if len(raw) > self.max_response_bytes:
                return _row_error(resp.status, f"response body over {self.max_response_bytes} bytes")
            try:
                text = raw.decode(resp.charset or "utf-8")
            except (UnicodeDecodeError, LookupError) as exc:
                return _row_error(resp.status, f"response body is not valid {resp.charset or 'utf-8'}: {exc}")
            if 300 <= resp.status < 400:
                where = resp.headers.get("Location", "?")
                return _row_error(
                    resp.status,
                    f"redirected to {redact(where)}; redirects are not followed (the request carries the API key)",
                )
            if resp.status in RETRY_STATUSES:
                raise RetryableStatus(resp.status, _reason(text), parse_retry_after(resp.headers.get("Retry-After")))
            if resp.status >= 400:
                return _row_error(resp.status, _reason(text))
            try:
                return resp.status, json.loads(text), text
            except json.JSONDecodeError:
                raise aiohttp.ClientPayloadError(f"unparsable response body: {text[:120]!r}") from None

    async def call(self, body: bytes) -> CallResult:
        """One request: ``body`` is the JSON body, encoded (the request step wrote it; it is sent as it is)."""
        # A plain loop, not a retry library: this runs once per row, thousands of times a second.
        import aiohttp

        started = time.monotonic()
        attempts = 0
        async with self.semaphore:
            first = time.monotonic()
            while True:
                attempts += 1
                try:
                    status, answer, text = await self._once(body)
                    break
                except (RetryableStatus, aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                    if attempts > self.max_retries or time.monotonic() - first >= self.max_total_wait_s:
                        reason = getattr(exc, "reason", None) or f"{type(exc).__name__}: {exc}"
                        return CallResult(
                            False,
                            None,
                            getattr(exc, "status", 0),
                            f"gave up after {attempts} attempt(s): {reason}",
                            attempts,
                            time.monotonic() - started,
                        )
                    await asyncio.sleep(self._backoff(exc, attempts))
                except aiohttp.ClientPayloadError as exc:
                    return CallResult(False, None, 200, str(exc), attempts, time.monotonic() - started)
                except aiohttp.ClientError as exc:  # e.g. a malformed answer: this row's error, not the batch's
                    return CallResult(
                        False, None, 0, f"{type(exc).__name__}: {exc}", attempts, time.monotonic() - started
                    )
        if "__error__" in answer:
            return CallResult(False, None, status, answer["__error__"], attempts, time.monotonic() - started)
        return CallResult(True, answer, status, "", attempts, time.monotonic() - started, text)


def _row_error(status: int, message: str) -> tuple[int, dict[str, Any], str]:
    """What ``_once`` returns for an answer that is this row's error, not a retry: no body text to pass on."""
    return status, {"__error__": message}, ""


def _reason(text: str) -> str:
    """The server's error message, short; JSON error bodies are unwrapped."""
    try:
        body = json.loads(text)
        if isinstance(body, dict):
            err = body.get("error", body)
            if isinstance(err, dict):
                return str(err.get("message") or err)[:300]
            return str(err)[:300]
    except (json.JSONDecodeError, TypeError):
        pass
    return text.strip()[:300] or "(empty body)"
