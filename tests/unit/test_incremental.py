"""Incremental runs without a cluster: which base a task reads, which base rows a run can match, which rows the
gate reuses, and what the manifest counts."""

import json
from collections import Counter

import pytest

from airflow_provider_rayllm.contract.names import REQUEST_KEY_COLUMN
from airflow_provider_rayllm.contract.spec import parse_spec
from airflow_provider_rayllm.job.errors import JobRefused
from airflow_provider_rayllm.job.publish import incremental, resume
from airflow_provider_rayllm.job.requests.ids import IdGate
from airflow_provider_rayllm.job.requests.keys import request_identity
from airflow_provider_rayllm.job.requests.prompts import RequestBuilder
from airflow_provider_rayllm.job.stream import KEPT_INPUT
from airflow_provider_rayllm.operators.batch import incremental_base
from tests.unit.test_request_keys import _saved


def _spec(id_column: str | None = "id", fmt: str = "jsonl", base: str | None = None, **prompt) -> object:
    return parse_spec(
        {
            "kind": "http",
            "source": {"uris": ["/in.jsonl"]},
            "prompt": {"prompt_column": "q", **({"id_column": id_column} if id_column else {}), **prompt},
            "http": {"base_url": "http://127.0.0.1:1/v1", "model": "m"},
            "sink": {"uri": "/out", "format": fmt},
            "incremental": {"enabled": True, "base": base},
        }
    )


def _key(spec, row: dict, keep: tuple[str, ...] = ("id", "q")) -> str:
    builder = RequestBuilder(spec.prompt, spec.task_type, list(keep), "/none", identity=request_identity(spec))
    return builder(row)[KEPT_INPUT][REQUEST_KEY_COLUMN]


@pytest.mark.parametrize(
    "given, pushed, expected",
    [
        # The task's own incremental_from wins...
        ("s3://b/reviews/2026-12-03", "s3://b/reviews/other", ("s3://b/reviews/2026-12-03", "incremental_from")),
        # ...else the prefix its latest earlier successful run pushed...
        (None, "s3://b/out/dag/run1/t", ("s3://b/out/dag/run1/t", "XCom")),
        # ...else (a first run, or the same prefix every day) the output prefix's own published run.
        (None, None, (None, "own output_uri")),
        (None, "s3://b/out/fixed/", (None, "own output_uri")),
        (None, ["s3://b/x"], (None, "own output_uri")),  # not one value: never guessed from
    ],
)
def test_which_base_an_incremental_task_reads(given, pushed, expected):
    base, source = incremental_base(given, pushed, "s3://b/out/fixed")
    assert (base, expected[1] in source) == (expected[0], True), source


@pytest.mark.parametrize(
    "mine, theirs, matched",
    [
        ({"key": "id", "format": "parquet"}, {"key": "id", "format": "parquet"}, True),
        # A base from before incremental existed, keyed by the same id column (checked when its files are read).
        ({"key": "id", "format": "parquet"}, {"key": None, "format": "parquet"}, True),
        ({"key": incremental.WHOLE_ROW, "format": "parquet"}, {"key": None, "format": "parquet"}, False),
        ({"key": "id", "format": "parquet"}, {"key": "review_id", "format": "parquet"}, False),
        ({"key": "id", "format": "parquet"}, {"key": incremental.WHOLE_ROW, "format": "parquet"}, False),
        ({"key": "id", "format": "parquet"}, {"key": "id", "format": "jsonl"}, False),
    ],
)
def test_which_base_layouts_can_be_matched(mine, theirs, matched):
    assert (incremental.mismatch(mine, theirs) is None) == matched


def test_a_changed_preprocess_or_postprocess_changes_every_key():
    row = {"id": 1, "q": "question"}
    plain = _key(_spec(), row)
    post = {"import_path": "tests.unit.helpers:answer_only", "digest": "aaaa"}
    keys = {
        _key(_spec(postprocess=post), row),
        _key(_spec(postprocess={**post, "digest": "bbbb"}), row),
        _key(_spec(postprocess={"import_path": "tests.unit.helpers:other"}), row),
    }
    assert plain not in keys and len(keys) == 3


def test_without_an_id_column_the_whole_row_is_the_key():
    spec = _spec(id_column=None)
    row = {"id": 1, "q": "question"}
    assert _key(spec, row) == _key(spec, dict(row))
    assert _key(spec, row) != _key(spec, {**row, "id": 2}), "a kept column changed: the output row would differ"
    assert _key(spec, row) != _key(_spec(), row), "an id-keyed run's keys are the request's alone"


def _base(tmp_path, spec, rows, name="part-0.jsonl"):
    return _saved(tmp_path, name, [{**r, "response": f"old {r['q']}", REQUEST_KEY_COLUMN: _key(spec, r)} for r in rows])


