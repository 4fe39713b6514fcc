"""File discovery and formats on the local filesystem (the bucket protocols are integration tests)."""

import pytest

from airflow_provider_rayllm.job import io
from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.spec import FileSource


def touch(path, text="x"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_folder_glob_and_file(tmp_path):
    a = touch(tmp_path / "in" / "date=1" / "a.parquet")
    b = touch(tmp_path / "in" / "date=2" / "b.parquet")
    touch(tmp_path / "in" / "_SUCCESS")
    touch(tmp_path / "in" / ".hidden.parquet")
    assert io.expand_source(FileSource(uris=[str(tmp_path / "in")])) == [str(a), str(b)]
    assert io.expand_source(FileSource(uris=[str(tmp_path / "in" / "*" / "*.parquet")])) == [str(a), str(b)]
    assert io.expand_source(FileSource(uris=[str(a)])) == [str(a)]


def test_missing_inputs_are_named(tmp_path):
    with pytest.raises(JobError, match="does not exist"):
        io.expand_source(FileSource(uris=[str(tmp_path / "nope.jsonl")]))
    with pytest.raises(JobError, match="no file matches"):
        io.expand_source(FileSource(uris=[str(tmp_path / "*.csv")]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(JobError, match="holds no data files"):
        io.expand_source(FileSource(uris=[str(tmp_path / "empty")], format="csv"))


def test_format_from_files_found(tmp_path):
    files = [str(touch(tmp_path / "a.jsonl")), str(touch(tmp_path / "b.jsonl"))]
    assert io.file_format(FileSource(uris=[str(tmp_path)]), files) == "jsonl"
    with pytest.raises(JobError, match="cannot infer one format"):
        io.file_format(FileSource(uris=[str(tmp_path)]), files + [str(touch(tmp_path / "c.csv"))])


def test_manifest_write_is_atomic_and_readable(tmp_path):
    target = str(tmp_path / "out" / "manifest.json")
    io.write_text_atomic(target, '{"a": 1}')
    assert io.read_json(target) == {"a": 1}
    assert not (tmp_path / "out" / "manifest.json.tmp").exists()
    assert io.read_json(str(tmp_path / "missing.json")) is None


def test_stale_generations_are_removed_after_publish(tmp_path):
    from airflow_provider_rayllm.job import manifest

    out = str(tmp_path / "run")
    for sid in ("job-g0", "job-g1"):
        touch(tmp_path / "run" / "_generations" / sid / "outputs" / "part.parquet")
    manifest.remove_stale_generations(out, "job-g1")
    assert io.list_subdirs(str(tmp_path / "run" / "_generations")) == ["job-g1"]
