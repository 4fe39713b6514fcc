"""Bad inputs a user will hit, each through a real job on the local cluster (the HTTP operator against a
local echo endpoint, so no engine starts): the job fails naming the field and the value, and nothing that
was already published is lost or half-published."""

from __future__ import annotations

import pytest

from airflow_provider_rayllm.contract.names import REQUEST_KEY_COLUMN
from airflow_provider_rayllm.contract.storage import read_manifest
from tests.integration.helpers import StandInTI, echo_connection, echo_operator, read_rows, write_jsonl

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def echo(service_logs):
    with echo_connection("llm_bad", 0.01, service_logs) as url:
        yield url


def _op(task_id: str, input_uri: str, output_uri: str, **kw):
    return echo_operator("llm_bad", task_id, input_uri, output_uri, max_in_flight=4, **kw)


def _run(op, run_id: str, try_number: int = 1):
    return op.execute({"ti": StandInTI("bad_inputs", run_id, op.task_id, try_number=try_number)})


# One published output per test process, written once: every bad run after it writes into the same prefix
# (as another task's failed run would) and must leave it published as it was.
_GOOD: dict[str, tuple[str, dict]] = {}


def _publish_good_output(test_home) -> tuple[str, dict]:
    """A run that succeeds (the first call in this process; later calls get the same output and manifest)."""
    if str(test_home) not in _GOOD:
        out = str(test_home / "out" / "bad_inputs" / "published")
        good = write_jsonl(
            test_home / "inputs" / "published-good.jsonl", [{"id": i, "prompt": f"good {i}"} for i in range(3)]
        )
        _GOOD[str(test_home)] = out, _run(_op("published", good, out), "manual__published_good")
    return _GOOD[str(test_home)]


def _still_published(out: str, before: dict) -> None:
    now = read_manifest(out)
    assert now is not None and now["generation"] == before["generation"], "the published output was replaced"
    assert len(read_rows(now["output_files"])) == before["rows_out"], "the published files are incomplete"


@pytest.mark.parametrize(
    "name, content, fmt, expected",
    [
        # JSON lines are decoded as a whole: the job fails, naming the input and the byte.
        ("latin1_jsonl", b'{"id": 1, "prompt": "caf\xe9"}\n', "jsonl", ["bad.jsonl", "not UTF-8 text", "0xe9"]),
        ("empty_file", b"", "jsonl", ["source: no rows", "bad.jsonl"]),
    ],
)
def test_an_unreadable_or_empty_file_fails_naming_it_and_keeps_the_published_output(
    name, content, fmt, expected, ray_conn, echo, test_home
):
    out, before = _publish_good_output(test_home)
    path = test_home / "inputs" / name / f"bad.{fmt}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    with pytest.raises(Exception) as failed:
        _run(_op(name, str(path), out, input_format=fmt), f"manual__{name}_bad")
    for words in expected:
        assert words in str(failed.value), str(failed.value)
    _still_published(out, before)


def test_a_csv_cell_that_is_not_utf8_is_an_error_row_naming_the_column(ray_conn, echo, test_home):
    """CSV cells are read one by one: the undecodable one is an error row, its neighbours are answered."""
    out = str(test_home / "out" / "bad_inputs" / "latin1_csv")
    path = test_home / "inputs" / "latin1_csv" / "mixed.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"id,prompt\n1,cafe\n2,caf\xe9\n3,tea\n")
    manifest = _run(_op("latin1_csv", str(path), out, max_error_fraction=0.5), "manual__latin1_csv")
    assert (manifest["rows_out"], manifest["rows_errored"]) == (2, 1)
    (bad,) = read_rows(manifest["error_files"])
    assert bad["id"] == 2
    assert "column 'prompt' holds bytes that are not UTF-8 text" in bad["error"] and "xe9" in bad["error"]
    assert sorted(r["response"] for r in read_rows(manifest["output_files"])) == ["echo: cafe", "echo: tea"]


