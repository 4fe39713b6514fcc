"""The Ray Data actor class, called from threads with no event loop, as Ray Data calls it (several at once)."""

import asyncio
import json
import threading
import time

import pyarrow as pa
import pytest
from aiohttp import web

from airflow_provider_rayllm.contract.spec import HttpProcessorSpec
from airflow_provider_rayllm.job.engines.http import RESPONSE, TOKENS_OUT, HttpCaller, batches_in_flight
from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.job.stream import ERROR, KEPT_INPUT, PRE_ERROR, REQUEST
from tests.unit.local_http import start_app

HOLD_S = 20.0  # the longest a held request waits for the test to release it


class ChatServer:
    """Answers each prompt upper-cased; a prompt starting with 'hold' waits until the test releases it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.release = asyncio.Event()
        self.held_ended: list[str] = []
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        self.runner, self.port = self.loop.run_until_complete(start_app(app))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    async def chat(self, request):
        text = (await request.json())["messages"][0]["content"]
        if text.startswith("hold"):
            try:
                await asyncio.wait_for(self.release.wait(), HOLD_S)
            finally:
                self.held_ended.append(text)
        if text.startswith("compact"):  # JSON as some servers write it: no spaces, a key order of their own
            return web.Response(text=compact_answer(text), content_type="application/json")
        return web.json_response(answer_body(text))

    def set_free(self):
        self.loop.call_soon_threadsafe(self.release.set)

    def stop(self):
        self.set_free()
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def answer_body(text: str, completion_tokens: int = 1) -> dict:
    return {
        "choices": [{"message": {"content": text.upper()}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": completion_tokens},
    }


def compact_answer(text: str) -> str:
    """The same answer (two tokens) with its keys in another order and no spaces."""
    return json.dumps(dict(reversed(answer_body(text, 2).items())), separators=(",", ":"))


@pytest.fixture
def server():
    s = ChatServer()
    yield s
    s.stop()


def batch_of(*texts, errors=None):
    """An Arrow batch as the request step gives it to the callers: each request is the endpoint's body already."""
    return pa.table(
        {
            KEPT_INPUT: [{"id": t} for t in texts],
            REQUEST: [json.dumps({"model": "m", "messages": [{"role": "user", "content": t}]}) for t in texts],
            PRE_ERROR: errors or [""] * len(texts),
        }
    )


def call_in_thread(caller, batch):
    """Ray Data's way: the call on a thread of its own; returns (thread, result dict filled when done)."""
    result = {}
    thread = threading.Thread(target=lambda: result.update(caller(batch).to_pydict()))
    thread.start()
    return thread, result


def caller_for(server, **settings):
    spec = HttpProcessorSpec(base_url=f"http://127.0.0.1:{server.port}/v1", model="m", **settings)
    return HttpCaller(spec.model_dump_json())


def test_batch_from_a_plain_thread(server):
    caller = caller_for(server)
    try:
        worker, result = call_in_thread(caller, batch_of("a", "b", "c", errors=["", "", "prompt: column 'q' is empty"]))
        worker.join(timeout=30)
        bodies = [json.loads(b) if b else None for b in result[RESPONSE]]
        assert [b["choices"][0]["message"]["content"] for b in bodies[:2]] == ["A", "B"]
        assert bodies[2] is None, "a row that could not be prompted is not sent"
        assert result[ERROR] == ["", "", "prompt: column 'q' is empty"]
        assert result[TOKENS_OUT] == [1, 1, 0]
    finally:
        caller.close()


