"""RayJobHook through Ray's own JobSubmissionClient: every request has a deadline, and a job's log is read
once, as it grows, across a broken connection."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import pytest_asyncio
from aiohttp import web

from airflow_provider_rayllm.hooks.ray_job import RayJobHook
from tests.unit.local_http import silent_server, start_app


def test_a_jobs_api_that_never_answers_ends_the_call_within_its_deadline(monkeypatch):
    """A server that accepts the connection and says nothing: the hook's call ends after its deadline with an
    error naming the address, instead of waiting for ever."""
    with silent_server() as port:
        address = f"http://127.0.0.1:{port}"
        monkeypatch.setenv("AIRFLOW_CONN_RAY_STUCK", json.dumps({"conn_type": "ray", "host": address, "password": "t"}))
        hook = RayJobHook("ray_stuck", request_timeout_s=1.0)
        started = time.monotonic()
        with pytest.raises(Exception) as failure:
            hook.get_job_info("job-1")
    seconds = time.monotonic() - started
    assert seconds < 5, f"the call took {seconds:.1f} s"
    assert address in str(failure.value)


class TailingApi:
    """The log tail route: the first connection breaks after part of the log; the next one sends the whole
    log from its beginning (as Ray's tail does) and closes at the job's end."""

    def __init__(self) -> None:
        self.connections = 0

    async def version(self, request):
        return web.json_response({"version": "4", "ray_version": "2.60.0", "ray_commit": "test"})

    async def tail(self, request):
        self.connections += 1
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        if self.connections == 1:
            await ws.send_str("line a\nline b\nhalf of ")
            await asyncio.sleep(0.05)
            request.transport.close()  # the dashboard went away mid-line
            return ws
        await ws.send_str("line a\nline b\nhalf of line c\n")
        await ws.send_str("line d\n")
        await ws.close()
        return ws


async def _jobs_api(api, conn_id: str, monkeypatch):
    """``api``'s routes (version, the log tail, and the whole log where it has one) on a loopback port, as the
    Airflow connection ``conn_id``; returns the runner to clean up."""
    app = web.Application()
    app.router.add_get("/api/version", api.version)
    app.router.add_get("/api/jobs/{id}/logs/tail", api.tail)
    if hasattr(api, "logs"):
        app.router.add_get("/api/jobs/{id}/logs", api.logs)
    runner, port = await start_app(app)
    conn = {"conn_type": "ray", "host": f"http://127.0.0.1:{port}", "password": "t"}
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(conn))
    return runner


@pytest_asyncio.fixture
async def tailing(monkeypatch):
    api = TailingApi()
    runner = await _jobs_api(api, "ray_tail", monkeypatch)
    monkeypatch.setattr("airflow_provider_rayllm.hooks.ray_job.TAIL_RECONNECT_S", 0.1)
    yield api
    await runner.cleanup()


@pytest.mark.asyncio
async def test_the_log_tail_hands_each_line_over_once_across_a_broken_connection(tailing):
    tail = await RayJobHook("ray_tail").atail_job_logs("job-1")
    lines: list[str] = []
    deadline = time.monotonic() + 10
    while not tail.ended and time.monotonic() < deadline:
        lines += tail.lines()
        await asyncio.sleep(0.02)
    lines += tail.lines()
    tail.stop()
    assert tail.ended
    assert tailing.connections == 2
    assert lines == ["line a", "line b", "half of line c", "line d"]


class EndedJobApi:
    """A job that has ended whose tail has not closed yet (the Jobs API closes it seconds later): the tail
    brought two lines and stays open; the whole log has four."""

    LOG = "line a\nline b\nline c\nline d\n"

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def version(self, request):
        return web.json_response({"version": "4", "ray_version": "2.60.0", "ray_commit": "test"})

    async def logs(self, request):
        return web.json_response({"logs": self.LOG})

    async def tail(self, request):
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_str("line a\nline b\n")
        await self.release.wait()
        await ws.send_str("line c\nline d\n")
        await ws.close()
        return ws


@pytest_asyncio.fixture
async def ended_job(monkeypatch):
    api = EndedJobApi()
    runner = await _jobs_api(api, "ray_ended", monkeypatch)
    yield api
    api.release.set()
    await runner.cleanup()


async def _handed(tail, n: int) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + 10
    while len(lines) < n and time.monotonic() < deadline:
        lines += tail.lines()
        await asyncio.sleep(0.02)
    return lines


@pytest.mark.asyncio
async def test_an_ended_jobs_last_lines_come_from_its_whole_log_without_waiting_for_the_tail(ended_job):
    hook = RayJobHook("ray_ended")
    tail = await hook.atail_job_logs("job-1")
    seen = await _handed(tail, 2)
    started = time.monotonic()
    seen += await asyncio.to_thread(hook.ended_job_lines, tail)
    assert time.monotonic() - started < 2, "read at once, not waited for"
    assert seen == ["line a", "line b", "line c", "line d"], "each line once, in order"
    ended_job.release.set()  # the tail's late lines are not handed over a second time
    await asyncio.sleep(0.3)
    assert tail.lines() == []


@pytest.mark.asyncio
async def test_the_wait_between_polls_ends_when_the_tail_closes(ended_job):
    tail = await RayJobHook("ray_ended").atail_job_logs("job-1")
    await _handed(tail, 2)
    asyncio.get_running_loop().call_later(0.2, ended_job.release.set)
    started = time.monotonic()
    await asyncio.to_thread(tail.sleep, 30)
    assert time.monotonic() - started < 5 and tail.ended
    tail.stop()
