"""An OpenAI-style chat endpoint that answers 429 (Retry-After) to everything for N seconds from the
first request on.

Run as `python storm_server.py PORT STORM_SECONDS`; GET /stats returns the arrival times.
"""

import sys
import time

from aiohttp import web

PORT, STORM = int(sys.argv[1]), float(sys.argv[2])
ARRIVALS: list[float] = []


async def chat(request: web.Request) -> web.Response:
    body = await request.json()
    ARRIVALS.append(time.time())
    if time.time() - ARRIVALS[0] < STORM:
        return web.Response(status=429, headers={"Retry-After": "1"}, text='{"error": {"message": "rate limited"}}')
    text = body["messages"][-1]["content"]
    return web.json_response(
        {"choices": [{"message": {"content": f"echo: {text}"}}], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}
    )


async def stats(request: web.Request) -> web.Response:
    return web.json_response({"arrivals": ARRIVALS})


app = web.Application()
app.router.add_post("/v1/chat/completions", chat)
app.router.add_get("/stats", stats)
# A test server: requests still open when it is stopped are cut at once, not waited for.
web.run_app(app, host="127.0.0.1", port=PORT, print=None, shutdown_timeout=1.0)
