"""Incremental runs: the base run whose answers this run reuses for rows whose request is unchanged.

The base is the run the spec names (``incremental.base``: an output prefix or its ``_manifest.json``, which the
operator resolved from ``incremental_from`` or from the task's previous run) or, without one, the run this
output prefix last published. Its published output files are read as saved files, exactly as an earlier
attempt's are on resume (``resume``, ``requests.ids.IdGate``): a row whose (id, request key) a base row holds
is skipped and that row adopted into the new output; every other row is computed; base rows no input row
claims are dropped.

What a base can be, and what happens:
- none found (a first run, a prefix removed since): every row is computed, and the log says so;
- a manifest that cannot be read, or is not a manifest: the job is refused, naming ``incremental_from`` and the
  URI (recomputing a whole table silently would cost what incremental runs are for);
- a manifest of another layout (another id column or key kind, another output format): every row is computed,
  with a warning naming the two layouts, as after a changed prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from airflow_provider_rayllm.contract.manifest import Manifest
from airflow_provider_rayllm.contract.names import MANIFEST_NAME
from airflow_provider_rayllm.contract.spec import JobSpec
from airflow_provider_rayllm.job import filesystems
from airflow_provider_rayllm.job.errors import JobRefused

# The manifest's note of how its rows are keyed, when the run had no id column.
WHOLE_ROW = "(whole row)"


def base_manifest_uri(base: str) -> str:
    """A base given as an output prefix or as its manifest's URI -> the manifest's URI."""
    return base if base.endswith(".json") else filesystems.join(base, MANIFEST_NAME)


def layout(spec: JobSpec) -> dict[str, Any]:
    """What a base's rows must share with this run's to be matched: how a row is keyed, and the file format."""
    return {"key": spec.prompt.id_column or WHOLE_ROW, "format": spec.sink.format}


def base_layout(body: dict[str, Any]) -> dict[str, Any]:
    """A base manifest's layout; a run made without ``incremental`` keyed its rows by id_column only, which its
    manifest does not name (the id column's presence in its files is checked when they are read)."""
    section = body.get("incremental") or {}
    return {"key": section.get("key"), "format": body.get("format")}


def mismatch(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """Why a base's rows cannot be matched with this run's, or None when they can."""
    if theirs["format"] != mine["format"]:
        return f"its output_format is {theirs['format']!r}, this run's {mine['format']!r}"
    if theirs["key"] is None:
        if mine["key"] == WHOLE_ROW:
            return "it was not an incremental run, and this run has no id_column to match its rows by"
        return None
    if theirs["key"] != mine["key"]:
        return f"its rows are keyed by {theirs['key']!r}, this run's by {mine['key']!r}"
    return None


@dataclass
class Base:
    """The base run found: its manifest's URI (None when there was none), its output files to read as saved,
    and what the log should say about it."""

    uri: str | None
    files: list[str] = field(default_factory=list)
    rows: int = 0
    note: str = ""
    warning: str = ""


def find(spec: JobSpec, published: dict[str, Any] | None) -> Base:
    """The base of an incremental run (``published``: this output prefix's manifest, already read)."""
    assert spec.incremental is not None
    given = spec.incremental.base
    if given is None:
        uri, body, where = filesystems.join(spec.sink.uri, MANIFEST_NAME), published, "output_uri"
    else:
        uri, where = base_manifest_uri(given), "incremental_from"
        try:
            body = filesystems.read_json(uri)
        except Exception as exc:
            raise JobRefused(
                f"incremental_from {given!r}: the base manifest {uri} could not be read ({type(exc).__name__}: "
                f"{exc}); give the output prefix (or _manifest.json) of a published run of this task"
            ) from None
    if body is None:
        return Base(None, note=f"incremental: no published run at {uri} ({where}); computing every row")
    try:
        manifest = Manifest.model_validate(body)
    except Exception as exc:
        raise JobRefused(
            f"{where} {given or spec.sink.uri!r}: {uri} is not a manifest of this package ({str(exc).splitlines()[0]})"
        ) from None
    wrong = mismatch(layout(spec), base_layout(body))
    if wrong is not None:
        return Base(
            None, warning=f"incremental: the base {uri} cannot be matched with this run ({wrong}); computing every row"
        )
    files = [f.uri for f in manifest.output_files]
    rows = sum(f.rows for f in manifest.output_files)
    return Base(
        uri,
        files,
        rows,
        note=f"incremental: base {uri} (generation {manifest.generation}, {rows} rows in {len(files)} file(s))",
    )


def section(base: Base, spec: JobSpec, counted: dict[str, Any], reused: int) -> dict[str, Any]:
    """The manifest's ``incremental`` section: the base used, how rows are keyed, and the rows reused (adopted
    from the base or an earlier attempt), computed (sent to the engine) and dropped (base rows whose id left
    the input; without id_column, base rows no input row matched)."""
    return {
        "base": base.uri,
        "key": layout(spec)["key"],
        "rows_reused": reused,
        "rows_computed": counted["rows_read"] - counted["rows_skipped"],
        "rows_dropped": counted.get("rows_unmatched", 0) if base.uri else 0,
    }
