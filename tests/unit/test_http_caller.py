"""The Ray Data actor class, called from a thread with no event loop, as Ray Data calls it."""

import json
import threading

import numpy as np
from aiohttp import web

from airflow_provider_rayllm.job.http_pipeline import HttpCaller
from airflow_provider_rayllm.job.prompts import REQUEST, STASH
from airflow_provider_rayllm.spec import HttpProcessorSpec


def test_batch_from_a_plain_thread():
    import asyncio

    async def chat(request):
        body = await request.json()
        return web.json_response(
            {"choices": [{"message": {"content": body["messages"][0]["content"].upper()}}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
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
        caller = HttpCaller(spec.model_dump_json(), "response")
        batch = {
            STASH: np.array([{"id": 1}, {"id": 2}], dtype=object),
            REQUEST: np.array([json.dumps({"messages": [{"role": "user", "content": t}], "sampling_params": {}}) for t in ("a", "b")]),
        }
        result = {}
        worker = threading.Thread(target=lambda: result.update(caller(batch)))
        worker.start()
        worker.join(timeout=30)
        assert result["response"] == ["A", "B"]
        assert result["__rayllm_call_error"] == ["", ""]
    finally:
        loop.call_soon_threadsafe(loop.stop)
