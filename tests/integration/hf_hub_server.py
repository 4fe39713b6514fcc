"""A gated Hugging Face Hub on loopback that serves one model folder under one repo id.

Run as `python hf_hub_server.py PORT REPO_ID MODEL_DIR REQUEST_LOG` with the repo's token in the
environment variable HUB_TOKEN. It answers the Hub's HTTP API as huggingface_hub, transformers and vLLM
call it (model info, file tree, file metadata by HEAD, file download), and like a gated repo it refuses
every request without `Authorization: Bearer <token>` (401, X-Error-Code: GatedRepo). Each request is
appended to REQUEST_LOG as one JSON line with its method, path and whether the token was right; the token
itself is never written.
"""

import hashlib
import json
import os
import sys
from pathlib import Path

from aiohttp import web

PORT = int(sys.argv[1])
REPO_ID = sys.argv[2]
MODEL_DIR = Path(sys.argv[3])
REQUEST_LOG = Path(sys.argv[4])
TOKEN = os.environ["HUB_TOKEN"]

FILES = {p.relative_to(MODEL_DIR).as_posix(): p for p in sorted(MODEL_DIR.rglob("*")) if p.is_file()}
SHA = hashlib.sha1("".join(f"{name}:{p.stat().st_size}" for name, p in FILES.items()).encode()).hexdigest()
ETAGS = {name: hashlib.sha256(p.read_bytes()).hexdigest() for name, p in FILES.items()}


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response(
        {"error": message}, status=status, headers={"X-Error-Code": code, "X-Error-Message": message}
    )


@web.middleware
async def gate(request: web.Request, handler):
    authorized = request.headers.get("Authorization") == f"Bearer {TOKEN}"
    with REQUEST_LOG.open("a") as log:
        log.write(json.dumps({"method": request.method, "path": request.path, "authorized": authorized}) + "\n")
    if not authorized:
        return _error(
            401,
            "GatedRepo",
            f"Access to model {REPO_ID} is restricted. You must have access to it and be authenticated.",
        )
    repo = request.match_info.get("repo")
    if repo is not None and repo != REPO_ID:
        return _error(404, "RepoNotFound", f"Repository Not Found for url: {request.path}.")
    return await handler(request)


def _info() -> dict:
    return {
        "id": REPO_ID,
        "modelId": REPO_ID,
        "sha": SHA,
        "private": False,
        "gated": "manual",
        "disabled": False,
        "tags": ["transformers", "safetensors", "llama", "text-generation"],
        "pipeline_tag": "text-generation",
        "library_name": "transformers",
        "siblings": [{"rfilename": name} for name in FILES],
    }


async def model_info(request: web.Request) -> web.Response:
    return web.json_response(_info())


async def tree(request: web.Request) -> web.Response:
    prefix = request.match_info.get("path", "").strip("/")
    recursive = request.query.get("recursive", "false").lower() == "true"
    entries, folders = [], set()
    for name, path in FILES.items():
        if prefix and not name.startswith(prefix + "/"):
            continue
        rest = name[len(prefix) + 1 :] if prefix else name
        if "/" in rest and not recursive:
            folders.add(f"{prefix}/{rest.split('/')[0]}" if prefix else rest.split("/")[0])
            continue
        entries.append({"type": "file", "path": name, "size": path.stat().st_size, "oid": ETAGS[name][:40]})
    if prefix and not entries and not folders:
        return _error(404, "EntryNotFound", f"{prefix} does not exist on {SHA}")
    return web.json_response([{"type": "directory", "path": f, "oid": SHA} for f in sorted(folders)] + entries)


async def resolve(request: web.Request) -> web.StreamResponse:
    name = request.match_info["path"]
    path = FILES.get(name)
    if path is None:
        return _error(404, "EntryNotFound", f"{name} does not exist on {SHA}")
    headers = {"X-Repo-Commit": SHA, "ETag": f'"{ETAGS[name]}"', "Content-Length": str(path.stat().st_size)}
    if request.method == "HEAD":
        return web.Response(status=200, headers=headers)
    return web.FileResponse(path, headers={"X-Repo-Commit": SHA, "ETag": f'"{ETAGS[name]}"'})


app = web.Application(middlewares=[gate])
for info_path in ("/api/models/{repo:[^/]+/[^/]+}", "/api/models/{repo:[^/]+/[^/]+}/revision/{rev}"):
    app.router.add_get(info_path, model_info)
app.router.add_get("/api/models/{repo:[^/]+/[^/]+}/tree/{rev}", tree)
app.router.add_get("/api/models/{repo:[^/]+/[^/]+}/tree/{rev}/{path:.*}", tree)
app.router.add_route("HEAD", "/{repo:[^/]+/[^/]+}/resolve/{rev}/{path:.*}", resolve)
app.router.add_get("/{repo:[^/]+/[^/]+}/resolve/{rev}/{path:.*}", resolve, allow_head=False)
web.run_app(app, host="127.0.0.1", port=PORT, print=None)
