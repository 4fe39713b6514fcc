"""RayJobTrigger: waits for a Ray job in the triggerer, at no worker cost."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_provider_rayllm.contract.progress import describe_progress, parse_progress
from airflow_provider_rayllm.hooks.ray_job import TERMINAL_STATES, JobLogTail, OutageClock, RayJobHook, lost_message


class RayJobTrigger(BaseTrigger):
    """Poll the Jobs API until the job is terminal; yield exactly one event.

    Event payload: ``status`` (a Ray job status, ``LOST`` when the cluster no longer knows the job,
    or ``ERROR``), ``submission_id``, ``message``. A Jobs API that stops answering is retried until
    ``unreachable_timeout`` seconds pass without an answer. The job's log is followed as it grows (each part
    read once); every ``progress_interval`` seconds its newest progress line (rows done of total, tokens/s)
    goes to the trigger's log, which Airflow shows in the task log.
    """

    def __init__(
        self,
        *,
        submission_id: str,
        ray_conn_id: str = RayJobHook.default_conn_name,
        poll_interval: float = 5.0,
        unreachable_timeout: float = 600.0,
        progress_interval: float = 30.0,
    ) -> None:
        super().__init__()
        self.progress_interval = progress_interval
        self.submission_id = submission_id
        self.ray_conn_id = ray_conn_id
        self.poll_interval = poll_interval
        self.unreachable_timeout = unreachable_timeout

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "submission_id": self.submission_id,
                "ray_conn_id": self.ray_conn_id,
                "poll_interval": self.poll_interval,
                "unreachable_timeout": self.unreachable_timeout,
                "progress_interval": self.progress_interval,
            },
        )

    def _hook(self) -> RayJobHook:
        return RayJobHook(ray_conn_id=self.ray_conn_id)

    def _event(self, status: str, message: str) -> TriggerEvent:
        # Ray's message for a failed job carries the tail of its log; the event is stored by Airflow, so it
        # keeps the first line only (the operator reads the job's own error line from the log itself).
        first_line = (message.strip().splitlines() or [""])[0][:500]
        return TriggerEvent({"status": status, "submission_id": self.submission_id, "message": first_line})

    def _log_progress(self, lines: list[str], shown: dict[str, Any] | None) -> dict[str, Any] | None:
        """The newest progress line among the log's lines since the last look, to the trigger's log."""
        latest = shown
        for line in lines:
            latest = parse_progress(line) or latest
        if latest is not None and latest != shown:
            self.log.info("Ray job %s progress: %s", self.submission_id, describe_progress(latest))
        return latest

    async def _tail(self, hook: RayJobHook) -> JobLogTail | None:
        if self.progress_interval <= 0:
            return None
        try:
            return await hook.atail_job_logs(self.submission_id)
        except Exception as exc:  # logs are a courtesy; the status decides
            self.log.debug("could not follow the job log: %s", exc)
            return None

    async def run(self) -> AsyncIterator[TriggerEvent]:
        hook = self._hook()
        clock = OutageClock(self.submission_id, self.unreachable_timeout)
        shown: dict[str, Any] | None = None
        next_progress = time.monotonic() + self.progress_interval
        tail: JobLogTail | None = None
        try:
            while True:
                try:
                    info = await hook.aget_job_info(self.submission_id)
                    clock.answered()
                except Exception as exc:  # the dashboard may be restarting: keep waiting, within a limit
                    ended = clock.failed(exc)
                    if ended:
                        yield self._event("ERROR", ended)
                        return
                    self.log.warning("Ray Jobs API unreachable (%.0f s): %s; retrying", clock.silent_s, exc)
                    await asyncio.sleep(self.poll_interval)
                    continue
                if info is None:
                    yield self._event("LOST", lost_message(self.submission_id))
                    return
                status = str(info.get("status"))
                if status in TERMINAL_STATES:
                    if tail is not None:  # the last progress the job printed, once its log is complete
                        shown = self._log_progress(await asyncio.to_thread(hook.ended_job_lines, tail), shown)
                    yield self._event(status, str(info.get("message") or ""))
                    return
                if tail is None:
                    tail = await self._tail(hook)
                if tail is not None and time.monotonic() >= next_progress:
                    shown = self._log_progress(tail.lines(), shown)
                    next_progress = time.monotonic() + self.progress_interval
                if tail is not None:  # a tail that closes (the job ended) cuts the wait short
                    await tail.asleep(self.poll_interval)
                else:
                    await asyncio.sleep(self.poll_interval)
        except Exception as exc:
            yield self._event("ERROR", f"{type(exc).__name__}: {exc}")
        finally:
            if tail is not None:
                tail.stop()

    async def on_kill(self) -> None:
        """A user killed the deferred task: stop the Ray job too."""
        await self._hook().astop_job(self.submission_id)
