"""The canary: the first ``canary_rows`` rows answered and judged before the rest of the input is read.

    canary stream: read (limit N) -> note each row's key -> requests -> engine -> write under <generation>/canary
    judge: the canary's rows against the quality gate -> <generation>/_canary.json
    full stream:   read -> drop the rows the canary answered -> requests -> engine -> write

A failing canary stops the job there (``JobRefused``: the same settings would fail again), having spent
only the canary's rows; nothing is published, so the prefix keeps its earlier publish. A passing canary's
files are part of the output: the full stream drops the canary's rows by their key (a hash of the row as
read), one drop per key noted, so the two streams together answer every row once, even rows that repeat.
The keys live in a small actor (``CanaryKeys``), never in the driver; a retried batch gets the answer its
first try got.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from airflow_provider_rayllm.contract.spec import JobSpec, QualityGate
from airflow_provider_rayllm.job import filesystems
from airflow_provider_rayllm.job.errors import JobError, JobRefused
from airflow_provider_rayllm.job.requests.callables import load_callable

CANARY_DIR = "canary"
CANARY_REPORT = "_canary.json"
# Failing rows shown in the task log and kept in the report.
EXAMPLES = 3


def row_key(row: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(row, sort_keys=True, default=str).encode()).hexdigest()


class CanaryKeys:
    """The keys of the rows the canary read (a Ray actor with no CPU of its own), and the full stream's drops."""

    def __init__(self) -> None:
        self.noted: dict[str, list[str]] = {}
        self.left: Counter[str] | None = None
        self.masks: dict[str, list[bool]] = {}

    def note(self, call: str, keys: list[str]) -> None:
        self.noted[call] = keys  # a retried batch replaces its own first try's keys

    def noted_rows(self) -> int:
        return sum(len(k) for k in self.noted.values())

    def drop(self, call: str, keys: list[str]) -> list[bool]:
        """Which of a batch's rows the canary answered; each noted key is used up once."""
        if call in self.masks:
            return self.masks[call]
        if self.left is None:
            self.left = Counter(k for keys in self.noted.values() for k in keys)
        mask = []
        for key in keys:
            found = self.left[key] > 0
            if found:
                self.left[key] -= 1
            mask.append(found)
        self.masks[call] = mask
        return mask

    def dropped(self) -> int:
        return sum(sum(mask) for mask in self.masks.values())


class NoteKeys:
    """Canary stream: note the key of every row read, pass the batch on unchanged."""

    def __init__(self, keys: Any):
        self.keys = keys
        self.calls: dict[str, int] = {}

    def __call__(self, batch: Any) -> Any:
        import ray

        from airflow_provider_rayllm.job.progress import call_key

        ray.get(self.keys.note.remote(call_key(self.calls), [row_key(r) for r in batch.to_pylist()]))
        return batch


class DropCanaryRows:
    """Full stream: leave out the rows the canary already answered."""

    def __init__(self, keys: Any):
        self.keys = keys
        self.calls: dict[str, int] = {}

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa
        import ray

        from airflow_provider_rayllm.job.progress import call_key

        mask = ray.get(self.keys.drop.remote(call_key(self.calls), [row_key(r) for r in batch.to_pylist()]))
        return batch.filter(pa.array([not m for m in mask])) if any(mask) else batch


@dataclass
class Verdict:
    passed: bool
    reasons: list[str]
    figures: dict[str, Any]
    examples: list[dict[str, Any]] = field(default_factory=list)


def _short(value: Any, limit: int = 200) -> Any:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + "..."


def _schema_failure(text: Any, validator: Any) -> str | None:
    """Why an answer is not JSON valid against the schema; None when it is."""
    if not isinstance(text, str):
        return f"the answer is {type(text).__name__}, not JSON text"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON ({exc.msg} at character {exc.pos})"
    error = next(iter(validator.iter_errors(value)), None)
    return None if error is None else f"schema: {error.message}"


