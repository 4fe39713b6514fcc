"""One attempt's output, from its folder to the published prefix, in the steps the driver calls in order:

    Publisher.start (the lease) -> find_saved -> repair_table -> (the stream writes into the generation's
    outputs and errors) -> adopt_saved -> check -> stage_table -> publish -> remove_older

Nothing is published before ``check`` passes. With an output table, ``stage_table`` stages the generation's
rows out of the readers' way, and ``publish`` switches them in with one transaction that commits right after
the manifest is written (see ``sinks.table``): the table and the manifest name the same generation, and
``repair_table`` completes a switch that a crash cut short. ``publish`` lays the output out for plain folder
readers, which skip names that begin with ``_`` or ``.``::

    <prefix>/part-<gen short>-NNNNN.parquet|jsonl   the published rows (nothing else visible)
    <prefix>/_manifest.json                         what is published, written after the files are in place
    <prefix>/_report.html                           the run's report page, made from the manifest's body
    <prefix>/_SUCCESS                               empty, written last
    <prefix>/_errors/part-<gen short>-NNNNN.*       the published error rows
    <prefix>/_generations/<generation>/             attempts in flight, each with its lease

in this order: (1) ``_SUCCESS`` goes; (2) the generation's files move to the top level and to ``_errors/``
under names no other generation's files have (its short id); (3) ``_report.html``, then ``_manifest.json``
naming them and it (inside the output table's switch, which commits right after); (4) data
files that the manifest does not name go (an earlier publish's, or leftovers of a crash); (5) ``_SUCCESS``
is written; then ``remove_older`` removes this generation's emptied folder, this task instance's older
ones and any other task instance's whose lease expired.

A crash before (3) leaves the old manifest with all its files (and maybe this generation's files beside
them, unnamed, with no ``_SUCCESS``); a crash after (3) leaves the new manifest with all its files. Either
way the manifest never names a missing file, and the next publish's step (4) removes what is left over.
Step (4) leaves the files of another task instance's generation whose lease says it is publishing now:
two publishes into one prefix at the same moment leave each other's files until the next one, never a
manifest naming a deleted file. A writer that died while publishing stops renewing its lease, and after
``generations.PUBLISH_GRACE_S`` its files are leftovers like any other.
"""

from __future__ import annotations

import logging
import posixpath
import re
from contextlib import nullcontext
from typing import Any, Callable, ContextManager

from airflow_provider_rayllm.contract import report
from airflow_provider_rayllm.contract.names import ERRORS_DIR, REPORT_NAME, REQUEST_KEY_COLUMN, SUCCESS_MARKER
from airflow_provider_rayllm.contract.spec import JobSpec
from airflow_provider_rayllm.job import filesystems
from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.job.failpoints import failpoint
from airflow_provider_rayllm.job.publish import generations, incremental, manifest, resume
from airflow_provider_rayllm.job.publish.lease import Lease
from airflow_provider_rayllm.job.sinks.files import ERRORS, OUTPUTS

log = logging.getLogger("airflow_provider_rayllm.job")

# A published data file: part-<generation short id>-<number>.<format>.
PART = re.compile(r"^part-(?P<short>[0-9a-f]{10})-\d{5}\.(parquet|jsonl)$")
# The manifest's name before it was hidden: a prefix published then is cleaned by the next publish.
LEGACY_MANIFEST = "manifest.json"


def check_counts(counted: dict[str, Any], written: dict[str, Any], adopted_rows: int) -> None:
    """Every row read is answered, failed or resumed, once; the resumed rows are exactly the saved rows adopted."""
    read, skipped = counted["rows_read"], counted["rows_skipped"]
    answered = written["rows_out"] + written["rows_errored"]
    if read != answered + skipped:
        raise JobError(
            f"row accounting: {read} rows were read but {written['rows_out']} answered + {written['rows_errored']} "
            f"error rows + {skipped} resumed = {answered + skipped}; nothing was published"
        )
    if adopted_rows != skipped:
        raise JobError(
            f"resume: {skipped} row(s) were skipped as saved by an earlier attempt, but its files hold {adopted_rows} "
            f"of them (of {counted['rows_saved']} saved); the saved files changed while the job ran. Clear the task "
            "to compute every row again; nothing was published"
        )


def check_error_fraction(errors: int, rows: int, limit: float, errors_folder: str) -> None:
    if rows and errors / rows > limit:
        raise JobError(
            f"{errors} of {rows} rows failed ({errors / rows:.1%}), above max_error_fraction={limit}; "
            f"nothing was published (error rows are in {errors_folder})"
        )


def published_name(short: str, i: int, uri: str) -> str:
    return f"part-{short}-{i:05d}{posixpath.splitext(uri)[1]}"


