"""Copy model weights to a bucket and prove it: the guide's `upload_model`, verified.

Order: checksum the source; compare with the destination's model manifest (same content and no other
file under the prefix: skip); remove that manifest (an interrupted upload is then never mistaken for a
complete one); copy the files that are missing or differ; remove the files under the prefix that are not
this model's (an earlier model's, a stray one: a loader reading the folder would take them as part of it);
read every file under the prefix back and compare name, size and sha256; write the model manifest last. A
failed check lists the files that are missing, different or extra.

Files that are not this model's are removed only where the prefix is ours to replace: it holds our model
manifest (this model, or another with ``overwrite``), or ``overwrite`` is set. A prefix with files of its own
and no manifest is refused, naming a few of them.

Ray's own uploader (`python -m ray.llm.utils.upload_model`) is not used: it can log an error and
still exit 0, and it does not verify what arrived.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import time
from datetime import datetime, timezone
from typing import Any

import pyarrow.fs as pafs

from airflow_provider_rayllm.contract.spec import UploadJobSpec
from airflow_provider_rayllm.job import filesystems
from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.version import __version__

log = logging.getLogger("airflow_provider_rayllm.job")
MODEL_MANIFEST = "rayllm-model-manifest.json"
CHUNK = 8 * 1024 * 1024


def _sha256(stream: Any) -> str:
    digest = hashlib.sha256()
    while True:
        block = stream.read(CHUNK)
        if not block:
            return digest.hexdigest()
        digest.update(block)


def _selected(rel: str, allow: list[str] | None, ignore: list[str] | None) -> bool:
    if rel == MODEL_MANIFEST or rel.startswith(".") or "/." in rel:
        return False
    if allow and not any(fnmatch.fnmatch(rel, p) for p in allow):
        return False
    return not (ignore and any(fnmatch.fnmatch(rel, p) for p in ignore))


def resolve_source(spec: UploadJobSpec) -> str:
    """A local folder holding the model: the given folder, or a Hugging Face snapshot."""
    source = os.path.expanduser(spec.model_source)
    if source.startswith(("/", "./", "../")) or os.path.isdir(source):
        if not os.path.isdir(source):
            raise JobError(f"model_source {spec.model_source!r} is not a folder on the cluster")
        return source
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            repo_id=spec.model_source,
            revision=spec.revision,
            allow_patterns=spec.allow_patterns,
            ignore_patterns=spec.ignore_patterns,
            token=os.environ.get("HF_TOKEN") or None,
        )
    except Exception as exc:
        raise JobError(
            f"model_source {spec.model_source!r}: cannot download it from the Hugging Face Hub: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        ) from None


def source_files(folder: str, spec: UploadJobSpec) -> list[dict[str, Any]]:
    files = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder).replace(os.sep, "/")
            if not _selected(rel, spec.allow_patterns, spec.ignore_patterns):
                continue
            with open(path, "rb") as handle:
                files.append({"path": rel, "bytes": os.path.getsize(path), "sha256": _sha256(handle), "local": path})
    if not files:
        raise JobError(f"model_source {spec.model_source!r}: no files to upload (check allow/ignore patterns)")
    return files


def mismatches(fs: pafs.FileSystem, root: str, files: list[dict[str, Any]]) -> dict[str, str]:
    """Files whose copy at the destination is missing or differs (read back: size, then sha256)."""
    present = filesystems.files_under(fs, root)
    bad: dict[str, str] = {}
    for f in files:
        size = present.get(f["path"])
        if size is None:
            bad[f["path"]] = "missing"
        elif size != f["bytes"]:
            bad[f["path"]] = f"{size} bytes, expected {f['bytes']}"
        else:
            with fs.open_input_stream(f"{root}/{f['path']}") as stream:
                if _sha256(stream) != f["sha256"]:
                    bad[f["path"]] = "sha256 differs"
    return bad


def extras(fs: pafs.FileSystem, root: str, files: list[dict[str, Any]]) -> list[str]:
    """Files under the destination that are not this model's (the model manifest aside)."""
    wanted = {f["path"] for f in files} | {MODEL_MANIFEST}
    return sorted(path for path in filesystems.files_under(fs, root) if path not in wanted)


def verify(fs: pafs.FileSystem, root: str, files: list[dict[str, Any]]) -> list[str]:
    """Problems found reading the destination back: every file under it is this model's and matches."""
    problems = [f"{path}: {why}" for path, why in mismatches(fs, root, files).items()]
    return problems + [f"{path}: not part of this model" for path in extras(fs, root, files)]


