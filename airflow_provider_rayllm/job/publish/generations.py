"""Generations: each attempt of a task writes into a folder of its own under ``<output>/_generations/``.

A folder's name says whose it is and when it started: ``<task instance key>.<settings key>.<start>-<nonce>``.
The start time (UTC, microseconds) orders the attempts; the nonce makes two attempts that start in the
same microsecond distinct, and a name is checked against storage before it is used. So a rerun on a
fresh cluster (where Ray's job ids start again at ``-g0``) never reuses, and never deletes, the folder
that the published manifest names.

Each folder holds a lease, ``_lease.json`` (``{"submission_id", "renewed_at"}``), written when the attempt
starts and renewed while it runs (see ``lease``). After a successful publish, this task instance's older
folders are removed, and another task instance's folder only once its lease is older than ``LEASE_TTL_S``
(or, without a lease, once its start is): a writer of another run id still in flight keeps its folder, a
crashed one's does not stay forever.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from airflow_provider_rayllm.contract.names import GENERATIONS_DIR
from airflow_provider_rayllm.contract.spec import JobSpec, RunSpec
from airflow_provider_rayllm.job import filesystems

GENERATIONS = GENERATIONS_DIR
LEASE_FILE = "_lease.json"
# Another task instance's generation whose lease was not renewed for this long is a crashed writer's.
LEASE_TTL_S = 15 * 60.0
# A generation publishing (moving its files into place) renews its lease as before: one silent for this long
# died while publishing, and the files it moved are leftovers for the next publish to remove.
PUBLISH_GRACE_S = 150.0
_START = "%Y%m%dT%H%M%S%f"
_NAME = re.compile(
    r"^ti(?P<ti>[0-9a-f]{12})\.s(?P<settings>[0-9a-f]{12})\.(?P<start>\d{8}T\d{12})-(?P<nonce>[0-9a-f]{6})$"
)


def task_instance_key(run: RunSpec) -> str:
    """The same for every attempt of one task instance; distinct for distinct ones (an injective map of
    its four parts, hashed, so ``résumé`` and ``rösümé`` are two keys)."""
    return hashlib.sha256(json.dumps([run.dag_id, run.run_id, run.task_id, run.map_index]).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Generation:
    ti: str
    settings: str
    start: str
    nonce: str

    @property
    def name(self) -> str:
        return f"ti{self.ti}.s{self.settings}.{self.start}-{self.nonce}"

    @classmethod
    def parse(cls, name: str) -> Generation | None:
        m = _NAME.match(name)
        return cls(m["ti"], m["settings"], m["start"], m["nonce"]) if m else None

    @property
    def short(self) -> str:
        """A short id for the names of its published files (``part-<short>-NNNNN``)."""
        return short_id(self.name)

    @property
    def started_at(self) -> float:
        """Its start, as a unix time."""
        return datetime.strptime(self.start, _START).replace(tzinfo=timezone.utc).timestamp()


def short_id(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:10]


def generations_uri(output_uri: str) -> str:
    return filesystems.join(output_uri, GENERATIONS)


def generation_uri(output_uri: str, name: str) -> str:
    return filesystems.join(output_uri, GENERATIONS, name)


def existing(output_uri: str) -> list[Generation]:
    """Every generation folder under the prefix (oldest first); other folders are ignored."""
    found = [Generation.parse(name) for name in filesystems.list_subdirs(generations_uri(output_uri))]
    return sorted((g for g in found if g is not None), key=lambda g: (g.start, g.nonce))


def start(spec: JobSpec) -> Generation:
    """A new generation for this attempt: a name no folder under the prefix has."""
    taken = {g.name for g in existing(spec.sink.uri)}
    while True:
        generation = Generation(
            ti=task_instance_key(spec.run),
            settings=spec.content_hash()[:12],
            start=datetime.now(timezone.utc).strftime(_START),
            nonce=secrets.token_hex(3),
        )
        if generation.name not in taken:
            return generation


def unpublished_earlier(output_uri: str, current: Generation, published: str | None) -> list[Generation]:
    """This task instance's earlier attempts with the same settings that nothing published since: the
    ones a resume may take answered rows from. A run that was published and then run again on purpose
    (a cleared task, a second backfill) starts after its published generation, so it finds none."""
    after = ""
    done = Generation.parse(published or "")
    if done is not None and done.ti == current.ti:
        after = done.start
    return [
        g
        for g in existing(output_uri)
        if g.ti == current.ti and g.settings == current.settings and after < g.start < current.start and g != current
    ]


def lease_uri(output_uri: str, name: str) -> str:
    return filesystems.join(generation_uri(output_uri, name), LEASE_FILE)


def write_lease(
    output_uri: str, name: str, submission_id: str, now: float | None = None, publishing: bool = False
) -> None:
    """The lease: who writes the generation and when it last said so; ``publishing`` once its publish began."""
    body = {"submission_id": submission_id, "renewed_at": time.time() if now is None else now}
    if publishing:
        body["publishing"] = True
    filesystems.write_text_atomic(lease_uri(output_uri, name), json.dumps(body))


def read_lease(output_uri: str, g: Generation) -> dict[str, Any] | None:
    try:
        lease = filesystems.read_json(lease_uri(output_uri, g.name))
        float(lease["renewed_at"])  # type: ignore[index]
        return lease
    except Exception:  # no lease, half a lease from another store, a foreign file: as none
        return None


def last_sign_of_life(output_uri: str, g: Generation) -> float:
    """When the generation's writer last renewed its lease; its start when it has none."""
    lease = read_lease(output_uri, g)
    return float(lease["renewed_at"]) if lease is not None else g.started_at


def expired(output_uri: str, g: Generation, now: float | None = None, ttl: float = LEASE_TTL_S) -> bool:
    return (time.time() if now is None else now) - last_sign_of_life(output_uri, g) > ttl


def publishing(output_uri: str, current: Generation, now: float | None = None) -> list[Generation]:
    """Other task instances' generations publishing now (a lease that says so, renewed within
    ``PUBLISH_GRACE_S``): their files at the top level are not yet in the manifest, and must stay."""
    now = time.time() if now is None else now
    found = []
    for g in existing(output_uri):
        if g.ti == current.ti:
            continue  # this task instance's other attempts are superseded by this publish
        lease = read_lease(output_uri, g)
        if lease is not None and lease.get("publishing") and now - float(lease["renewed_at"]) <= PUBLISH_GRACE_S:
            found.append(g)
    return found


def remove_older(output_uri: str, published: Generation, now: float | None = None) -> list[str]:
    """After a publish: this task instance's generations older than the published one, and any other task
    instance's generation whose lease expired."""
    removed = []
    for g in existing(output_uri):
        mine = g.ti == published.ti
        if (mine and g.start < published.start) or (not mine and expired(output_uri, g, now)):
            filesystems.delete_dir(generation_uri(output_uri, g.name))
            removed.append(g.name)
    return removed
