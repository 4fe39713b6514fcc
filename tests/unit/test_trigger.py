"""RayJobTrigger against a small HTTP server that speaks the Jobs API routes Ray's own client uses."""

import asyncio
import json

import pytest
import pytest_asyncio
import structlog.testing
from aiohttp import web

from airflow_provider_rayllm.triggers.ray_job import RayJobTrigger
from tests.unit.local_http import start_app


class JobsApi:
    """The Jobs API routes Ray's JobSubmissionClient calls: its version check, GET /api/jobs/{id} from a
    script of (status_code, job_status) steps, the stop route, and the log tail (a websocket that sends the
    log as it grows and closes once the job has ended)."""

    def __init__(self, steps, logs=()):
        self.steps = list(steps)
        self.calls = 0
        self.stopped = []
        self.ended = False
        self.logs = list(logs)  # the whole job log as it reads after each status call (each extends the last)

    async def version(self, request):
        return web.json_response({"version": "4", "ray_version": "2.60.0", "ray_commit": "test"})

    async def get(self, request):
        self.calls += 1
        if request.headers.get("Authorization") != "Bearer secret-token":
            return web.Response(status=401, text="Unauthorized: Missing authentication token")
        code, status = self.steps.pop(0) if len(self.steps) > 1 else self.steps[0]
        if code != 200:
            return web.Response(status=code, text="nope")
        self.ended = status in ("SUCCEEDED", "FAILED", "STOPPED")
        return web.json_response(
            {
                "type": "SUBMISSION",
                "entrypoint": "python -m airflow_provider_rayllm.job spec.json",
                "status": status,
                "message": f"job is {status}",
                "submission_id": request.match_info["id"],
            }
        )

    async def tail(self, request):
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        sent = ""
        while not self.ended:
            now = self.logs[min(self.calls, len(self.logs)) - 1] if self.logs and self.calls else ""
            assert now.startswith(sent), "a log only grows"
            if len(now) > len(sent):
                await ws.send_str(now[len(sent) :])
                sent = now
            await asyncio.sleep(0.002)
        await ws.close()
        return ws

    async def stop(self, request):
        self.stopped.append(request.match_info["id"])
        return web.json_response({"stopped": True})


@pytest_asyncio.fixture
async def serve(monkeypatch):
    runners = []

    async def start(api, token="secret-token"):
        app = web.Application()
        app.router.add_get("/api/version", api.version)
        app.router.add_get("/api/jobs/{id}", api.get)
        app.router.add_get("/api/jobs/{id}/logs/tail", api.tail)
        app.router.add_post("/api/jobs/{id}/stop", api.stop)
        runner, port = await start_app(app)
        conn = {"conn_type": "ray", "host": f"http://127.0.0.1:{port}", "password": token}
        monkeypatch.setenv("AIRFLOW_CONN_RAY_TEST", json.dumps(conn))
        runners.append(runner)
        return port

    yield start
    for runner in runners:
        await runner.cleanup()


async def collect(trigger):
    return [event async for event in trigger.run()]


def trigger(**kw):
    return RayJobTrigger(submission_id="job-1", ray_conn_id="ray_test", poll_interval=0.01, **kw)


def test_serialize_round_trip():
    t = trigger()
    path, kwargs = t.serialize()
    assert path == "airflow_provider_rayllm.triggers.ray_job.RayJobTrigger"
    assert RayJobTrigger(**kwargs).serialize() == (path, kwargs)


@pytest.mark.asyncio
async def test_waits_until_terminal_and_yields_one_event(serve):
    api = JobsApi([(200, "PENDING"), (200, "RUNNING"), (200, "RUNNING"), (200, "SUCCEEDED")])
    await serve(api)
    events = await collect(trigger())
    assert [e.payload for e in events] == [
        {"status": "SUCCEEDED", "submission_id": "job-1", "message": "job is SUCCEEDED"}
    ]
    assert api.calls == 4


@pytest.mark.asyncio
async def test_failed_job_carries_ray_message(serve):
    await serve(JobsApi([(200, "RUNNING"), (200, "FAILED")]))
    (event,) = await collect(trigger())
    assert event.payload["status"] == "FAILED" and event.payload["message"] == "job is FAILED"


@pytest.mark.asyncio
async def test_unknown_job_is_lost(serve):
    await serve(JobsApi([(404, None)]))
    (event,) = await collect(trigger())
    assert event.payload["status"] == "LOST"
    assert "job lost" in event.payload["message"]


