"""The endpoint client against a local HTTP server that misbehaves on purpose."""

import asyncio
import json
import time
from email.utils import formatdate
from types import SimpleNamespace

import pytest
import pytest_asyncio
from aiohttp import web

from airflow_provider_rayllm.contract.spec import HttpProcessorSpec
from airflow_provider_rayllm.job.engines.http import HttpEngine
from airflow_provider_rayllm.job.engines.http_client import EndpointClient, RateLimiter, parse_retry_after
from tests.unit.local_http import start_app


def test_retry_after_seconds_and_dates():
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after("0.5") == 0.5
    now = time.time()
    assert 9 <= parse_retry_after(formatdate(now + 10, usegmt=True), now=now) <= 10
    assert parse_retry_after(formatdate(now - 10, usegmt=True), now=now) == 0.0
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None


def http(**kw):
    return HttpProcessorSpec(base_url="http://127.0.0.1:1/v1", model="m", **kw)


def body(mode: str) -> bytes:
    """A request body as the request step writes it: JSON, encoded."""
    return json.dumps({"mode": mode}).encode()


def payload_for(request, spec):
    """The body the request step writes for an HttpLLMBatchOperator job's callers to send."""
    return HttpEngine.wire_body(SimpleNamespace(http=spec))(request)


def test_payloads_per_endpoint():
    chat = {"messages": [{"role": "user", "content": "hi"}], "sampling_params": {"max_tokens": 5}}
    assert payload_for(chat, http()) == {"model": "m", "messages": chat["messages"], "max_tokens": 5}
    assert payload_for(chat, http(endpoint="completions")) == {"model": "m", "prompt": "hi", "max_tokens": 5}
    assert payload_for({"prompt": "txt"}, http(endpoint="embeddings")) == {"model": "m", "input": "txt"}
    guide = {"payload": {"messages": [], "temperature": 0.0}}
    assert payload_for(guide, http()) == {"model": "m", "messages": [], "temperature": 0.0}
    schema = {"type": "object"}
    structured = {"messages": [], "sampling_params": {"structured_outputs": {"json": json.dumps(schema)}}}
    assert payload_for(structured, http())["response_format"]["json_schema"]["schema"] == schema


def test_qps_is_shared_across_actors():
    assert http(qps=10, concurrency=4).qps_per_actor() == 2.5
    assert http().qps_per_actor() is None


