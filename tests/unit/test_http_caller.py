"""The Ray Data actor class, called from a thread with no event loop, as Ray Data calls it."""

import json
import threading

import numpy as np
from aiohttp import web

from airflow_provider_rayllm.contract.spec import HttpProcessorSpec
from airflow_provider_rayllm.job.engines.http import RESPONSE, TOKENS_OUT, HttpCaller
from airflow_provider_rayllm.job.stream import ERROR, KEPT_INPUT, PRE_ERROR, REQUEST


def test_batch_from_a_plain_thread():
    import asyncio

    async def chat(request):
        body = await request.json()
        return web.json_response(
            {
                "choices": [{"message": {"content": body["messages"][0]["content"].upper()}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1},
            }
        )

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    server = threading.Thread(target=loop.run_forever, daemon=True)
    server.start()
    try:
        spec = HttpProcessorSpec(base_url=f"http://127.0.0.1:{port}/v1", model="m")
        caller = HttpCaller(spec.model_dump_json())
        batch = {
            KEPT_INPUT: np.array([{"id": 1}, {"id": 2}, {"id": 3}], dtype=object),
            REQUEST: np.array(
                [
                    json.dumps({"messages": [{"role": "user", "content": t}], "sampling_params": {}})
                    for t in ("a", "b", "c")
                ]
            ),
            PRE_ERROR: np.array(["", "", "prompt: ValueError: column 'q' is empty"]),
        }
        result = {}
        worker = threading.Thread(target=lambda: result.update(caller(batch)))
        worker.start()
        worker.join(timeout=30)
        bodies = [json.loads(b) if b else None for b in result[RESPONSE]]
        assert [b["choices"][0]["message"]["content"] for b in bodies[:2]] == ["A", "B"]
        assert bodies[2] is None, "a row that could not be prompted is not sent"
        assert result[ERROR] == ["", "", "prompt: ValueError: column 'q' is empty"]
        assert result[TOKENS_OUT] == [1, 1, 0]
    finally:
        loop.call_soon_threadsafe(loop.stop)