@pytest.mark.asyncio
async def test_wrong_token_fails_fast_without_retry_loop(serve):
    api = JobsApi([(200, "RUNNING")])
    await serve(api, token="wrong")
    (event,) = await collect(trigger())
    assert event.payload["status"] == "ERROR"
    assert "401" in event.payload["message"] and "auth token" in event.payload["message"]
    assert api.calls == 1


@pytest.mark.asyncio
async def test_outage_shorter_than_limit_is_waited_out(serve):
    api = JobsApi([(503, None), (502, None), (200, "RUNNING"), (200, "SUCCEEDED")])
    await serve(api)
    (event,) = await collect(trigger(unreachable_timeout=30))
    assert event.payload["status"] == "SUCCEEDED"


@pytest.mark.asyncio
async def test_outage_longer_than_limit_is_an_error(serve):
    await serve(JobsApi([(503, None)]))
    (event,) = await collect(trigger(unreachable_timeout=0.05))
    assert event.payload["status"] == "ERROR"
    assert "did not answer" in event.payload["message"]


@pytest.mark.asyncio
async def test_on_kill_stops_the_job(serve):
    api = JobsApi([(200, "RUNNING")])
    await serve(api)
    await trigger().on_kill()
    assert api.stopped == ["job-1"]


def _progress(done, total, tokens):
    body = {
        "rows_done": done,
        "rows_total": total,
        "rows_errored": 0,
        "tokens_out": tokens,
        "elapsed_s": 3.0,
        "tokens_per_s": 40.0,
    }
    return "RAYLLM_PROGRESS " + json.dumps(body)


@pytest.mark.asyncio
async def test_progress_lines_of_the_job_log_reach_the_trigger_log_once_each(serve):
    noise = "(MapWorker pid=1) INFO engine things"
    logs = [
        f"{noise}\n",
        f"{noise}\n{_progress(2, 8, 64)}\n",
        f"{noise}\n{_progress(2, 8, 64)}\n",
        f"{noise}\n{_progress(2, 8, 64)}\n{_progress(6, 8, 192)}\n",
    ]
    api = JobsApi([(200, "RUNNING")] * 4 + [(200, "SUCCEEDED")], logs=logs)
    await serve(api)
    with structlog.testing.capture_logs() as records:
        (event,) = await collect(trigger(progress_interval=0.001))
    assert event.payload["status"] == "SUCCEEDED"
    shown = [r["event"] for r in records if "progress:" in r["event"]]
    assert shown == [
        "Ray job job-1 progress: 2/8 rows done (25% of the rows read so far), 0 error row(s), 64 tokens out, 40.0 tokens/s, 0 file(s) written, 3 s",
        "Ray job job-1 progress: 6/8 rows done (75% of the rows read so far), 0 error row(s), 192 tokens out, 40.0 tokens/s, 0 file(s) written, 3 s",
    ]


class EndsOnItsOwn(JobsApi):
    """A job that ends 0.3 s after the first look, whatever the trigger does: the log tail closes then, as
    Ray's does once a job has ended, and the status says SUCCEEDED from then on."""

    def __init__(self):
        super().__init__([(200, "RUNNING")], logs=["working\n"])
        self.ends_at = None

    async def get(self, request):
        loop = asyncio.get_running_loop()
        if self.ends_at is None:
            self.ends_at = loop.time() + 0.3
        self.steps = [(200, "SUCCEEDED" if loop.time() >= self.ends_at else "RUNNING")]
        return await super().get(request)

    async def tail(self, request):
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_str("working\n")
        while self.ends_at is None or asyncio.get_running_loop().time() < self.ends_at:
            await asyncio.sleep(0.01)
        await ws.close()
        return ws


@pytest.mark.asyncio
async def test_a_job_that_ends_is_seen_when_its_log_tail_closes_not_a_poll_interval_later(serve):
    api = EndsOnItsOwn()
    await serve(api)
    started = asyncio.get_running_loop().time()
    (event,) = await collect(RayJobTrigger(submission_id="job-1", ray_conn_id="ray_test", poll_interval=30))
    assert event.payload["status"] == "SUCCEEDED"
    assert asyncio.get_running_loop().time() - started < 10, "seen within seconds, not after the 30 s interval"