class Publisher:
    """This attempt's generation folder (its outputs and errors folders) and the steps that publish it."""

    def __init__(self, spec: JobSpec, generation: generations.Generation, lease: Lease | None = None):
        self.spec, self.generation, self.lease = spec, generation, lease
        self.output_uri = spec.sink.uri
        self.uri = generations.generation_uri(self.output_uri, generation.name)
        # Where the stream writes; ``publish`` moves the files to the published folders.
        self.outputs_folder = filesystems.join(self.uri, OUTPUTS)
        self.errors_folder = filesystems.join(self.uri, ERRORS)
        self.published_errors = filesystems.join(self.output_uri, ERRORS_DIR)
        self.saved: list[str] = []
        self.base: incremental.Base | None = None
        self.adoption = resume.Adoption()
        self.published: dict[str, Any] | None = None

    @classmethod
    def start(cls, spec: JobSpec, submission_id: str = "") -> Publisher:
        """A new generation for this attempt (a folder name no other attempt has), and its lease."""
        generation = generations.start(spec)
        lease = Lease(spec.sink.uri, generation.name, submission_id).start()
        return cls(spec, generation, lease)

    def find_saved(self) -> list[str]:
        """With an id column or incremental: the output files this run's earlier, unpublished attempts saved
        (resume), then those of the incremental base (``incremental.find``)."""
        published = self.published = manifest.read(self.output_uri)
        self.saved = (
            resume.saved_files(self.output_uri, self.generation, (published or {}).get("generation"))
            if self.spec.gated
            else []
        )
        if self.spec.is_incremental:
            self.base = incremental.find(self.spec, published)
            self.saved += self.base.files
        return self.saved

    def adopt_saved(self, reused: Any) -> list[dict[str, Any]]:
        """The saved rows the stream skipped (their (id, request key) pairs, ``reused``), adopted into this
        generation's outputs; the adopted files' entries for the manifest."""
        if self.saved and self.spec.gated:
            self.adoption = resume.adopt(self.saved, self.uri, self.spec.prompt.id_column or REQUEST_KEY_COLUMN, reused)
        return self.adoption.files

    @property
    def adopted_rows(self) -> int:
        return self.adoption.rows

    @property
    def stale_rows(self) -> int:
        """Saved rows of earlier attempts left out: their request changed, or their id left the input."""
        return self.adoption.stale_rows

    def check(self, counted: dict[str, Any], written: dict[str, Any]) -> int:
        """The gates before anything is published: the counts agree, rows came, the error fraction is within
        the limit. The adopted files join ``written`` (in place). Returns the rows read."""
        check_counts(counted, written, self.adopted_rows)
        rows_in = counted["rows_read"]
        if rows_in == 0:
            raise JobError("source: no rows reached the job")
        written["output_files"] = sorted(written["output_files"] + self.adoption.files, key=lambda f: f["uri"])
        written["rows_out"] += self.adopted_rows
        check_error_fraction(written["rows_errored"], rows_in, self.spec.limits.max_error_fraction, self.errors_folder)
        return rows_in

    def repair_table(self) -> list[str]:
        """With an output table: the generation the published manifest names switched in if a crash left it
        staged, and staged generations no manifest names dropped (``publish.table_switch.repair``). Call after
        ``find_saved`` (which reads the manifest). Returns what it did."""
        table = self.spec.sink.table
        if table is None:
            return []
        from airflow_provider_rayllm.job.publish import table_switch

        named = (self.published or {}).get("output_table") or {}
        same = named.get("table") == table.table and named.get("run_key") == table.run_key
        generation = (self.published or {}).get("generation") if same else None
        return table_switch.repair(table.dialect, table.table, table.run_key, generation)

    def stage_table(self, written: dict[str, Any]) -> int | None:
        """The output files into this generation's staging table (the output table's rows untouched until
        ``publish``); the rows staged, None without a table."""
        table = self.spec.sink.table
        if table is None:
            return None
        from airflow_provider_rayllm.job.sinks import table as table_sink

        return table_sink.stage(
            [f["uri"] for f in written["output_files"]], table.dialect, table.table, table.run_key, self.generation.name
        )

    def table_switch(self) -> ContextManager[None]:
        """The output table's switch to this generation, held open around the manifest's write."""
        table = self.spec.sink.table
        if table is None:
            return nullcontext()
        from airflow_provider_rayllm.job.publish import table_switch

        return table_switch.switched(table.dialect, table.table, self.generation.name)

    def build_manifest(
        self,
        *,
        submission_id: str,
        written: dict[str, Any],
        rows_in: int,
        started_at: str,
        wall_time_s: float,
        timeline: dict[str, float | None],
        details: dict[str, Any],
        versions: dict[str, str],
        table_rows: int = 0,
        rows_over_time: list[dict[str, float]] | None = None,
        canary: dict[str, Any] | None = None,
        counted: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The manifest's body for this generation (``counted``: the stream's counts, for the incremental
        section)."""
        return manifest.build(
            spec=self.spec,
            submission_id=submission_id,
            generation=self.generation.name,
            outputs_folder=self.output_uri,
            errors_folder=self.published_errors,
            written=written,
            rows_in=rows_in,
            rows_resumed=self.adopted_rows,
            rows_resume_stale=self.stale_rows,
            started_at=started_at,
            wall_time_s=wall_time_s,
            timeline=timeline,
            details=details,
            versions=versions,
            table_rows=table_rows,
            rows_over_time=rows_over_time or [],
            canary=canary,
            incremental=incremental.section(self.base, self.spec, counted or {}, self.adopted_rows)
            if self.base is not None
            else None,
        )

    def publish(self, written: dict[str, Any], build: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
        """Steps (1) to (5) of the module's docstring; ``build`` makes the manifest's body from ``written``
        once its files are at their published places. Returns the body."""
        self.check_names_free(written)
        self.clear_success()
        self.move_into_place(written)
        body = build(written)
        body["report_uri"] = self.write_report(body)
        with self.table_switch():
            self.write_manifest(body)
            failpoint("after_manifest")
        self.remove_unlisted(body)
        self.mark_success()
        return body

    def _targets(self, files: list[dict[str, Any]], folder: str) -> list[str]:
        return [
            filesystems.join(folder, published_name(self.generation.short, i, f["uri"])) for i, f in enumerate(files)
        ]

    def check_names_free(self, written: dict[str, Any]) -> None:
        """No published name of this generation is taken (a short id shared with another generation)."""
        taken = set(filesystems.list_top(self.output_uri)) | set(filesystems.list_top(self.published_errors))
        mine = self._targets(written["output_files"], self.output_uri)
        mine += self._targets(written["error_files"], self.published_errors)
        clash = sorted(posixpath.basename(t) for t in mine if posixpath.basename(t) in taken)
        if clash:
            raise JobError(
                f"publish: file name(s) {clash[:3]} are already under {self.output_uri}; nothing was published"
            )

    def clear_success(self) -> None:
        """(1) The lease says this generation is publishing; the prefix is no longer marked complete."""
        if self.lease is not None:
            self.lease.begin_publish()
        else:
            generations.write_lease(self.output_uri, self.generation.name, "", publishing=True)
        filesystems.delete_file(filesystems.join(self.output_uri, SUCCESS_MARKER))

    def move_into_place(self, written: dict[str, Any]) -> None:
        """(2) The output files to the top level, the error files to ``_errors/``; ``written`` names them
        at their new places (in place)."""
        for key, folder in (("output_files", self.output_uri), ("error_files", self.published_errors)):
            moved = []
            for f, target in zip(written[key], self._targets(written[key], folder)):
                filesystems.move_file(f["uri"], target)
                moved.append({**f, "uri": target})
            written[key] = moved

    def write_report(self, body: dict[str, Any]) -> str | None:
        """(3, first) The run's report page beside the manifest, made from its body, before the manifest that
        names it; a page that cannot be written is said and left out, never a reason to fail the publish."""
        uri = filesystems.join(self.output_uri, REPORT_NAME)
        try:
            page = report.render({**body, "report_uri": uri})
            filesystems.write_bytes_atomic(uri, page.encode(), content_type="text/html; charset=utf-8")
        except Exception as exc:
            log.warning("the run report %s was not written: %s: %s", uri, type(exc).__name__, exc)
            return None
        return uri

    def write_manifest(self, body: dict[str, Any]) -> None:
        """(3) Publish: the manifest names the files now in place."""
        manifest.publish(self.output_uri, body)

    def remove_unlisted(self, body: dict[str, Any], now: float | None = None) -> list[str]:
        """(4) Data files the manifest does not name go, except those of another task instance's generation
        publishing at this moment. Returns what went."""
        listed = {f["uri"] for f in body["output_files"] + body["error_files"]}
        live = {g.short for g in generations.publishing(self.output_uri, self.generation, now)}
        removed = []
        candidates = [(self.output_uri, n, False) for n in filesystems.list_top(self.output_uri)]
        candidates += [(self.published_errors, n, True) for n in filesystems.list_top(self.published_errors)]
        for folder, name, in_errors in candidates:
            uri = filesystems.join(folder, name)
            part = PART.match(name)
            if uri in listed or (part is not None and part["short"] in live):
                continue
            if part is not None or in_errors or name == LEGACY_MANIFEST:
                filesystems.delete_file(uri)
                removed.append(uri)
            elif not name.startswith(("_", ".")):
                log.warning("%s is not a file of ours; left in place (folder readers will read it)", uri)
        return removed

    def mark_success(self) -> None:
        """(5) The prefix is complete."""
        filesystems.write_bytes_atomic(filesystems.join(self.output_uri, SUCCESS_MARKER), b"")

    def remove_older(self) -> list[str]:
        """After the publish: this generation's emptied folder (its lease stopped first), this task instance's
        older generations and other task instances' whose lease expired. Returns the latter two."""
        if self.lease is not None:
            self.lease.stop()
        filesystems.delete_dir(self.uri)
        return generations.remove_older(self.output_uri, self.generation)
