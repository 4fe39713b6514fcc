"""Reading sources and writing sinks through pyarrow filesystems (local paths, s3://, gs://)."""

from __future__ import annotations

import glob as globlib
import json
import os
import posixpath
from typing import Any, Mapping

import pyarrow.fs as pafs

from airflow_provider_rayllm.job.errors import JobError
from airflow_provider_rayllm.spec import FileSource, format_from_uri, uri_scheme


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


def _has_glob(path: str) -> bool:
    return any(ch in path for ch in "*?[")


def expand_source(source: FileSource) -> list[str]:
    """Every input file, in a stable order; a clear error when a path matches nothing."""
    files: list[str] = []
    for uri in source.uris:
        fs, path = filesystem_for(uri)
        scheme = uri_scheme(uri)
        prefix = "" if scheme == "file" else f"{scheme}://"
        if _has_glob(path):
            if scheme == "file":
                matched = sorted(p for p in globlib.glob(path, recursive=True) if os.path.isfile(p))
            else:
                base = path.split("*", 1)[0].rsplit("/", 1)[0]
                selector = pafs.FileSelector(base, recursive=True, allow_not_found=True)
                import fnmatch

                matched = sorted(
                    prefix + info.path
                    for info in fs.get_file_info(selector)
                    if info.type == pafs.FileType.File and fnmatch.fnmatch(info.path, path)
                )
            if not matched:
                raise JobError(f"source.uris: no file matches {uri!r}")
            files.extend(matched)
            continue
        try:
            info = fs.get_file_info(path)
        except Exception as exc:
            raise JobError(f"source.uris: cannot read {uri!r}: {exc}") from exc
        if info.type == pafs.FileType.NotFound:
            raise JobError(f"source.uris: {uri!r} does not exist")
        if info.type == pafs.FileType.Directory:
            selector = pafs.FileSelector(path, recursive=True)
            inner = sorted(
                prefix + i.path
                for i in fs.get_file_info(selector)
                if i.type == pafs.FileType.File and not posixpath.basename(i.path).startswith(("_", "."))
            )
            if not inner:
                raise JobError(f"source.uris: folder {uri!r} holds no data files")
            files.extend(inner)
        else:
            files.append(prefix + path if prefix else path)
    return files


def file_format(source: FileSource, files: list[str]) -> str:
    if source.format:
        return source.format
    formats = {format_from_uri(f) for f in files}
    if len(formats) != 1 or None in formats:
        shown = sorted(os.path.basename(f) for f in files)[:5]
        raise JobError(
            f"source.format: cannot infer one format from the files {shown!r}; "
            "set input_format to 'parquet', 'jsonl' or 'csv'"
        )
    return str(formats.pop())


def read_source(source: FileSource, files: list[str]) -> Any:
    """A lazy Ray dataset over the given files."""
    import ray.data

    fmt = file_format(source, files)
    kwargs: dict[str, Any] = {}
    fs, _ = filesystem_for(files[0])
    if uri_scheme(files[0]) != "file":
        kwargs["filesystem"] = fs
        files = [filesystem_for(f)[1] for f in files]
    if fmt == "parquet":
        if source.columns:
            kwargs["columns"] = source.columns
        return ray.data.read_parquet(files, **kwargs)
    if fmt == "jsonl":
        if "filesystem" in kwargs:
            # Ray 2.60's line reader takes no filesystem; pyarrow's JSON reader (the default one) reads
            # newline-delimited JSON and does.
            ds = ray.data.read_json(files, **kwargs)
        else:
            ds = ray.data.read_json(files, lines=True)
    else:
        ds = ray.data.read_csv(files, **kwargs)
    return ds.select_columns(source.columns) if source.columns else ds


def write_dataset(ds: Any, uri: str, fmt: str) -> None:
    fs, path = filesystem_for(uri)
    kwargs: dict[str, Any] = {"filesystem": fs}
    if fmt == "parquet":
        ds.write_parquet(path, **kwargs)
    else:
        ds.write_json(path, lines=True, **kwargs)


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
        tmp = path + ".tmp"
        with fs.open_output_stream(tmp) as out:
            out.write(data)
        os.replace(tmp, path)
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
