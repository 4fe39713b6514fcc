"""Generations: each attempt of a task writes into a folder of its own under ``<output>/_generations/``.

A folder's name says whose it is and when it started: ``<task instance key>.<settings key>.<start>-<nonce>``.
The start time (UTC, microseconds) orders the attempts; the nonce makes two attempts that start in the
same microsecond distinct, and a name is checked against storage before it is used. So a rerun on a
fresh cluster (where Ray's job ids start again at ``-g0``) never reuses, and never deletes, the folder
that the published manifest names. After a successful publish, only this task instance's older folders
are removed: another task instance sharing the prefix, or a newer attempt still writing, keeps its own.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timezone

from airflow_provider_rayllm.contract.spec import JobSpec, RunSpec
from airflow_provider_rayllm.job import filesystems

GENERATIONS = "_generations"
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
            start=datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f"),
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


def remove_older(output_uri: str, published: Generation) -> list[str]:
    """After a publish: this task instance's generations older than the published one go."""
    removed = []
    for g in existing(output_uri):
        if g.ti == published.ti and g.start < published.start:
            filesystems.delete_dir(generation_uri(output_uri, g.name))
            removed.append(g.name)
    return removed
