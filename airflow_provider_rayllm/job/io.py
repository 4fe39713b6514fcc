"""Storage through pyarrow filesystems (local paths, s3://, gs://): paths, listings, whole-file writes."""

from __future__ import annotations

import json
import os
import posixpath
import uuid
from typing import Any, Mapping

import pyarrow.fs as pafs

from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.spec import uri_scheme


def _endpoint(url: str) -> tuple[str, str]:
    """'http://127.0.0.1:9000' -> ('127.0.0.1:9000', 'http')."""
    scheme, _, rest = url.partition("://")
    return (rest.rstrip("/"), scheme) if rest else (scheme.rstrip("/"), "https")


def _s3(env: Mapping[str, str]) -> pafs.FileSystem:
    # Credentials come from the standard AWS variables (set from the job's secrets file or the cluster).
    kwargs: dict[str, Any] = {"region": env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"}
    if env.get("AWS_ACCESS_KEY_ID"):
        kwargs.update(
            access_key=env["AWS_ACCESS_KEY_ID"],
            secret_key=env.get("AWS_SECRET_ACCESS_KEY"),
            session_token=env.get("AWS_SESSION_TOKEN"),
        )
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        kwargs["endpoint_override"], kwargs["scheme"] = _endpoint(endpoint)
    return pafs.S3FileSystem(**kwargs)


def _gcs(env: Mapping[str, str]) -> pafs.FileSystem:
    emulator = env.get("STORAGE_EMULATOR_HOST")
    if emulator:
        # An emulator (tests, local stacks) accepts any token: use the configured credentials when there
        # are some, so they are exercised as against GCS, and anonymous access otherwise.
        host, scheme = _endpoint(emulator)
        anonymous = not env.get("GOOGLE_APPLICATION_CREDENTIALS")
        return pafs.GcsFileSystem(endpoint_override=host, scheme=scheme, anonymous=anonymous)
    return pafs.GcsFileSystem()


def filesystem_for(uri: str, env: Mapping[str, str] | None = None) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem for ``uri`` and the path inside it; settings from ``env`` (default: os.environ)."""
    env = os.environ if env is None else env
    scheme = uri_scheme(uri)
    if scheme == "file":
        path = uri[len("file://") :] if uri.startswith("file://") else uri
        return pafs.LocalFileSystem(), os.path.abspath(path)
    path = uri.split("://", 1)[1]
    try:
        if scheme == "s3":
            return _s3(env), path
        if scheme in ("gs", "gcs"):
            return _gcs(env), path
    except Exception as exc:  # pyarrow raises several types for bad settings or missing credentials
        raise JobError(f"cannot open {uri!r}: {exc}") from exc
    raise JobError(f"{uri!r}: unsupported scheme {scheme!r}")


def join(base: str, *parts: str) -> str:
    if uri_scheme(base) == "file":
        return os.path.join(base, *parts)
    return posixpath.join(base, *parts)


def list_files(uri: str) -> list[dict[str, Any]]:
    """Files under ``uri`` with their sizes, as URIs in the caller's scheme."""
    fs, path = filesystem_for(uri)
    scheme = uri_scheme(uri)
    prefix = "" if scheme == "file" else f"{scheme}://"
    selector = pafs.FileSelector(path, recursive=True, allow_not_found=True)
    return sorted(
        ({"uri": prefix + i.path, "bytes": i.size} for i in fs.get_file_info(selector) if i.type == pafs.FileType.File),
        key=lambda f: f["uri"],
    )


def write_bytes_atomic(uri: str, data: bytes) -> None:
    """Readers never see half a file: local writes go through a rename, object stores put whole objects."""
    fs, path = filesystem_for(uri)
    parent = posixpath.dirname(path) if uri_scheme(uri) != "file" else os.path.dirname(path)
    fs.create_dir(parent, recursive=True)
    if uri_scheme(uri) == "file":
        # A name of this writer's own: two writers of one file never share (or remove) a temp file.
        tmp = f"{path}.{uuid.uuid4().hex[:12]}.tmp"
        try:
            with fs.open_output_stream(tmp) as out:
                out.write(data)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    else:
        with fs.open_output_stream(path) as out:
            out.write(data)


def write_text_atomic(uri: str, text: str) -> None:
    write_bytes_atomic(uri, text.encode())


def read_json(uri: str, env: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    fs, path = filesystem_for(uri, env)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return None
    with fs.open_input_stream(path) as stream:
        return json.loads(stream.read().decode())


def delete_dir(uri: str) -> None:
    fs, path = filesystem_for(uri)
    if fs.get_file_info(path).type != pafs.FileType.NotFound:
        fs.delete_dir(path)


def list_subdirs(uri: str) -> list[str]:
    fs, path = filesystem_for(uri)
    selector = pafs.FileSelector(path, recursive=False, allow_not_found=True)
    return sorted(posixpath.basename(i.path) for i in fs.get_file_info(selector) if i.type == pafs.FileType.Directory)


def copy_file(source: str, target: str) -> None:
    """One file to another place of the same store (a server-side copy on object stores)."""
    fs, src = filesystem_for(source)
    _, dst = filesystem_for(target)
    parent = os.path.dirname(dst) if uri_scheme(target) == "file" else posixpath.dirname(dst)
    fs.create_dir(parent, recursive=True)
    fs.copy_file(src, dst)
