"""Request keys and resume: a saved answer is reused only for the same id asking the same thing."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airflow_provider_rayllm.contract.names import REQUEST_KEY_COLUMN
from airflow_provider_rayllm.contract.spec import PromptSpec, parse_spec
from airflow_provider_rayllm.job.driver import kept_columns
from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.job.publish import resume
from airflow_provider_rayllm.job.requests.ids import IdGate
from airflow_provider_rayllm.job.requests.keys import request_identity
from airflow_provider_rayllm.job.requests.prompts import RequestBuilder
from airflow_provider_rayllm.job.sinks.files import OUTPUTS
from airflow_provider_rayllm.job.stream import KEPT_INPUT, PRE_ERROR, REQUEST

ROW = {"id": 1, "q": "Why is the sky blue?"}
PROMPT = {"prompt_column": "q", "system_prompt": "Be brief.", "sampling_params": {"max_tokens": 8, "temperature": 0}}


def _spec(prompt: dict | None = None, kind: str = "vllm", **engine) -> dict:
    section = (
        {"processor": {"model_source": "/models/a", **engine}}
        if kind == "vllm"
        else {"http": {"base_url": "http://127.0.0.1:1/v1", "model": "m-a", **engine}}
    )
    return parse_spec(
        {
            "kind": kind,
            "source": {"uris": ["/in.jsonl"]},
            "prompt": prompt or PROMPT,
            "sink": {"uri": "/out"},
            **section,
        }
    )


def key_of(spec, row=ROW) -> str:
    builder = RequestBuilder(spec.prompt, spec.task_type, ["id"], "/nonexistent", identity=request_identity(spec))
    return builder(row)[KEPT_INPUT][REQUEST_KEY_COLUMN]


def test_the_same_request_has_the_same_key_and_any_change_a_new_one():
    base = key_of(_spec())
    assert base == key_of(_spec()), "the key is stable: same request, same key"
    assert base == key_of(_spec(), {**ROW, "other": "not in the request"}), "columns the request does not use"
    changed = {
        "prompt text": key_of(_spec(), {**ROW, "q": "Why is the sky blue"}),
        "system prompt": key_of(_spec({**PROMPT, "system_prompt": "Be long."})),
        "template": key_of(_spec({"template": "Q: {q}", "sampling_params": PROMPT["sampling_params"]})),
        "sampling": key_of(_spec({**PROMPT, "sampling_params": {"max_tokens": 9, "temperature": 0}})),
        "model": key_of(_spec(model_source="/models/b")),
        "task type": key_of(_spec({"prompt_column": "q"}, task_type="embed")),
        "engine": key_of(_spec(kind="http")),
    }
    assert base not in changed.values(), {name: k == base for name, k in changed.items()}
    assert len(set(changed.values())) == len(changed)
    http = key_of(_spec(kind="http"))
    assert http != key_of(_spec(kind="http", model="m-b")), "the endpoint's model name is part of the key"
    assert http != key_of(_spec(kind="http", endpoint="completions"))
    assert http == key_of(_spec(kind="http", base_url="http://user:secret@10.0.0.1:8000/v1")), (
        "where the endpoint lives (and its credentials) is not"
    )


def test_an_http_jobs_request_is_the_endpoints_body_and_its_key_is_the_requests():
    """The request step writes what the HTTP callers send (they post it as it is); the key stays the one of
    our request, so outputs saved before the body was built there are still found by a resume."""
    from airflow_provider_rayllm.job.engines.http import HttpEngine

    spec = _spec(kind="http", model="m-b")
    plain = RequestBuilder(spec.prompt, spec.task_type, ["id"], "/nonexistent", identity=request_identity(spec))(ROW)
    wire = HttpEngine(spec, "/nonexistent").wire_body()
    sent = RequestBuilder(
        spec.prompt, spec.task_type, ["id"], "/nonexistent", identity=request_identity(spec), wire=wire
    )(ROW)
    body = json.loads(sent[REQUEST])
    assert body == {
        "model": "m-b",
        **{k: v for k, v in json.loads(plain[REQUEST]).items() if k != "sampling_params"},
        **PROMPT["sampling_params"],
    }
    assert sent[KEPT_INPUT][REQUEST_KEY_COLUMN] == plain[KEPT_INPUT][REQUEST_KEY_COLUMN] is not None


def test_a_request_the_endpoints_body_cannot_be_made_from_is_that_rows_error():
    """The chat endpoint's body needs messages: a request without them (a preprocess that returned neither
    messages nor a payload) is an error row of its own, not a failed batch of the callers."""
    from airflow_provider_rayllm.job.engines.http import HttpEngine

    spec = _spec(kind="http")
    wire = HttpEngine(spec, "/nonexistent").wire_body()
    builder = RequestBuilder(spec.prompt, spec.task_type, ["id"], "/nonexistent", wire=wire)
    builder.request = lambda row: {"prompt": row["q"]}  # what such a preprocess leaves
    built = builder(ROW)
    assert (
        built[PRE_ERROR]
        == "prompt: ValueError: the chat/completions endpoint needs messages; this request has ['prompt']"
    )
    assert built[KEPT_INPUT][REQUEST_KEY_COLUMN] is None


def test_a_row_that_cannot_be_prompted_has_no_key():
    assert key_of(_spec(), {"id": 2, "q": None}) is None


def _saved(tmp_path, name: str, rows: list[dict]) -> str:
    path = tmp_path / "saved" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if name.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _answered(spec, row: dict, answer: str) -> dict:
    return {**row, "response": answer, REQUEST_KEY_COLUMN: key_of(spec, row)}


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_only_saved_rows_asking_the_same_thing_are_skipped_and_adopted(tmp_path, fmt):
    spec = _spec()
    before = [{"id": i, "q": f"question {i}"} for i in range(4)]
    older = [{"id": 9, "response": "saved before keys existed"}]  # a file written without keys
    files = [
        _saved(tmp_path, f"part-0.{fmt}", [_answered(spec, r, f"old {r['id']}") for r in before]),
        _saved(tmp_path, f"part-1.{fmt}", older),
    ]
    # The input changed between the attempts: id 1 asks something else now, id 3 is gone, 4 is new.
    now = [before[0], {"id": 1, "q": "question 1, reworded"}, before[2], {"id": 4, "q": "question 4"}, {"id": 9}]
    gate = IdGate("id", files)
    assert gate.saved_rows == len(before) + len(older)
    asked, reused = gate.admit(now, [key_of(spec, r) if "q" in r else None for r in now])
    assert [now[i]["id"] for i in asked] == [1, 4, 9], "changed, new and keyless rows are asked again"
    assert sorted(i for i, _ in reused) == [0, 2]

    adoption = resume.adopt(files, str(tmp_path / "gen"), "id", set(reused))
    (adopted,) = adoption.files
    rows = (
        pq.read_table(adopted["uri"]).to_pylist()
        if fmt == "parquet"
        else [json.loads(line) for line in open(adopted["uri"])]
    )
    assert sorted(r["id"] for r in rows) == [0, 2] and adopted["rows"] == len(rows) == len(reused)
    assert adopted["uri"].startswith(str(tmp_path / "gen" / OUTPUTS / resume.ADOPTED))
    assert adoption.stale_rows == len(before) + len(older) - len(reused)


def test_a_pair_saved_by_two_attempts_is_adopted_once(tmp_path):
    spec = _spec()
    row = _answered(spec, {"id": 0, "q": "question 0"}, "answer")
    files = [_saved(tmp_path, "a.parquet", [row]), _saved(tmp_path, "b.parquet", [row])]
    adoption = resume.adopt(files, str(tmp_path / "gen"), "id", {(0, row[REQUEST_KEY_COLUMN])})
    assert adoption.rows == 1 and adoption.stale_rows == 1


def test_an_earlier_output_as_input_keeps_its_rows_not_their_old_keys():
    prompt = PromptSpec(prompt_column="q")
    assert kept_columns(prompt, ["id", "q", REQUEST_KEY_COLUMN]) == ["id", "q"]
    with pytest.raises(JobError, match=f"{REQUEST_KEY_COLUMN!r} is the job's own column"):
        kept_columns(PromptSpec(prompt_column="q", keep_columns=["q", REQUEST_KEY_COLUMN]), ["q", REQUEST_KEY_COLUMN])


def _answered_row(spec) -> dict:
    from airflow_provider_rayllm.job.engines.http import RESPONSE

    built = RequestBuilder(spec.prompt, spec.task_type, ["id"], "/nonexistent", identity=request_identity(spec))(ROW)
    body = {"choices": [{"message": {"content": "blue light scatters"}}], "usage": {}}
    return {KEPT_INPUT: built[KEPT_INPUT], RESPONSE: json.dumps(body)}


@pytest.mark.parametrize(
    "prompt, columns",
    [
        (PROMPT, ["id", "response", "attempts", "num_input_tokens", "num_generated_tokens", REQUEST_KEY_COLUMN]),
        # The guide's postprocess gives the output row, exactly; with id_column the key joins it for resume.
        ({**PROMPT, "postprocess": {"import_path": "tests.unit.helpers:answer_only"}}, ["answer"]),
        (
            {**PROMPT, "postprocess": {"import_path": "tests.unit.helpers:answer_only"}, "id_column": "id"},
            ["answer", REQUEST_KEY_COLUMN],
        ),
    ],
)
def test_the_key_is_written_beside_each_output_row(prompt, columns):
    from airflow_provider_rayllm.job.engines.http import HttpShaper

    spec = _spec(prompt, kind="http")
    shaped = HttpShaper(spec, "/nonexistent").shape(_answered_row(spec))
    assert list(shaped.output) == columns
    if REQUEST_KEY_COLUMN in columns:
        assert shaped.output[REQUEST_KEY_COLUMN] == key_of(spec)