def judge(
    gate: QualityGate,
    spec: JobSpec,
    outputs: list[dict[str, Any]],
    errors: list[dict[str, Any]],
    package_dir: str,
) -> Verdict:
    """The canary's output rows and error rows against the gate: each test given, with its figure."""
    column = spec.prompt.output_column
    rows = len(outputs) + len(errors)
    reasons: list[str] = []
    examples: list[dict[str, Any]] = []
    figures: dict[str, Any] = {"rows": rows, "rows_out": len(outputs), "rows_errored": len(errors)}

    error_rate = len(errors) / rows if rows else 0.0
    figures["error_rate"] = round(error_rate, 4)
    if gate.max_error_rate is not None and error_rate > gate.max_error_rate:
        reasons.append(
            f"{len(errors)} of {rows} rows failed ({error_rate:.0%}), above max_error_rate={gate.max_error_rate}"
        )
        examples += [{"row": _short(e), "why": "error row"} for e in errors[:EXAMPLES]]

    answers = [r.get(column) for r in outputs]
    if gate.min_json_schema_pass_rate is not None:
        import jsonschema

        schema = spec.json_schema() or {}
        validator = jsonschema.validators.validator_for(schema)(schema)
        failures = [(r, why) for r, why in ((r, _schema_failure(r.get(column), validator)) for r in outputs) if why]
        rate = (len(outputs) - len(failures)) / len(outputs) if outputs else 0.0
        figures["json_schema_pass_rate"] = round(rate, 4)
        if rate < gate.min_json_schema_pass_rate:
            reasons.append(
                f"{len(outputs) - len(failures)} of {len(outputs)} answers are JSON valid against the schema "
                f"({rate:.0%}), below min_json_schema_pass_rate={gate.min_json_schema_pass_rate}"
            )
            examples += [{"row": _short(r), "why": why} for r, why in failures[:EXAMPLES]]

    if gate.min_mean_output_chars is not None:
        if outputs and column not in outputs[0]:
            raise JobRefused(
                f"quality_gate min_mean_output_chars: the output rows have no column {column!r} (a postprocess "
                "shapes them); judge them with quality_gate check instead"
            )
        lengths = [len(a) if isinstance(a, str) else len(json.dumps(a, default=str)) for a in answers]
        mean = sum(lengths) / len(lengths) if lengths else 0.0
        figures["mean_output_chars"] = round(mean, 2)
        if mean < gate.min_mean_output_chars:
            reasons.append(
                f"answers are {mean:.1f} characters long on average, below min_mean_output_chars={gate.min_mean_output_chars}"
            )
            shortest = sorted(outputs, key=lambda r: len(str(r.get(column) or "")))[:EXAMPLES]
            examples += [{"row": _short(r), "why": "short answer"} for r in shortest]

    if gate.check is not None:
        passed, why = _run_check(gate, outputs, package_dir)
        figures["check"] = {"passed": passed, "reason": why}
        if not passed:
            reasons.append(f"check {gate.check.import_path or gate.check.pickled!r} failed: {why}")
    return Verdict(not reasons, reasons, figures, examples[: EXAMPLES * 2])


def _run_check(gate: QualityGate, outputs: list[dict[str, Any]], package_dir: str) -> tuple[bool, str]:
    assert gate.check is not None
    name = gate.check.import_path or gate.check.pickled
    fn = load_callable(gate.check, package_dir)
    try:
        result = fn(outputs)
    except Exception as exc:  # the user's code: its failure is the gate's verdict, said with its reason
        return False, f"raised {type(exc).__name__}: {exc}"
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool)):
        raise JobRefused(f"quality_gate check {name!r} must return (passed: bool, reason: str), got {result!r}")
    return result[0], str(result[1])


def default_gate(spec: JobSpec) -> QualityGate:
    """Without a quality gate, the canary holds the job's own error limit."""
    return spec.limits.quality_gate or QualityGate(max_error_rate=spec.limits.max_error_fraction)


