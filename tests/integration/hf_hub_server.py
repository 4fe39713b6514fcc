"""A gated Hugging Face Hub on loopback that serves folders as model and dataset repos.

Run as `python hf_hub_server.py PORT REQUEST_LOG KIND:REPO_ID=DIR ...` (KIND is `model`, `dataset`, or
`public-dataset` for a dataset anyone may read) with the gated repos' token in the environment variable
HUB_TOKEN. It answers the Hub's HTTP API as huggingface_hub,
transformers and vLLM call it for models (model info, file tree, file metadata by HEAD, file download) and as
huggingface_hub's HfFileSystem calls it for datasets (dataset info by revision, tree listing, paths-info,
ranged downloads). Like a gated repo it refuses every request without `Authorization: Bearer <token>` (401,
X-Error-Code: GatedRepo); a repo or revision it does not serve is RepoNotFound / RevisionNotFound. Each
request is appended to REQUEST_LOG as one JSON line with its method, path and whether the token was right;
the token itself is never written.
"""

import hashlib
import json
import os
import sys
from pathlib import Path
from urllib.parse import unquote

from aiohttp import web

PORT = int(sys.argv[1])
REQUEST_LOG = Path(sys.argv[2])
TOKEN = os.environ["HUB_TOKEN"]


class Repo:
    def __init__(self, kind: str, repo_id: str, folder: Path) -> None:
        self.public = kind.startswith("public-")
        self.kind, self.id = kind.removeprefix("public-"), repo_id
        self.files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}
        self.sha = hashlib.sha1(
            "".join(f"{name}:{p.stat().st_size}" for name, p in self.files.items()).encode()
        ).hexdigest()
        self.etags = {name: hashlib.sha256(p.read_bytes()).hexdigest() for name, p in self.files.items()}
        self.folders = {"/".join(name.split("/")[:i]) for name in self.files for i in range(1, name.count("/") + 1)}


REPOS: dict[tuple[str, str], Repo] = {}
for item in sys.argv[3:]:
    kind_id, _, folder = item.partition("=")
    kind, _, repo_id = kind_id.partition(":")
    repo = Repo(kind, repo_id, Path(folder))
    REPOS[(repo.kind, repo_id)] = repo


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response(
        {"error": message}, status=status, headers={"X-Error-Code": code, "X-Error-Message": message}
    )


def _kind(request: web.Request) -> str:
    return "dataset" if request.match_info.get("kinds") == "datasets" else "model"


@web.middleware
async def gate(request: web.Request, handler):
    authorized = request.headers.get("Authorization") == f"Bearer {TOKEN}"
    with REQUEST_LOG.open("a") as log:
        log.write(json.dumps({"method": request.method, "path": request.path, "authorized": authorized}) + "\n")
    repo_id = request.match_info.get("repo")
    kind = _kind(request)
    if repo_id is not None and (kind, repo_id) not in REPOS:
        # The Hub answers 401 to an unknown repo without a token and 404 with one; both say RepoNotFound.
        return _error(401 if not authorized else 404, "RepoNotFound", f"Repository Not Found for url: {request.path}.")
    if not authorized and not (repo_id is not None and REPOS[(kind, repo_id)].public):
        return _error(
            401,
            "GatedRepo",
            f"Access to {kind} {repo_id} is restricted. You must have access to it and be authenticated.",
        )
    if repo_id is None:
        return _error(404, "EntryNotFound", f"{request.path} is not served here")
    repo = REPOS[(kind, repo_id)]
    revision = unquote(request.match_info.get("rev", "main"))
    if revision not in ("main", repo.sha):
        return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
    request["repo"] = repo
    return await handler(request)


async def repo_info(request: web.Request) -> web.Response:
    repo: Repo = request["repo"]
    body = {
        "id": repo.id,
        "sha": repo.sha,
        "private": False,
        "gated": False if repo.public else "manual",
        "disabled": False,
        "siblings": [{"rfilename": name} for name in repo.files],
    }
    if repo.kind == "model":
        body.update(
            modelId=repo.id,
            tags=["transformers", "safetensors", "llama", "text-generation"],
            pipeline_tag="text-generation",
            library_name="transformers",
        )
    else:
        body.update(tags=["format:parquet"], downloads=0, likes=0)
    return web.json_response(body)


def _entry(repo: Repo, name: str) -> dict:
    if name in repo.files:
        return {"type": "file", "path": name, "size": repo.files[name].stat().st_size, "oid": repo.etags[name][:40]}
    return {"type": "directory", "path": name, "oid": hashlib.sha1(f"{repo.sha}:{name}".encode()).hexdigest()}


async def tree(request: web.Request) -> web.Response:
    repo: Repo = request["repo"]
    prefix = unquote(request.match_info.get("path", "")).strip("/")
    recursive = request.query.get("recursive", "false").lower() == "true"
    if prefix and prefix not in repo.folders:
        return _error(404, "EntryNotFound", f"{prefix} does not exist on {repo.sha}")
    names = sorted(repo.folders | set(repo.files))
    inside = [n for n in names if not prefix or n.startswith(prefix + "/")]
    depth = prefix.count("/") + 1 if prefix else 0
    shown = inside if recursive else [n for n in inside if n.count("/") == depth]
    return web.json_response([_entry(repo, n) for n in shown])


async def paths_info(request: web.Request) -> web.Response:
    repo: Repo = request["repo"]
    form = await request.post()
    paths = [str(p).strip("/") for p in form.getall("paths", [])]
    return web.json_response([_entry(repo, p) for p in paths if p in repo.files or p in repo.folders])


async def resolve(request: web.Request) -> web.StreamResponse:
    repo: Repo = request["repo"]
    name = unquote(request.match_info["path"])
    path = repo.files.get(name)
    if path is None:
        return _error(404, "EntryNotFound", f"{name} does not exist on {repo.sha}")
    headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{repo.etags[name]}"', "Accept-Ranges": "bytes"}
    if request.method == "HEAD":
        return web.Response(status=200, headers={**headers, "Content-Length": str(path.stat().st_size)})
    return web.FileResponse(path, headers=headers)  # answers Range requests with 206


REPO = "{repo:[^/]+/[^/]+}"
app = web.Application(middlewares=[gate])
for kinds in ("models", "datasets"):
    api = f"/api/{{kinds:{kinds}}}/{REPO}"
    app.router.add_get(api, repo_info)
    app.router.add_get(api + "/revision/{rev}", repo_info)
    app.router.add_get(api + "/tree/{rev}", tree)
    app.router.add_get(api + "/tree/{rev}/{path:.*}", tree)
    app.router.add_post(api + "/paths-info/{rev}", paths_info)
for files in (f"/{REPO}", f"/{{kinds:datasets}}/{REPO}"):
    app.router.add_route("HEAD", files + "/resolve/{rev}/{path:.*}", resolve)
    app.router.add_get(files + "/resolve/{rev}/{path:.*}", resolve, allow_head=False)
# A test server: requests still open when it is stopped are cut at once, not waited for.
web.run_app(app, host="127.0.0.1", port=PORT, print=None, shutdown_timeout=1.0)
