"""One attempt's output, from its folder to the published manifest, in the steps the driver calls in order:

    Publisher.start -> find_saved -> (the stream writes into outputs_folder and errors_folder)
    -> adopt_saved -> check -> commit_table -> write_manifest (last) -> remove_older

Nothing is published before ``check`` passes; the manifest, written after the outputs and the table, is
what makes the generation the published one; only then do this task instance's older generations go.
"""

from __future__ import annotations

from typing import Any

from airflow_provider_rayllm.contract.spec import JobSpec
from airflow_provider_rayllm.job import filesystems
from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.job.publish import generations, manifest, resume
from airflow_provider_rayllm.job.sinks.files import ERRORS, OUTPUTS


def check_counts(counted: dict[str, Any], written: dict[str, Any], adopted_rows: int) -> None:
    """Every row read is answered, failed or resumed, once; resumed rows are exactly the saved ones."""
    read, skipped = counted["rows_read"], counted["rows_skipped"]
    answered = written["rows_out"] + written["rows_errored"]
    if read != answered + skipped:
        raise JobError(
            f"row accounting: {read} rows were read but {written['rows_out']} answered + {written['rows_errored']} "
            f"error rows + {skipped} resumed = {answered + skipped}; nothing was published"
        )
    if skipped != counted["rows_saved"] or adopted_rows != counted["rows_saved"]:
        raise JobError(
            f"resume: the earlier attempt saved {counted['rows_saved']} row(s) ({adopted_rows} in its files), but "
            f"only {skipped} of their ids are in this input; the input changed since, so the saved rows are stale. "
            "Clear the task to compute every row again; nothing was published"
        )


def check_error_fraction(errors: int, rows: int, limit: float, errors_folder: str) -> None:
    if rows and errors / rows > limit:
        raise JobError(
            f"{errors} of {rows} rows failed ({errors / rows:.1%}), above max_error_fraction={limit}; "
            f"nothing was published (error rows are in {errors_folder})"
        )


class Publisher:
    """This attempt's generation folder (its outputs and errors folders) and the steps that publish it."""

    def __init__(self, spec: JobSpec, generation: generations.Generation):
        self.spec, self.generation = spec, generation
        self.output_uri = spec.sink.uri
        self.uri = generations.generation_uri(self.output_uri, generation.name)
        self.outputs_folder = filesystems.join(self.uri, OUTPUTS)
        self.errors_folder = filesystems.join(self.uri, ERRORS)
        self.saved: list[str] = []
        self.adopted: list[dict[str, Any]] = []

    @classmethod
    def start(cls, spec: JobSpec) -> Publisher:
        """A new generation for this attempt (a folder name no other attempt has)."""
        return cls(spec, generations.start(spec))

    def find_saved(self) -> list[str]:
        """With an id column: the output files this run's earlier, unpublished attempts saved (resume)."""
        published = manifest.read(self.output_uri)
        self.saved = (
            resume.saved_files(self.output_uri, self.generation, (published or {}).get("generation"))
            if self.spec.prompt.id_column
            else []
        )
        return self.saved

    def adopt_saved(self) -> list[dict[str, Any]]:
        """The saved files, copied into this generation's outputs; their entries for the manifest."""
        self.adopted = resume.adopt(self.saved, self.uri) if self.saved else []
        return self.adopted

    @property
    def adopted_rows(self) -> int:
        return sum(f["rows"] for f in self.adopted)

    def check(self, counted: dict[str, Any], written: dict[str, Any]) -> int:
        """The gates before anything is published: the counts agree, rows came, the error fraction is within
        the limit. The adopted files join ``written`` (in place). Returns the rows read."""
        check_counts(counted, written, self.adopted_rows)
        rows_in = counted["rows_read"]
        if rows_in == 0:
            raise JobError("source: no rows reached the job")
        written["output_files"] = sorted(written["output_files"] + self.adopted, key=lambda f: f["uri"])
        written["rows_out"] += self.adopted_rows
        check_error_fraction(written["rows_errored"], rows_in, self.spec.limits.max_error_fraction, self.errors_folder)
        return rows_in

    def commit_table(self, written: dict[str, Any]) -> int | None:
        """The output files into the output table, all or nothing; the rows written, None without a table."""
        table = self.spec.sink.table
        if table is None:
            return None
        from airflow_provider_rayllm.job.sinks import table as table_sink

        return table_sink.write(
            [f["uri"] for f in written["output_files"]], table.dialect, table.table, table.run_key, self.generation.name
        )

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
    ) -> dict[str, Any]:
        """The manifest's body for this generation."""
        return manifest.build(
            spec=self.spec,
            submission_id=submission_id,
            generation=self.generation.name,
            outputs_folder=self.outputs_folder,
            errors_folder=self.errors_folder,
            written=written,
            rows_in=rows_in,
            rows_resumed=self.adopted_rows,
            started_at=started_at,
            wall_time_s=wall_time_s,
            timeline=timeline,
            details=details,
            versions=versions,
            table_rows=table_rows,
        )

    def write_manifest(self, body: dict[str, Any]) -> None:
        """Publish: written last, after the outputs and the table."""
        manifest.publish(self.output_uri, body)

    def remove_older(self) -> list[str]:
        """After the publish: this task instance's older generations go."""
        return generations.remove_older(self.output_uri, self.generation)
