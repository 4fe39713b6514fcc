"""An OAuth 2.0 token endpoint: POST /token with a refresh-token grant returns a bearer token.

Run as `python token_server.py PORT`. It checks the grant's form fields, as Google's token endpoint
does, so a client that sends a malformed request fails here too; the refresh token
"revoked-refresh-token" is refused as Google refuses a revoked one.
"""

import sys
import time
from urllib.parse import parse_qs

from aiohttp import web

PORT = int(sys.argv[1])
REVOKED = "revoked-refresh-token"  # what a keyfile whose access was withdrawn holds


async def token(request: web.Request) -> web.Response:
    # Parsed from the raw body: clients differ in the Content-Type they declare for the form.
    raw = (await request.read()).decode()
    form = {k: v[0] for k, v in parse_qs(raw).items()}
    if form.get("grant_type") != "refresh_token" or not form.get("refresh_token") or not form.get("client_id"):
        return web.json_response({"error": "invalid_grant", "error_description": f"fields: {sorted(form)}"}, status=400)
    if form.get("refresh_token") == REVOKED:
        return web.json_response(
            {"error": "invalid_grant", "error_description": "Token has been expired or revoked."}, status=400
        )
    return web.json_response({"access_token": f"local-{int(time.time())}", "expires_in": 3600, "token_type": "Bearer"})


async def probe(request: web.Request) -> web.Response:
    return web.Response(text="token endpoint: POST only")


app = web.Application()
app.router.add_post("/token", token)
app.router.add_get("/token", probe)
# A test server: requests still open when it is stopped are cut at once, not waited for.
web.run_app(app, host="127.0.0.1", port=PORT, print=None, shutdown_timeout=1.0)