@pytest.mark.parametrize(
    "name, ids, expected",
    [
        ("duplicate_ids", [1, 2, 2, 3], ["id_column 'id'", "2"]),
        ("null_ids", [1, None, 3], ["id_column 'id'", "null"]),
    ],
)
def test_ids_that_cannot_key_a_resume_fail_the_job_naming_them(name, ids, expected, ray_conn, echo, test_home):
    out, before = _publish_good_output(test_home)
    rows = [{"id": i, "prompt": f"row {n}"} for n, i in enumerate(ids)]
    with pytest.raises(Exception) as failed:
        _run(
            _op(name, write_jsonl(test_home / "inputs" / f"{name}.jsonl", rows), out, id_column="id"), f"manual__{name}"
        )
    for words in expected:
        assert words in str(failed.value), str(failed.value)
    _still_published(out, before)


def test_an_input_changed_between_a_failed_try_and_its_retry_publishes_no_stale_rows(ray_conn, echo, test_home):
    name = "changed_input"
    out = str(test_home / "out" / "bad_inputs" / name)
    path = test_home / "inputs" / f"{name}.jsonl"
    # The first try answers its rows, then fails its error gate (one row has no prompt).
    first_rows = [{"id": i, "prompt": f"first {i}"} for i in range(6)]
    write_jsonl(path, first_rows + [{"id": 6, "prompt": None}])
    first = _op(name, str(path), out, id_column="id", max_error_fraction=0)
    with pytest.raises(Exception, match=r"above max_error_fraction=0(\.0)?; nothing was published"):
        _run(first, f"manual__{name}")
    assert read_manifest(out) is None, "a failed try publishes nothing"
    # Between the tries the file is replaced by other rows under other ids: none of the saved rows is in the
    # input any more, so the retry adopts none of them and answers the new rows.
    second_rows = [{"id": 100 + i, "prompt": f"second {i}"} for i in range(6)]
    write_jsonl(path, second_rows)
    retry = _run(_op(name, str(path), out, id_column="id", max_error_fraction=0), f"manual__{name}", try_number=2)
    published = read_rows(retry["output_files"])
    assert sorted((r["id"], r["response"]) for r in published) == [
        (r["id"], f"echo: {r['prompt']}") for r in second_rows
    ]
    assert (retry["rows_resumed"], retry["rows_resume_stale"]) == (0, len(first_rows))
    assert read_manifest(out)["generation"] == retry["generation"]

    # The published prefix as the next task's input, through a glob: only its data files are read (not
    # _manifest.json or _SUCCESS), and each row gets the key of its own new request.
    again = _run(
        _op(
            f"{name}_again",
            f"{out}/*",
            str(test_home / "out" / "bad_inputs" / f"{name}_again"),
            prompt_column="response",
            keep_columns=["id"],
            output_column="again",
        ),
        f"manual__{name}_again",
    )
    reread = read_rows(again["output_files"])
    assert sorted((r["id"], r["again"]) for r in reread) == sorted(
        (r["id"], f"echo: {r['response']}") for r in published
    )
    old_keys = {r[REQUEST_KEY_COLUMN] for r in published}
    assert all(r[REQUEST_KEY_COLUMN] and r[REQUEST_KEY_COLUMN] not in old_keys for r in reread)


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_a_first_row_over_a_mebibyte_is_read_and_kept_whole(fmt, ray_conn, echo, test_home):
    """pyarrow's readers parse blocks of 1 MiB and fail on a longer row; the first row is where the
    columns are learnt, and where the failure showed."""
    notes = "n" * (3 << 19)  # 1.5 MiB in a kept column (the endpoint takes bodies up to 1 MiB)
    rows = [{"id": 0, "prompt": "long", "notes": notes}, {"id": 1, "prompt": "short", "notes": "n"}]
    path = test_home / "inputs" / "long_first_row" / f"rows.{fmt}"
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        write_jsonl(path, rows)
    else:
        path.write_text("id,prompt,notes\n" + "".join(f"{r['id']},{r['prompt']},{r['notes']}\n" for r in rows))
    assert len(path.read_text().split("\n", 2)[0 if fmt == "jsonl" else 1]) > 1 << 20
    out = str(test_home / "out" / "bad_inputs" / f"long_first_row_{fmt}")
    manifest = _run(_op(f"long_first_row_{fmt}", str(path), out), f"manual__long_first_row_{fmt}")
    published = read_rows(manifest["output_files"])
    expected = [(r["id"], r["notes"], f"echo: {r['prompt']}") for r in rows]
    assert sorted((r["id"], r["notes"], r["response"]) for r in published) == expected
