"""Saved rows for resuming: what is written, what an earlier generation's folder gives back."""

from __future__ import annotations

import numpy as np
import pytest

from airflow_provider_rayllm.job import checkpoint
from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.spec import SpecError, parse_spec


def _stage(tmp_path):
    shape = lambda r: {"id": r["id"], "answer": r["text"].upper(), "tokens": r["tokens"]}  # noqa: E731
    return checkpoint.CheckpointStage(str(tmp_path / "ckpt"), shape, lambda r: bool(r["err"]))


def test_stage_saves_finished_rows_only_and_passes_the_batch_on(tmp_path):
    batch = {
        "id": np.array([1, 2, 3]),
        "text": np.array(["a", "b", "c"]),
        "tokens": np.array([4, 5, 6], dtype=np.int32),
        "err": np.array(["", "too long", ""]),
    }
    out = _stage(tmp_path)(batch)
    assert out is batch
    saved = checkpoint.read_saved([str(tmp_path / "ckpt")], "id")
    assert saved.to_pylist() == [{"id": 1, "answer": "A", "tokens": 4}, {"id": 3, "answer": "C", "tokens": 6}]


def test_a_batch_with_no_finished_row_writes_nothing(tmp_path):
    _stage(tmp_path)({"id": np.array([1]), "text": np.array(["a"]), "tokens": np.array([1]), "err": np.array(["x"])})
    assert not (tmp_path / "ckpt").exists()
    assert checkpoint.read_saved([str(tmp_path / "ckpt")], "id") is None


def test_half_written_files_are_ignored_and_an_id_saved_twice_counts_once(tmp_path):
    folder = tmp_path / "ckpt"
    checkpoint.write_rows(str(folder), [{"id": 1, "answer": "one"}, {"id": 2, "answer": None}])
    checkpoint.write_rows(str(folder), [{"id": 2, "answer": "two"}, {"id": 3, "answer": "three"}])
    (folder / ".tmp-cut.parquet").write_bytes(b"PAR1 half a file")
    saved = checkpoint.read_saved([str(folder)], "id")
    assert sorted(saved.column("id").to_pylist()) == [1, 2, 3]
    assert [p.name for p in folder.iterdir() if p.name.startswith(".tmp")] == [".tmp-cut.parquet"]


def test_saved_rows_without_the_id_column_are_refused(tmp_path):
    checkpoint.write_rows(str(tmp_path / "ckpt"), [{"key": 1}])
    with pytest.raises(JobError, match="'id'"):
        checkpoint.read_saved([str(tmp_path / "ckpt")], "id")


def test_only_earlier_generations_of_the_same_settings_are_resumed(tmp_path):
    gens = tmp_path / "_generations"
    for name in ["rayllm-d-t-abc-g0", "rayllm-d-t-abc-g1", "rayllm-d-t-abc-g3", "rayllm-d-t-xyz-g0", "stray"]:
        (gens / name).mkdir(parents=True)
    assert checkpoint.earlier_generations(str(gens), "rayllm-d-t-abc-g2") == ["rayllm-d-t-abc-g0", "rayllm-d-t-abc-g1"]
    assert checkpoint.earlier_generations(str(gens), "rayllm-d-t-abc-g0") == []
    assert checkpoint.earlier_generations(str(gens / "missing"), "rayllm-d-t-abc-g5") == []


def test_a_published_generation_and_those_before_it_are_not_resumed(tmp_path):
    """A finished run cleared and run again computes its rows again; a crash after that resumes."""
    gens = tmp_path / "_generations"
    for name in ["rayllm-d-t-abc-g0", "rayllm-d-t-abc-g1", "rayllm-d-t-abc-g2"]:
        (gens / name).mkdir(parents=True)
    assert checkpoint.earlier_generations(str(gens), "rayllm-d-t-abc-g2", "rayllm-d-t-abc-g1") == []
    assert checkpoint.earlier_generations(str(gens), "rayllm-d-t-abc-g3", "rayllm-d-t-abc-g1") == ["rayllm-d-t-abc-g2"]
    # A manifest of other settings (another base) does not hide this base's generations.
    assert checkpoint.earlier_generations(str(gens), "rayllm-d-t-abc-g2", "rayllm-d-t-xyz-g7") == ["rayllm-d-t-abc-g0", "rayllm-d-t-abc-g1"]


def _spec(**prompt):
    return {
        "kind": "http",
        "source": {"uris": ["/data/in.jsonl"]},
        "prompt": {"prompt_column": "prompt", **prompt},
        "http": {"base_url": "http://127.0.0.1:1/v1", "model": "m"},
        "sink": {"uri": "/data/out"},
    }


def test_id_column_must_be_a_kept_column_and_is_required_in_the_input():
    import json

    spec = parse_spec(json.dumps(_spec(id_column="id")))
    assert "id" in spec.prompt.required_columns()
    with pytest.raises(SpecError, match="id_column 'id' must be one of keep_columns"):
        parse_spec(json.dumps(_spec(id_column="id", keep_columns=["prompt"])))
