"""A real aiohttp server on a free loopback port, for tests that need an HTTP peer."""

from __future__ import annotations

from aiohttp import web


async def start_app(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]