class Faulty:
    """Scripted answers by request body's 'mode'; records when each request arrived."""

    def __init__(self):
        self.arrivals = []
        self.seen = {}
        self.in_flight = self.most_in_flight = 0
        self.redirect_to = ""

    async def handle(self, request):
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return await self._answer(request)
        finally:
            self.in_flight -= 1

    async def _answer(self, request):
        body = await request.json()
        mode = body["mode"]
        self.arrivals.append(time.monotonic())
        self.seen[mode] = self.seen.get(mode, 0) + 1
        n = self.seen[mode]
        if mode == "redirect":
            return web.Response(status=307, headers={"Location": self.redirect_to})
        if mode.startswith("hold"):
            await asyncio.sleep(0.2)
        if request.headers.get("Authorization") != "Bearer k-123":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        if mode == "429-then-ok" and n == 1:
            return web.Response(status=429, headers={"Retry-After": "1"}, text="slow down")
        if mode == "500-twice" and n <= 2:
            return web.Response(status=500, text="oops")
        if mode == "always-500":
            return web.Response(status=503, text="down")
        if mode == "bad-request":
            return web.json_response({"error": {"message": "max_tokens is too large"}}, status=400)
        if mode == "garbage":
            return web.Response(status=200, text="<html>not json</html>")
        if mode == "not-utf8":
            return web.Response(status=200, body=b'{"choices": "\xff\xfe"}', content_type="application/json")
        if mode == "huge":
            return web.Response(status=200, body=b" " * 5000 + b"{}", content_type="application/json")
        if mode == "slow" and n == 1:
            await asyncio.sleep(2)
        return web.json_response(
            {"choices": [{"message": {"content": f"ok {mode}"}}], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
        )


@pytest_asyncio.fixture
async def server():
    faulty = Faulty()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", faulty.handle)
    runner, port = await start_app(app)
    yield faulty, f"http://127.0.0.1:{port}/v1/chat/completions"
    await runner.cleanup()


def client(url, **kw):
    settings = dict(
        api_key="k-123",
        max_in_flight=8,
        qps=None,
        max_retries=3,
        max_total_wait_s=20,
        timeout_s=1.0,
        backoff_base_s=0.05,
    )
    settings.update(kw)
    return EndpointClient(url, **settings)


@pytest.mark.asyncio
async def test_retry_after_is_honoured(server):
    faulty, url = server
    async with client(url) as c:
        started = time.monotonic()
        result = await c.call(body("429-then-ok"))
    assert result.ok and result.attempts == 2
    assert time.monotonic() - started >= 1.0
    assert faulty.arrivals[1] - faulty.arrivals[0] >= 1.0


@pytest.mark.asyncio
async def test_5xx_retried_then_ok_and_timeouts_retried(server):
    _, url = server
    async with client(url) as c:
        assert (await c.call(body("500-twice"))).attempts == 3
        slow = await c.call(body("slow"))
    assert slow.ok and slow.attempts == 2


@pytest.mark.asyncio
async def test_rows_that_still_fail_are_errors_with_status_and_reason(server):
    faulty, url = server
    async with client(url, max_retries=2) as c:
        down = await c.call(body("always-500"))
        bad = await c.call(body("bad-request"))
        garbage = await c.call(body("garbage"))
    assert not down.ok and down.status == 503 and "gave up after 3 attempt(s)" in down.error
    assert (
        not bad.ok and bad.status == 400 and bad.error == "max_tokens is too large" and faulty.seen["bad-request"] == 1
    )
    assert not garbage.ok and "unparsable response body" in garbage.error
    for result in (down, bad, garbage):
        assert "k-123" not in result.error


@pytest.mark.asyncio
async def test_total_wait_is_capped(server):
    _, url = server
    async with client(url, max_retries=50, max_total_wait_s=0.5) as c:
        started = time.monotonic()
        result = await c.call(body("always-500"))
    assert not result.ok and time.monotonic() - started < 3


@pytest.mark.asyncio
async def test_requests_run_concurrently_within_in_flight_bound(server):
    faulty, url = server
    async with client(url, max_in_flight=4) as c:
        results = await asyncio.gather(*(c.call(body(f"hold{i}")) for i in range(12)))
    assert all(r.ok for r in results)
    assert faulty.most_in_flight == 4, "as many at once as allowed, never more"


@pytest.mark.asyncio
async def test_a_redirect_is_not_followed_so_the_key_stays_with_its_host(server):
    faulty, url = server
    thief = Faulty()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", thief.handle)
    runner, port = await start_app(app)
    try:
        faulty.redirect_to = f"http://127.0.0.1:{port}/v1/chat/completions"
        async with client(url) as c:
            result = await c.call(body("redirect"))
    finally:
        await runner.cleanup()
    assert not result.ok and result.status == 307 and "redirects are not followed" in result.error
    assert thief.seen == {}, "the other host received nothing (and so no key)"


@pytest.mark.asyncio
async def test_rate_limiter_spaces_request_starts():
    limiter = RateLimiter(qps=20)
    started = time.monotonic()
    await asyncio.gather(*(limiter.wait() for _ in range(11)))
    assert time.monotonic() - started >= 0.45


@pytest.mark.asyncio
async def test_rate_limiter_keeps_the_gap_even_when_the_loop_wakes_late():
    limiter = RateLimiter(qps=10)
    starts = []

    async def one():
        await limiter.wait()
        starts.append(time.monotonic())
        time.sleep(0.15)  # hog the loop: the next waiter wakes late

    await asyncio.gather(*(one() for _ in range(6)))
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert min(gaps) >= 0.099, gaps


@pytest.mark.asyncio
async def test_a_body_over_the_cap_or_not_utf8_is_an_error_row_for_that_row_only(server):
    """Each of them is the row's error; the rows beside them in the same batch are answered."""
    from tests.integration.helpers import record_figure

    _, url = server
    started = time.monotonic()
    async with client(url, max_response_bytes=4096) as c:
        results = await asyncio.gather(c.call(body("huge")), c.call(body("not-utf8")), c.call(body("fine")))
    seconds = time.monotonic() - started
    huge, not_utf8, fine = results
    assert not huge.ok and "response body over 4096 bytes" in huge.error
    assert not not_utf8.ok and "not valid utf-8" in not_utf8.error
    assert fine.ok and fine.body["choices"][0]["message"]["content"] == "ok fine"
    record_figure(
        "http_response_bounds",
        rows=len(results),
        answered=sum(r.ok for r in results),
        error_rows=sum(not r.ok and bool(r.error) for r in results),
        seconds=round(seconds, 2),
    )
