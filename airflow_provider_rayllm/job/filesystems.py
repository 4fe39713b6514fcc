"""Storage through pyarrow filesystems (local paths, s3://, gs://): paths, listings, whole-file writes."""

from __future__ import annotations

import os
import posixpath
import uuid
from typing import Any, Mapping

import pyarrow.fs as pafs

from airflow_provider_rayllm.contract import storage
from airflow_provider_rayllm.contract.spec import uri_scheme
from airflow_provider_rayllm.job.errors import JobError


def filesystem_for(uri: str, env: Mapping[str, str] | None = None) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem for ``uri`` and the path inside it; settings from ``env`` (default: os.environ)."""
    try:
        return storage.filesystem_for(uri, env)
    except storage.StorageError as exc:
        raise JobError(str(exc)) from None


def join(base: str, *parts: str) -> str:
    if uri_scheme(base) == "file":
        return os.path.join(base, *parts)
    return posixpath.join(base, *parts)


def files_in(fs: pafs.FileSystem, path: str) -> list[pafs.FileInfo]:
    """The files (not folders) under ``path`` in ``fs``, at any depth; none where it does not exist."""
    selector = pafs.FileSelector(path, recursive=True, allow_not_found=True)
    return [info for info in fs.get_file_info(selector) if info.type == pafs.FileType.File]


def files_under(fs: pafs.FileSystem, root: str) -> dict[str, int]:
    """The files under ``root`` in ``fs``: path relative to it -> size."""
    return {info.path[len(root) :].lstrip("/"): info.size for info in files_in(fs, root)}


def list_files(uri: str) -> list[dict[str, Any]]:
    """Files under ``uri`` with their sizes, as URIs in the caller's scheme."""
    fs, path = filesystem_for(uri)
    scheme = uri_scheme(uri)
    prefix = "" if scheme == "file" else f"{scheme}://"
    return sorted(({"uri": prefix + i.path, "bytes": i.size} for i in files_in(fs, path)), key=lambda f: f["uri"])


def write_bytes_atomic(uri: str, data: bytes, content_type: str | None = None) -> None:
    """Readers never see half a file: local writes go through a rename, object stores put whole objects
    (with ``content_type``, so that a browser shows a page the store serves)."""
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
        metadata = {"Content-Type": content_type} if content_type else None
        with fs.open_output_stream(path, metadata=metadata) as out:
            out.write(data)


def write_text_atomic(uri: str, text: str) -> None:
    write_bytes_atomic(uri, text.encode())


def read_json(uri: str, env: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    return storage.read_json(uri, env)


# Removing a folder lists its objects, then deletes each: one that another step removed between the two (on the
# GCS emulator, an object the publish had just moved away) answers NOT_FOUND. Gone is what was asked, so the
# folder is listed again, a few times at most.
DELETE_DIR_TRIES = 3


def delete_dir(uri: str) -> None:
    """A folder and everything under it, if it is there."""
    fs, path = filesystem_for(uri)
    for attempt in range(1, DELETE_DIR_TRIES + 1):
        if fs.get_file_info(path).type == pafs.FileType.NotFound:
            return
        try:
            fs.delete_dir(path)
            return
        except FileNotFoundError:
            if attempt == DELETE_DIR_TRIES:
                raise


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


def list_top(uri: str) -> list[str]:
    """The names of the files directly under ``uri`` (not in its subfolders)."""
    fs, path = filesystem_for(uri)
    selector = pafs.FileSelector(path, recursive=False, allow_not_found=True)
    return sorted(posixpath.basename(i.path) for i in fs.get_file_info(selector) if i.type == pafs.FileType.File)


def exists(uri: str) -> bool:
    fs, path = filesystem_for(uri)
    return bool(fs.get_file_info(path).type != pafs.FileType.NotFound)


def delete_file(uri: str) -> None:
    """One file, if it is there."""
    fs, path = filesystem_for(uri)
    if fs.get_file_info(path).type == pafs.FileType.File:
        try:
            fs.delete_file(path)
        except FileNotFoundError:  # removed by another step since it was looked at: gone, as asked
            pass


def move_file(source: str, target: str) -> None:
    """One file to another place of the same store: a rename on local disks, a server-side copy and a delete
    of the original on object stores (a reader of the target sees the whole file or none)."""
    fs, src = filesystem_for(source)
    _, dst = filesystem_for(target)
    local = uri_scheme(target) == "file"
    fs.create_dir(os.path.dirname(dst) if local else posixpath.dirname(dst), recursive=True)
    if local:
        os.replace(src, dst)
        return
    fs.copy_file(src, dst)
    fs.delete_file(src)
