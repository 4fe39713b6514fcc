"""This job's actors as the GCS actor table records them: when an engine's actor became ready, and how long
the engine actors held their resources.

Ray 2.60's public state API (``list_actors``) carries no start or end time and goes through the dashboard, so
this reads the GCS table itself through ``ray._private.state.actors``, filtered to this job. The table's
``StartTime`` is when the actor's constructor returned: for an engine, the moment it was loaded and ready.
"""

from __future__ import annotations

import time
from typing import Any


def job_actors(class_marker: str) -> list[dict[str, Any]]:
    """This job's actors whose class name contains ``class_marker`` (raises what the GCS call raises)."""
    import ray
    from ray._private import state

    job_id = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
    return [a for a in state.actors(job_id=job_id).values() if class_marker in (a.get("ActorClassName") or "")]


def first_ready_at(actors: list[dict[str, Any]]) -> float | None:
    """When the first of ``actors`` finished its constructor (epoch seconds); None if none has yet."""
    started = [a["StartTime"] for a in actors if a.get("StartTime")]
    return min(started) / 1000 if started else None


def held_seconds(actors: list[dict[str, Any]], requested_at: float) -> float:
    """Seconds ``actors`` held their resources, summed: each from ``requested_at`` (epoch seconds: when the plan
    asked for it; the table's start is only the constructor's end) to its end, or now while it lives."""
    now_ms = time.time() * 1000
    seconds = 0.0
    for actor in actors:
        if actor.get("StartTime"):
            began = min(actor["StartTime"], requested_at * 1000)
            seconds += ((actor.get("EndTime") or now_ms) - began) / 1000
    return round(seconds, 3)
