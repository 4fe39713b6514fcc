"""File discovery and formats on the local filesystem (the bucket protocols are integration tests)."""

import json

import pytest

from airflow_provider_rayllm.contract.spec import FileSource
from airflow_provider_rayllm.job import filesystems
from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.job.publish import generations
from airflow_provider_rayllm.job.sources import files as source_files


def touch(path, text="x"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_folder_glob_and_file(tmp_path):
    a = touch(tmp_path / "in" / "date=1" / "a.parquet")
    b = touch(tmp_path / "in" / "date=2" / "b.parquet")
    touch(tmp_path / "in" / "_SUCCESS")
    touch(tmp_path / "in" / ".hidden.parquet")
    assert source_files.expand(FileSource(uris=[str(tmp_path / "in")])) == [str(a), str(b)]
    assert source_files.expand(FileSource(uris=[str(tmp_path / "in" / "*" / "*.parquet")])) == [str(a), str(b)]
    assert source_files.expand(FileSource(uris=[str(a)])) == [str(a)]
    # A published prefix of ours as the input: files under hidden folders are skipped too.
    touch(tmp_path / "in" / "_errors" / "part-x.parquet")
    touch(tmp_path / "in" / "_generations" / "g" / "outputs" / "part-y.parquet")
    assert source_files.expand(FileSource(uris=[str(tmp_path / "in")])) == [str(a), str(b)]


def test_missing_inputs_are_named(tmp_path):
    with pytest.raises(JobError, match="does not exist"):
        source_files.expand(FileSource(uris=[str(tmp_path / "nope.jsonl")]))
    with pytest.raises(JobError, match="no file matches"):
        source_files.expand(FileSource(uris=[str(tmp_path / "*.csv")]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(JobError, match="holds no data files"):
        source_files.expand(FileSource(uris=[str(tmp_path / "empty")], format="csv"))


def test_format_from_files_found(tmp_path):
    files = [str(touch(tmp_path / "a.jsonl")), str(touch(tmp_path / "b.jsonl"))]
    assert source_files.file_format(FileSource(uris=[str(tmp_path)]), files) == "jsonl"
    with pytest.raises(JobError, match="cannot infer one format"):
        source_files.file_format(FileSource(uris=[str(tmp_path)]), files + [str(touch(tmp_path / "c.csv"))])


def test_manifest_write_is_atomic_and_readable(tmp_path):
    target = str(tmp_path / "out" / "_manifest.json")
    filesystems.write_text_atomic(target, '{"a": 1}')
    filesystems.write_text_atomic(target, '{"a": 2}')
    assert filesystems.read_json(target) == {"a": 2}
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["_manifest.json"], "no temp file is left behind"
    assert filesystems.read_json(str(tmp_path / "missing.json")) is None


def test_columns_and_emptiness_come_from_heads_and_footers(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"id": pa.array([], pa.int64()), "q": pa.array([], pa.string())}), tmp_path / "empty.parquet"
    )
    assert source_files.probe("parquet", [str(tmp_path / "empty.parquet")]) == (["id", "q"], False)
    pq.write_table(pa.table({"id": [1], "q": ["x"], "extra": [True]}), tmp_path / "one.parquet")
    assert source_files.probe("parquet", [str(tmp_path / "empty.parquet"), str(tmp_path / "one.parquet")]) == (
        ["id", "q", "extra"],
        True,
    )
    blank = touch(tmp_path / "blank.jsonl", "\n\n")
    rows = touch(tmp_path / "rows.jsonl", '{"id": 1, "text": "a"}\n{"id": 2, "text": "b", "more": 3}\n')
    assert source_files.probe("jsonl", [str(blank)]) == ([], False)
    assert source_files.probe("jsonl", [str(blank), str(rows)]) == (["id", "text", "more"], True)
    assert source_files.probe("csv", [str(touch(tmp_path / "h.csv", "id,text\n"))]) == (["id", "text"], False)


def _spec(run_id="manual__1", task_id="t"):
    from airflow_provider_rayllm.contract.spec import parse_spec

    return parse_spec(
        {
            "source": {"uris": ["/in.jsonl"]},
            "prompt": {"prompt_column": "q"},
            "processor": {"model_source": "/m"},
            "sink": {"uri": "/out"},
            "run": {"dag_id": "d", "run_id": run_id, "task_id": task_id},
        }
    )


def test_each_attempt_gets_a_generation_of_its_own_and_only_this_task_instances_older_ones_go(tmp_path):
    out = str(tmp_path / "run")
    spec = _spec().model_copy(update={"sink": _spec().sink.model_copy(update={"uri": out})})
    first, second = generations.start(spec), generations.start(spec)
    assert first != second and first.ti == second.ti and first.settings == second.settings
    other_ti = generations.Generation(
        generations.task_instance_key(_spec(run_id="manual__2").run), first.settings, first.start, "abcdef"
    )
    for g in (first, second, other_ti):
        touch(tmp_path / "run" / "_generations" / g.name / "outputs" / "part.parquet")
    generations.write_lease(out, other_ti.name, "other")  # another task instance's writer, alive
    touch(tmp_path / "run" / "_generations" / "not-a-generation" / "x")
    assert [g.name for g in generations.unpublished_earlier(out, second, None)] == [first.name]
    assert generations.unpublished_earlier(out, second, first.name) == [], "nothing before or at the published one"
    newer = generations.start(spec)
    touch(tmp_path / "run" / "_generations" / newer.name / "outputs" / "part.parquet")
    assert generations.remove_older(out, second) == [first.name]
    left = set(filesystems.list_subdirs(str(tmp_path / "run" / "_generations")))
    assert left == {second.name, other_ti.name, newer.name, "not-a-generation"}, (
        "another task instance's and a newer attempt's stay"
    )


def test_task_instance_keys_are_distinct_where_a_folder_name_would_not_be():
    from airflow_provider_rayllm.contract.spec import RunSpec

    keys = {
        generations.task_instance_key(RunSpec(dag_id="d", run_id=r, task_id="t"))
        for r in ("résumé", "rösümé", "r_s_m_")
    }
    assert len(keys) == 3


def test_a_large_parquet_file_is_read_as_pieces_of_whole_row_groups(tmp_path):
    """A file of many row groups becomes several read tasks (Ray Data can hold back the ones not started),
    each of whole row groups, together every row once, in batches no larger than BATCH_ROWS."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    group = source_files.PIECE_ROWS // 4 + 1  # four groups pass PIECE_ROWS: a piece ends after the fourth
    total = group * 10
    big, small = tmp_path / "big.parquet", tmp_path / "small.parquet"
    table = pa.table({"id": list(range(total)), "prompt": [f"p{i}" for i in range(total)], "extra": [0] * total})
    pq.write_table(table, big, row_group_size=group)
    pq.write_table(table.slice(0, 3), small)

    pieces = source_files.parquet_pieces([str(big), str(small)])
    assert [p["row_groups"] for p in pieces] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0]]
    assert [p["uri"] for p in pieces] == [str(big)] * 3 + [str(small)]

    batch = {"uri": [p["uri"] for p in pieces], "row_groups": [p["row_groups"] for p in pieces]}
    parts = list(source_files.read_pieces(batch, columns=["id", "prompt"]))
    assert all(part.num_rows <= source_files.BATCH_ROWS for part in parts)
    assert all(part.column_names == ["id", "prompt"] for part in parts)
    ids = [i for part in parts for i in part.column("id").to_pylist()]
    assert ids == list(range(total)) + [0, 1, 2]


def test_a_glob_over_a_published_prefix_skips_our_hidden_entries_unless_it_names_them(tmp_path):
    part = touch(tmp_path / "out" / "part-a-00000.jsonl")
    errors = touch(tmp_path / "out" / "_errors" / "part-a-00000.jsonl")
    touch(tmp_path / "out" / "_generations" / "g" / "outputs" / "part-000000.jsonl")
    touch(tmp_path / "out" / "_manifest.json")
    touch(tmp_path / "out" / "_SUCCESS")
    touch(tmp_path / "out" / ".part-b.jsonl.crc")
    for pattern in ("out/**/*.jsonl", "out/*", "out/**/*"):
        assert source_files.expand(FileSource(uris=[str(tmp_path / pattern)])) == [str(part)], pattern
    assert source_files.expand(FileSource(uris=[str(tmp_path / "out" / "_errors" / "*.jsonl")])) == [str(errors)]
    assert source_files.expand(FileSource(uris=[str(tmp_path / "out" / "_err*" / "*.jsonl")])) == [str(errors)]


BIG = "x" * (3 * source_files.PROBE_BYTES)  # one cell three times the probe and pyarrow's default block


def test_a_first_row_longer_than_the_probe_is_read_for_the_columns(tmp_path):
    jsonl = touch(tmp_path / "big.jsonl", json.dumps({"id": 0, "q": BIG}) + "\n" + json.dumps({"id": 1, "q": "a"}))
    csv = touch(tmp_path / "big.csv", f"id,q\n0,{BIG}\n1,a\n")
    assert source_files.probe("jsonl", [str(jsonl)]) == (["id", "q"], True)
    assert source_files.probe("csv", [str(csv)]) == (["id", "q"], True)
    one_line = touch(tmp_path / "one.jsonl", json.dumps({"id": 0, "q": BIG}))  # no newline at its end
    assert source_files.probe("jsonl", [str(one_line)]) == (["id", "q"], True)


@pytest.mark.parametrize("where", ["first", "middle"])
def test_csv_rows_longer_than_the_block_are_read_once_each_with_the_first_blocks_types(tmp_path, where):
    small = [f"{i},row {i}" for i in range(1, 40_000)]  # more than a block of small rows before the long one
    rows = [f"0,{BIG}", *small] if where == "first" else [*small, f"0,{BIG}", "40000,last"]
    path = touch(tmp_path / "rows.csv", "id,q\n" + "\n".join(rows) + "\n")
    tables = list(source_files.csv_tables(str(path)))
    ids = [i for t in tables for i in t.column("id").to_pylist()]
    assert sorted(ids) == sorted(int(r.split(",", 1)[0]) for r in rows), "every row once"
    assert len({t.schema for t in tables}) == 1
    assert max(len(q) for t in tables for q in t.column("q").to_pylist()) == len(BIG)


def test_an_unreadable_csv_names_the_file(tmp_path):
    path = touch(tmp_path / "bad.csv", "id,q\n1,a\n2,b,c\n")
    with pytest.raises(JobError, match="bad.csv' is not readable as csv"):
        list(source_files.csv_tables(str(path)))


class _VanishingObjects:
    """A local filesystem whose first ``failures`` folder removals fail as a bucket's does when an object it
    listed is deleted by another step before its own delete reaches it (NOT_FOUND)."""

    def __init__(self, failures: int):
        import pyarrow.fs as pafs

        self.fs, self.failures, self.calls = pafs.LocalFileSystem(), failures, 0

    def __getattr__(self, name):
        return getattr(self.fs, name)

    def delete_dir(self, path):
        self.calls += 1
        if self.calls <= self.failures:
            raise FileNotFoundError(2, "google::cloud::Status(NOT_FOUND: ... DeleteObject ... 404)")
        self.fs.delete_dir(path)


def test_a_folder_whose_objects_vanish_while_it_is_removed_is_removed_and_a_lasting_failure_is_raised(
    tmp_path, monkeypatch
):
    """After a publish, the generation's emptied folder is removed; an object that vanished between the listing
    and its delete is gone as asked, and must not fail a job whose output is already published."""
    folder = tmp_path / "gen"
    touch(folder / "outputs" / "_lease")
    fs = _VanishingObjects(failures=1)
    monkeypatch.setattr(filesystems, "filesystem_for", lambda uri: (fs, uri))
    filesystems.delete_dir(str(folder))
    assert not folder.exists() and fs.calls == 2

    touch(folder / "outputs" / "_lease")
    fs = _VanishingObjects(failures=filesystems.DELETE_DIR_TRIES)
    monkeypatch.setattr(filesystems, "filesystem_for", lambda uri: (fs, uri))
    with pytest.raises(FileNotFoundError):
        filesystems.delete_dir(str(folder))
    assert fs.calls == filesystems.DELETE_DIR_TRIES