def read_rows(files: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of the canary's files (a few; the canary is small by its limit)."""
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = []
    for f in files:
        fs, path = filesystems.filesystem_for(f["uri"])
        with fs.open_input_file(path) as handle:
            if f["uri"].endswith(".parquet"):
                rows += pq.read_table(handle).to_pylist()
            else:
                rows += [json.loads(line) for line in handle.read().splitlines() if line.strip()]
    return rows


def report(
    verdict: Verdict, gate: QualityGate, canary_rows: int, written: dict[str, Any], cost: float | None
) -> dict[str, Any]:
    """What ``_canary.json`` holds, and the manifest's ``canary`` key."""
    return {
        "passed": verdict.passed,
        "canary_rows": canary_rows,
        "gate": gate.model_dump(mode="json", exclude_none=True),
        "figures": verdict.figures,
        "reasons": verdict.reasons,
        "examples": verdict.examples,
        "input_tokens": written["input_tokens"],
        "output_tokens": written["output_tokens"],
        "estimated_cost": cost,
        "output_files": written["output_files"],
        "error_files": written["error_files"],
    }


def write_report(generation_uri: str, body: dict[str, Any]) -> str:
    uri = filesystems.join(generation_uri, CANARY_REPORT)
    filesystems.write_text_atomic(uri, json.dumps(body, indent=2, sort_keys=True, default=str))
    return uri


def failure(verdict: Verdict, report_uri: str) -> JobRefused:
    return JobRefused(
        f"canary: {'; '.join(verdict.reasons)}; the job stopped before the rest of the input, nothing was "
        f"published (the canary's rows and examples: {report_uri})"
    )


def check_all_dropped(keys: Any, read: int) -> None:
    """The full stream met every row the canary answered again; else the input changed in between."""
    import ray

    dropped = int(ray.get(keys.dropped.remote()))
    if dropped != read:
        raise JobError(
            f"canary: the full run found {dropped} of the canary's {read} rows again; the input changed between "
            "the two reads. Nothing was published"
        )


@dataclass
class CanaryRun:
    """What the driver needs after the canary: the input left to answer (None when the canary read it all),
    the canary's write results (they join the full stream's) and its report for the manifest."""

    rest: Any
    results: list[dict[str, Any]]
    body: dict[str, Any]
    keys: Any
    read: int


def run(
    spec: JobSpec,
    ds: Any,
    generation_uri: str,
    package_dir: str,
    stream: Callable[[Any, str], list[dict[str, Any]]],
    cost: Callable[[dict[str, Any]], float | None],
    say: Callable[..., None],
) -> CanaryRun:
    """Answer and judge the first ``canary_rows`` rows of ``ds`` (the input before max_rows): ``stream(ds,
    folder)`` runs the plan over ``ds`` into ``folder`` and returns the write results. Raises ``JobRefused``
    when the canary fails; else returns the rest of the input, limited to max_rows with the canary's rows."""
    import ray

    from airflow_provider_rayllm.job.sinks.files import totals
    from airflow_provider_rayllm.job.stream import LIGHT

    limits = spec.limits
    assert limits.canary_rows is not None
    wanted = min(limits.canary_rows, limits.max_rows or limits.canary_rows)
    keys = ray.remote(num_cpus=0)(CanaryKeys).remote()
    sample = ds.limit(wanted).map_batches(NoteKeys(keys), batch_format="pyarrow", zero_copy_batch=True, **LIGHT)
    say("canary: answering the first %d row(s) before the rest of the input", wanted)
    results = stream(sample, filesystems.join(generation_uri, CANARY_DIR))
    read = int(ray.get(keys.noted_rows.remote()))
    written = totals(results)
    gate = default_gate(spec)
    verdict = judge(gate, spec, read_rows(written["output_files"]), read_rows(written["error_files"]), package_dir)
    body = report(verdict, gate, read, written, cost(written))
    for example in verdict.examples:
        say("canary failing row (%s): %s", example["why"], example["row"])
    if not verdict.passed:
        raise failure(verdict, write_report(generation_uri, body))
    say("canary passed: %s", json.dumps(verdict.figures, default=str))
    manifest_body = {k: v for k, v in body.items() if k not in ("output_files", "error_files")}
    if read < wanted or (limits.max_rows is not None and read >= limits.max_rows):
        return CanaryRun(None, results, manifest_body, keys, read)
    rest = ds.map_batches(DropCanaryRows(keys), batch_format="pyarrow", **LIGHT)
    if limits.max_rows is not None:
        rest = rest.limit(limits.max_rows - read)
    return CanaryRun(rest, results, manifest_body, keys, read)