def test_the_gate_reuses_unchanged_rows_and_counts_the_dropped_ones(tmp_path):
    spec = _spec()
    before = [{"id": i, "q": f"question {i}"} for i in range(6)]
    files = [_base(tmp_path, spec, before)]
    # id 1 and 2 changed, id 5 left, id 6 is new.
    now = [before[0], {"id": 1, "q": "q1 new"}, {"id": 2, "q": "q2 new"}, before[3], before[4], {"id": 6, "q": "new"}]
    gate = IdGate("id", files)
    asked, reused = gate.admit(now[:3], [_key(spec, r) for r in now[:3]])
    asked2, reused2 = gate.admit(now[3:], [_key(spec, r) for r in now[3:]])
    assert [now[i]["id"] for i in asked] + [now[3 + i]["id"] for i in asked2] == [1, 2, 6]
    assert sorted(i for i, _ in reused + reused2) == [0, 3, 4]
    assert gate.unmatched == 1, "id 5 is the one base row no input row claimed"
    adoption = resume.adopt(files, str(tmp_path / "gen"), "id", set(reused + reused2))
    assert adoption.rows == 3 and adoption.stale_rows == 3


def test_without_an_id_column_equal_rows_each_reuse_one_saved_row(tmp_path):
    spec = _spec(id_column=None)
    keep = ("q",)
    same = {"q": "the same question"}
    saved = [same, same, {"q": "gone"}]
    path = _saved(
        tmp_path,
        "part-0.parquet",
        [{**r, "response": "old", REQUEST_KEY_COLUMN: _key(spec, r, keep)} for r in saved],
    )
    gate = IdGate(None, [path])
    now = [same, same, same, {"q": "new"}]
    asked, reused = gate.admit(now, [_key(spec, r, keep) for r in now])
    assert asked == [2, 3], "two saved answers for three equal rows: the third is asked"
    assert len(reused) == 2 and gate.unmatched == 1
    adoption = resume.adopt([path], str(tmp_path / "gen"), REQUEST_KEY_COLUMN, Counter(reused))
    assert adoption.rows == 2 and adoption.stale_rows == 1


def _manifest(tmp_path, prefix: str, **over) -> str:
    folder = tmp_path / prefix
    folder.mkdir(parents=True)
    body = {
        "submission_id": "s",
        "generation": "g",
        "spec_hash": "h",
        "output_uri": str(folder),
        "outputs_folder": str(folder),
        "errors_folder": str(folder / "_errors"),
        "format": "jsonl",
        "output_files": [{"uri": str(folder / "part-a.jsonl"), "rows": 3, "bytes": 10}],
        "error_files": [],
        "rows_in": 3,
        "rows_out": 3,
        "rows_errored": 0,
        "input_tokens": 0,
        "output_tokens": 0,
        "wall_time_s": 1.0,
        "started_at": "",
        "finished_at": "",
        "kind": "http",
        "model": "m",
        "task_type": "generate",
        "versions": {},
        "run": {},
        "incremental": {"key": "id"},
        **over,
    }
    (folder / "_manifest.json").write_text(json.dumps(body))
    return str(folder)


def test_finding_the_base(tmp_path):
    found = incremental.find(_spec(base=_manifest(tmp_path, "day1")), None)
    assert found.files == [str(tmp_path / "day1" / "part-a.jsonl")] and found.rows == 3 and not found.warning
    by_manifest = incremental.find(_spec(base=str(tmp_path / "day1" / "_manifest.json")), None)
    assert by_manifest.files == found.files
    # No published run there: a full run, said.
    first = incremental.find(_spec(base=str(tmp_path / "nothing")), None)
    assert first.uri is None and not first.files and "computing every row" in first.note
    # Another layout: a full run, with a warning that names both.
    other = incremental.find(_spec(base=_manifest(tmp_path, "day2", incremental={"key": "review_id"})), None)
    assert not other.files and "'review_id'" in other.warning and "'id'" in other.warning
    # Without incremental_from, the output prefix's own published manifest (as the publisher read it).
    own = incremental.find(_spec(), json.loads((tmp_path / "day1" / "_manifest.json").read_text()))
    assert own.files == found.files


@pytest.mark.parametrize("content", ["{not json", json.dumps({"rows_out": 3})])
def test_an_unreadable_base_refuses_the_job_naming_the_argument(tmp_path, content):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "_manifest.json").write_text(content)
    with pytest.raises(JobRefused, match=f"incremental_from {str(folder)!r}"):
        incremental.find(_spec(base=str(folder)), None)


def test_incremental_from_needs_incremental():
    with pytest.raises(ValueError, match="incremental_from '/base' needs incremental=True"):
        parse_spec(
            {
                "kind": "http",
                "source": {"uris": ["/in.jsonl"]},
                "prompt": {"prompt_column": "q"},
                "http": {"base_url": "http://127.0.0.1:1/v1", "model": "m"},
                "sink": {"uri": "/out"},
                "incremental": {"enabled": False, "base": "/base"},
            }
        )


def test_the_manifest_counts_reused_computed_and_dropped():
    base = incremental.Base("/day1/_manifest.json", ["/day1/a.jsonl"], 20)
    counted = {"rows_read": 20, "rows_skipped": 17, "rows_unmatched": 1}
    assert incremental.section(base, _spec(), counted, 17) == {
        "base": "/day1/_manifest.json",
        "key": "id",
        "rows_reused": 17,
        "rows_computed": 3,
        "rows_dropped": 1,
    }
    none = incremental.section(incremental.Base(None), _spec(), {"rows_read": 20, "rows_skipped": 0}, 0)
    assert (none["rows_computed"], none["rows_dropped"], none["base"]) == (20, 0, None)