def run(spec: UploadJobSpec, submission_id: str) -> dict[str, Any]:
    started = time.time()
    folder = resolve_source(spec)
    files = source_files(folder, spec)
    total = sum(f["bytes"] for f in files)
    log.info("source %s: %d files, %.1f MB", folder, len(files), total / 1e6)
    fs, root = filesystems.filesystem_for(spec.bucket_uri)
    manifest_path = f"{root}/{MODEL_MANIFEST}"
    content = [{k: f[k] for k in ("path", "bytes", "sha256")} for f in files]
    try:
        existing = filesystems.read_json(f"{spec.bucket_uri}/{MODEL_MANIFEST}")
    except Exception as exc:
        raise JobError(f"bucket_uri {spec.bucket_uri!r} cannot be read: {type(exc).__name__}: {exc}") from None

    bad = mismatches(fs, root, files)
    stale = extras(fs, root, files)
    if existing is not None and existing.get("files") == content and not bad and not stale:
        log.info("the destination already holds this content; nothing to upload")
        return _manifest(spec, submission_id, content, total, skipped=True, uploaded=0, started=started)
    if existing is not None and existing.get("model_source") != spec.model_source and not spec.overwrite:
        raise JobError(
            f"bucket_uri {spec.bucket_uri!r} holds another model ({existing.get('model_source')!r}); "
            "choose another prefix or set overwrite=True"
        )
    if existing is None and stale and not spec.overwrite:
        raise JobError(
            f"bucket_uri {spec.bucket_uri!r} holds {len(stale)} file(s) that are not this model's and no model "
            f"manifest (e.g. {stale[:3]!r}); choose an empty prefix or set overwrite=True to replace them"
        )

    # From here until the new manifest is written, the destination is visibly incomplete.
    if existing is not None:
        fs.delete_file(manifest_path)
    uploaded = 0
    for f in files:
        if f["path"] not in bad:
            continue  # already there, byte for byte
        target = f"{root}/{f['path']}"
        parent = target.rsplit("/", 1)[0]
        try:
            fs.create_dir(parent, recursive=True)
        except OSError:
            pass  # object stores have no folders to create
        try:
            with open(f["local"], "rb") as src, fs.open_output_stream(target) as out:
                while block := src.read(CHUNK):
                    out.write(block)
        except OSError as exc:
            raise JobError(f"bucket_uri {spec.bucket_uri!r}: cannot write {f['path']}: {exc}") from None
        uploaded += 1
        log.info("uploaded %s (%d bytes)", f["path"], f["bytes"])
    removed = _remove(fs, root, extras(fs, root, files), spec.bucket_uri)
    problems = verify(fs, root, files)
    if problems:
        raise JobError(f"upload to {spec.bucket_uri!r} is incomplete: " + "; ".join(problems[:20]))
    body = _manifest(spec, submission_id, content, total, skipped=False, uploaded=uploaded, started=started)
    body["removed_files"] = removed
    filesystems.write_text_atomic(
        f"{spec.bucket_uri}/{MODEL_MANIFEST}", json.dumps({**body, "files": content}, indent=2)
    )
    return body


def _remove(fs: pafs.FileSystem, root: str, paths: list[str], bucket_uri: str) -> list[str]:
    """Delete the files that are not this model's; the paths removed, for the manifest and the log."""
    for path in paths:
        try:
            fs.delete_file(f"{root}/{path}")
        except OSError as exc:
            raise JobError(
                f"bucket_uri {bucket_uri!r}: cannot remove {path!r}, not part of this model: {exc}"
            ) from None
        log.info("removed %s: not part of this model", path)
    return paths


def _manifest(
    spec: UploadJobSpec,
    submission_id: str,
    content: list[dict],
    total: int,
    *,
    skipped: bool,
    uploaded: int,
    started: float,
) -> dict[str, Any]:
    return {
        "manifest_version": 1,
        "status": "SUCCEEDED",
        "kind": "upload",
        "submission_id": submission_id,
        "spec_hash": spec.content_hash(),
        "output_uri": spec.bucket_uri,
        "model_source": spec.model_source,
        "revision": spec.revision,
        "files": content,
        "file_count": len(content),
        "bytes": total,
        "checksum": hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest(),
        "skipped": skipped,
        "uploaded_files": uploaded,
        "removed_files": [],
        "wall_time_s": round(time.time() - started, 3),
        "finished_at": datetime.now(timezone.utc).isoformat(),
        "versions": {"airflow_provider_rayllm": __version__},
        "run": spec.run.model_dump(),
    }
