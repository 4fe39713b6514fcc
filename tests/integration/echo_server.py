"""An OpenAI-style chat endpoint that answers every request after DELAY seconds with the last message's text
(an image part as its size and first pixel's colour).

Run as `python echo_server.py PORT DELAY [nocount]`. GET /stats returns how many requests each prompt got, so a
test can tell a re-sent request (fine) from a duplicated output row (not fine); `nocount` keeps no count (a
benchmark's millions of prompts would otherwise grow the server's memory with the run), and its "times" when
each prompt's request last arrived and was answered (Unix seconds), and "order" the prompts in the order their
requests arrived. A prompt that starts with "[sleep S]" is
answered after S seconds instead of DELAY. POST /fail {"status": 400} makes every later request fail with that
status until POST /fail {"status": 0}.
"""

import asyncio
import base64
import collections
import io
import re
import sys
import time

from aiohttp import web

PORT, DELAY = int(sys.argv[1]), float(sys.argv[2])
COUNT = sys.argv[3:] != ["nocount"]
REQUESTS: collections.Counter = collections.Counter()
TIMES: dict[str, list[float]] = {}
ORDER: list[str] = []
SLEEP = re.compile(r"^\[sleep ([0-9.]+)\]")
FAIL = {"status": 0}


def _image(url: str) -> str:
    """An image part as what the picture is: its size and the colour of its first pixel."""
    from PIL import Image

    image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
    return f"[image {image.width}x{image.height} {image.getpixel((0, 0))}]"


def _text(content) -> str:
    """The message's text; a multimodal message's parts in order, each image told by what it shows."""
    if isinstance(content, str):
        return content
    return "".join(p["text"] if p["type"] == "text" else _image(p["image_url"]["url"]) for p in content)


async def chat(request: web.Request) -> web.Response:
    body = await request.json()
    text = _text(body["messages"][-1]["content"])
    if COUNT:
        REQUESTS[text] += 1
        ORDER.append(text)
        arrived = time.time()
    slow = SLEEP.match(text)
    await asyncio.sleep(float(slow.group(1)) if slow else DELAY)
    if COUNT:
        TIMES[text] = [arrived, time.time()]
    if FAIL["status"]:
        return web.json_response({"error": {"message": "refused by the test"}}, status=FAIL["status"])
    return web.json_response(
        {"choices": [{"message": {"content": f"echo: {text}"}}], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}
    )


async def stats(request: web.Request) -> web.Response:
    return web.json_response(
        {"requests": dict(REQUESTS), "total": sum(REQUESTS.values()), "times": TIMES, "order": ORDER}
    )


async def fail(request: web.Request) -> web.Response:
    FAIL["status"] = int((await request.json())["status"])
    return web.json_response(FAIL)


app = web.Application()
app.router.add_post("/fail", fail)
app.router.add_post("/v1/chat/completions", chat)
app.router.add_get("/stats", stats)
# A test server: requests still open when it is stopped are cut at once, not waited for.
web.run_app(app, host="127.0.0.1", port=PORT, print=None, shutdown_timeout=1.0)