def test_batches_in_flight_on_one_caller_do_not_wait_for_each_other(server):
    """A held row keeps its own batch back, not the batch called after it: no barrier between batches."""
    caller = caller_for(server)
    try:
        first, first_result = call_in_thread(caller, batch_of("hold me", "x"))
        second, second_result = call_in_thread(caller, batch_of("y", "z"))
        second.join(timeout=HOLD_S / 2)
        assert not second.is_alive() and not server.held_ended, "the second batch came back while the first waited"
        assert [json.loads(b)["choices"][0]["message"]["content"] for b in second_result[RESPONSE]] == ["Y", "Z"]
        assert first.is_alive()
        server.set_free()
        first.join(timeout=30)
        answers = [json.loads(b)["choices"][0]["message"]["content"] for b in first_result[RESPONSE]]
        assert answers == ["HOLD ME", "X"] and first_result[KEPT_INPUT] == [{"id": "hold me"}, {"id": "x"}]
    finally:
        caller.close()
    assert not caller.loop.thread.is_alive(), "closing the caller ends its loop's thread"


def test_a_batch_past_its_deadline_fails_naming_the_limits_and_the_caller_goes_on(server):
    caller = caller_for(server, max_total_wait_s=1.5, timeout_s=2.5)
    caller.batch_deadline_s = 0.5
    try:
        started = time.monotonic()
        with pytest.raises(JobError, match=r"no answer within 0\.5 s.*max_total_wait_s=1\.5, timeout_s=2\.5"):
            caller(batch_of("hold on", "fine"))
        assert time.monotonic() - started < HOLD_S / 2
        # The held request was given up (cancelled), and the next batch is answered on the same loop.
        assert [
            json.loads(b)["choices"][0]["message"]["content"] for b in caller(batch_of("next"))[RESPONSE].to_pylist()
        ] == ["NEXT"]
    finally:
        caller.close()


@pytest.mark.parametrize(("batch_size", "max_in_flight"), [(256, 64), (16, 64), (1, 4096), (4096, 1), (64, 64)])
def test_each_caller_queues_enough_rows_to_keep_its_slots_busy(batch_size, max_in_flight):
    http = HttpProcessorSpec(base_url="http://h/v1", model="m", batch_size=batch_size, max_in_flight=max_in_flight)
    n = batches_in_flight(http)
    assert n >= 2, "the next batch is already there when one ends"
    assert n * batch_size >= 2 * max_in_flight or n == 16, "twice the in-flight slots queued, up to 16 batches"


def test_the_answer_is_passed_on_as_the_server_wrote_it(server):
    """The response column holds the server's JSON text itself, not the body parsed and written out again."""
    caller = caller_for(server)
    try:
        worker, result = call_in_thread(caller, batch_of("compact one", "plain"))
        worker.join(timeout=30)
        assert result[RESPONSE][0] == compact_answer("compact one")
        assert json.loads(result[RESPONSE][1])["choices"][0]["message"]["content"] == "PLAIN"
        assert result[TOKENS_OUT] == [2, 1]
    finally:
        caller.close()


def test_the_kept_input_columns_pass_through_with_their_arrow_types(server):
    """The callers take and give Arrow batches: the input's kept columns come out as they went in (a zoned
    timestamp, a decimal, a list of ints), not rebuilt from Python values row by row."""
    import datetime
    import decimal

    kept = pa.array(
        [
            {
                "at": datetime.datetime(2026, 12, 1, 9, 30, tzinfo=datetime.timezone.utc),
                "price": decimal.Decimal("1.25"),
                "tags": [1, 2],
            },
            {
                "at": datetime.datetime(2026, 12, 2, 10, 0, tzinfo=datetime.timezone.utc),
                "price": decimal.Decimal("2.50"),
                "tags": [],
            },
        ],
        pa.struct(
            [("at", pa.timestamp("ms", tz="UTC")), ("price", pa.decimal128(9, 2)), ("tags", pa.list_(pa.int32()))]
        ),
    )
    batch = batch_of("a", "b").set_column(0, KEPT_INPUT, kept)
    caller = caller_for(server)
    try:
        out = caller(batch)
    finally:
        caller.close()
    assert out.column(KEPT_INPUT).type == kept.type
    assert out.column(KEPT_INPUT).to_pylist() == kept.to_pylist()
    assert out.column(TOKENS_OUT).type == pa.int64() and out.column(TOKENS_OUT).to_pylist() == [1, 1]
