"""Paths and buckets through pyarrow filesystems (local paths, s3://, gs://, hf://), for both halves: the job
reads and writes through it, the operator reads the manifest with it. pyarrow is imported only when a
filesystem is made, so the Airflow half can import this while parsing a DAG.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from airflow_provider_rayllm.contract.names import MANIFEST_NAME
from airflow_provider_rayllm.contract.spec import uri_scheme


class StorageError(ValueError):
    """A URI that names no filesystem we can open."""


def _endpoint(url: str) -> tuple[str, str]:
    """'http://127.0.0.1:9000' -> ('127.0.0.1:9000', 'http')."""
    scheme, _, rest = url.partition("://")
    return (rest.rstrip("/"), scheme) if rest else (scheme.rstrip("/"), "https")


def _s3(env: Mapping[str, str]) -> Any:
    import pyarrow.fs as pafs

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


def _gcs(env: Mapping[str, str]) -> Any:
    import pyarrow.fs as pafs

    emulator = env.get("STORAGE_EMULATOR_HOST")
    if emulator:
        # An emulator (tests, local stacks) accepts any token: use the configured credentials when there
        # are some, so they are exercised as against GCS, and anonymous access otherwise.
        host, scheme = _endpoint(emulator)
        anonymous = not env.get("GOOGLE_APPLICATION_CREDENTIALS")
        return pafs.GcsFileSystem(endpoint_override=host, scheme=scheme, anonymous=anonymous)
    return pafs.GcsFileSystem()


def hub_endpoint(env: Mapping[str, str]) -> str:
    """The Hugging Face Hub the job talks to: HF_ENDPOINT (a private hub or a mirror), else huggingface.co."""
    return (env.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def hub_token(env: Mapping[str, str]) -> str | None:
    return env.get("HF_TOKEN") or env.get("HUGGING_FACE_HUB_TOKEN") or None


def _hf(env: Mapping[str, str]) -> Any:
    import pyarrow.fs as pafs
    from huggingface_hub import HfFileSystem

    # The token is left for huggingface_hub to read from the process's environment (the job's secrets file
    # puts it there on every worker): given to HfFileSystem, it would be pickled into the read tasks Ray
    # Data ships and stores. The endpoint is no secret, and huggingface_hub reads HF_ENDPOINT only once, at
    # its import, so it is passed.
    token = hub_token(env) if env is not os.environ else None
    hub = HfFileSystem(endpoint=hub_endpoint(env), token=token)
    # A pickled copy (Ray Data ships the filesystem to its JSON and CSV read tasks) is rebuilt from
    # storage_options, where HfFileSystem keeps neither: the endpoint goes there so the copy keeps it.
    hub.storage_options = {**hub.storage_options, "endpoint": hub.endpoint}
    return pafs.PyFileSystem(pafs.FSSpecHandler(hub))


def filesystem_for(uri: str, env: Mapping[str, str] | None = None) -> tuple[Any, str]:
    """The pyarrow filesystem for ``uri`` and the path inside it; settings from ``env`` (default: os.environ)."""
    import pyarrow.fs as pafs

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
        if scheme == "hf":
            return _hf(env), path.rstrip("/")
    except Exception as exc:  # pyarrow raises several types for bad settings or missing credentials
        raise StorageError(f"cannot open {uri!r}: {exc}") from exc
    raise StorageError(f"{uri!r}: unsupported scheme {scheme!r}")


def read_json(uri: str, env: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    import pyarrow.fs as pafs

    fs, path = filesystem_for(uri, env)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return None
    with fs.open_input_stream(path) as stream:
        return json.loads(stream.read().decode())


def manifest_uri(output_uri: str) -> str:
    return (
        os.path.join(output_uri, MANIFEST_NAME)
        if uri_scheme(output_uri) == "file"
        else f"{output_uri.rstrip('/')}/{MANIFEST_NAME}"
    )


def read_manifest(output_uri: str, env: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The published manifest under an output prefix, or None."""
    return read_json(manifest_uri(output_uri), env)
