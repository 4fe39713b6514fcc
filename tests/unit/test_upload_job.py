"""The upload job's logic on the local filesystem (the bucket protocols are integration tests)."""

import json

import pytest

from airflow_provider_rayllm.contract.spec import SpecError, UploadJobSpec, parse_spec
from airflow_provider_rayllm.job import upload
from airflow_provider_rayllm.job.errors import JobError


def model(tmp_path, name="m", weights=b"w" * 1000):
    folder = tmp_path / name
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text('{"a": 1}')
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "sub" / "tokenizer.json").write_text("{}")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "lock").write_text("x")
    return folder


def spec(source, dest, **kw):
    return UploadJobSpec(model_source=str(source), bucket_uri=str(dest), **kw)


def test_fresh_skip_changed(tmp_path):
    src, dest = model(tmp_path), tmp_path / "bucket" / "m"
    first = upload.run(spec(src, dest), "s1")
    assert [f["path"] for f in first["files"]] == ["config.json", "model.safetensors", "sub/tokenizer.json"]
    assert first["uploaded_files"] == 3 and not first["skipped"]
    assert (dest / "model.safetensors").read_bytes() == b"w" * 1000
    assert json.loads((dest / upload.MODEL_MANIFEST).read_text())["checksum"] == first["checksum"]
    assert upload.run(spec(src, dest), "s2")["skipped"] is True
    (src / "config.json").write_text('{"a": 2}')
    changed = upload.run(spec(src, dest), "s3")
    assert changed["uploaded_files"] == 1 and changed["checksum"] != first["checksum"]


def test_corrupted_destination_is_repaired_and_never_skipped(tmp_path):
    src, dest = model(tmp_path), tmp_path / "bucket" / "m"
    upload.run(spec(src, dest), "s1")
    (dest / "model.safetensors").write_bytes(b"x" * 1000)  # same size, other bytes
    repaired = upload.run(spec(src, dest), "s2")
    assert repaired["skipped"] is False and (dest / "model.safetensors").read_bytes() == b"w" * 1000


def test_another_model_is_refused_unless_overwrite(tmp_path):
    dest = tmp_path / "bucket" / "m"
    upload.run(spec(model(tmp_path, "a"), dest), "s1")
    with pytest.raises(JobError, match="holds another model"):
        upload.run(spec(model(tmp_path, "b", b"v" * 10), dest), "s2")
    assert upload.run(spec(model(tmp_path, "c", b"v" * 10), dest, overwrite=True), "s3")["uploaded_files"] >= 1


def test_patterns_and_verification(tmp_path):
    src, dest = model(tmp_path), tmp_path / "bucket" / "m"
    only = upload.run(spec(src, dest, allow_patterns=["*.json"], ignore_patterns=["sub/*"]), "s1")
    assert [f["path"] for f in only["files"]] == ["config.json"]
    with pytest.raises(JobError, match="no files to upload"):
        upload.run(spec(src, tmp_path / "b2", allow_patterns=["*.bin"]), "s2")
    files = upload.source_files(str(src), spec(src, dest))
    assert upload.verify(__import__("pyarrow.fs").fs.LocalFileSystem(), str(tmp_path / "empty"), files) == [
        "config.json: missing",
        "model.safetensors: missing",
        "sub/tokenizer.json: missing",
    ]


def test_upload_spec_is_checked():
    with pytest.raises(SpecError, match="bucket_uri 'ftp://x'"):
        parse_spec({"kind": "upload", "model_source": "m", "bucket_uri": "ftp://x"})
    assert isinstance(parse_spec({"kind": "upload", "model_source": "m", "bucket_uri": "s3://b/m/"}), UploadJobSpec)


def listed(dest):
    return sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())


def test_an_overwrite_leaves_no_file_of_the_old_model(tmp_path):
    dest = tmp_path / "bucket" / "m"
    upload.run(spec(model(tmp_path, "a"), dest), "s1")
    new = model(tmp_path, "b", b"v" * 10)
    (new / "sub" / "tokenizer.json").unlink()
    (new / "merges.txt").write_text("a b")
    old_files = listed(dest)
    replaced = upload.run(spec(new, dest, overwrite=True), "s2")
    assert replaced["removed_files"] == ["sub/tokenizer.json"]
    assert listed(dest) == sorted([f["path"] for f in replaced["files"]] + [upload.MODEL_MANIFEST])
    from tests.integration.helpers import record_figure

    new_files = {f["path"] for f in replaced["files"]} | {upload.MODEL_MANIFEST}
    record_figure(
        "model_overwrite",
        old_model_files=len(old_files),
        new_model_files=len(new_files),
        files_under_the_prefix=len(listed(dest)),
        old_files_left=len([f for f in listed(dest) if f in old_files and f not in new_files]),
        unverified_files=len(upload.verify(*upload.filesystems.filesystem_for(str(dest)), replaced["files"])),
    )


def test_a_stray_file_under_the_model_is_removed_not_skipped_over(tmp_path):
    src, dest = model(tmp_path), tmp_path / "bucket" / "m"
    first = upload.run(spec(src, dest), "s1")
    (dest / "stray.bin").write_bytes(b"s")
    assert upload.verify(*upload.filesystems.filesystem_for(str(dest)), first["files"]) == [
        "stray.bin: not part of this model"
    ]
    again = upload.run(spec(src, dest), "s2")
    assert again["skipped"] is False and again["uploaded_files"] == 0 and again["removed_files"] == ["stray.bin"]
    assert not (dest / "stray.bin").exists()
    assert upload.run(spec(src, dest), "s3")["skipped"] is True


def test_a_prefix_of_foreign_files_is_refused_unless_overwrite(tmp_path):
    src, dest = model(tmp_path), tmp_path / "bucket" / "m"
    dest.mkdir(parents=True)
    (dest / "notes.txt").write_text("someone else's")
    with pytest.raises(JobError, match=r"1 file\(s\) that are not this model's .*'notes.txt'.*overwrite=True"):
        upload.run(spec(src, dest), "s1")
    assert (dest / "notes.txt").exists() and not (dest / upload.MODEL_MANIFEST).exists()
    replaced = upload.run(spec(src, dest, overwrite=True), "s2")
    assert replaced["removed_files"] == ["notes.txt"] and not (dest / "notes.txt").exists()
