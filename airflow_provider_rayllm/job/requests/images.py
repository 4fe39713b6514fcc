"""Images for the multimodal stage: image cells (bytes, paths, bucket URIs, URLs) and the guide's image parts
as data: URLs, read with a size cap and never from the cluster's own network unless allowed."""

from __future__ import annotations

from typing import Any

from airflow_provider_rayllm.job.stream import is_empty


def is_image(value: Any) -> bool:
    """A PIL image (the guide's VLM preprocess puts ``Image.open(...)`` into the message)."""
    return all(hasattr(value, name) for name in ("save", "mode", "size", "getexif"))


def image_data_url(image: Any) -> str:
    """A PIL image as a PNG data: URL, which Ray's multimodal stage and OpenAI-style servers take where the
    image goes."""
    import base64
    import io as _io

    buffer = _io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def guide_image_parts(request: dict[str, Any]) -> None:
    """The guide's image parts (``{"type": "image", "image": <PIL image or URL>}``), in place, as the
    ``image_url`` parts that vLLM's chat parser (0.3x no longer knows ``image``) and OpenAI-style servers take."""
    for message in request.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for i, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image" and "image" in part:
                image = part["image"]
                url = image_data_url(image) if is_image(image) else image
                content[i] = {"type": "image_url", "image_url": {"url": url}}


_IMAGE_FORMATS = {
    "PNG": "image/png",
    "JPEG": "image/jpeg",
    "GIF": "image/gif",
    "WEBP": "image/webp",
    "BMP": "image/bmp",
}


# Seconds one image URL may take in all (connect, headers, body): a server that drips one byte at a time
# keeps each read inside a per-read timeout, so only a total deadline ends it.
FETCH_DEADLINE_S = 60.0
_READ_CHUNK = 1 << 16


def _resolve_checked(url: str, allow_private: bool) -> tuple[str, str, int]:
    """(host, the address to connect to, port). A URL the job fetches must reach a globally routable address
    (``ipaddress.is_global``: not loopback, link-local such as a cloud metadata endpoint, private, shared
    (100.64.0.0/10) or reserved ranges) unless the task allows private hosts. The name is resolved once here,
    and the fetch connects to this address: a second lookup could answer otherwise."""
    import ipaddress
    import socket
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        addresses = [info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
    except OSError as exc:
        raise ValueError(f"image URL host {host!r} does not resolve: {exc}") from None
    if not addresses:
        raise ValueError(f"image URL host {host!r} does not resolve")
    if not allow_private:
        for address in addresses:
            if not ipaddress.ip_address(address.split("%")[0]).is_global:
                raise ValueError(
                    f"image URL {url!r} points at {address}, which is not a public address (loopback, link-local, "
                    "private, shared or reserved); set image_allow_private_hosts=True to fetch from such hosts"
                )
    return host, addresses[0], port


def _read_capped(stream: Any, limit: int, what: str) -> bytes:
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{what} is larger than image_max_bytes={limit}")
    return data


def _fetch(url: str, limit: int, allow_private: bool) -> bytes:
    """The body of an http(s) image URL: at most ``limit`` bytes, within ``FETCH_DEADLINE_S`` in all, from the
    address that was checked; redirects are not followed (one could lead to a private host)."""
    import http.client
    import socket
    import ssl
    import time
    import urllib.parse

    deadline = time.monotonic() + FETCH_DEADLINE_S
    host, address, port = _resolve_checked(url, allow_private)
    parts = urllib.parse.urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")

    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ValueError(f"image {url!r} took longer than {FETCH_DEADLINE_S:.0f} s to fetch")
        return left

    class Pinned(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.create_connection((address, port), timeout=min(30.0, remaining()))

    class PinnedTLS(http.client.HTTPSConnection):
        def connect(self) -> None:
            sock = socket.create_connection((address, port), timeout=min(30.0, remaining()))
            self.sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)

    connection = (PinnedTLS if parts.scheme == "https" else Pinned)(host, port, timeout=min(30.0, remaining()))
    try:
        connection.request("GET", target, headers={"User-Agent": "airflow-provider-rayllm", "Host": parts.netloc})
        resp = connection.getresponse()
        if resp.status >= 300:
            kind = "a redirect, which is not followed" if 300 <= resp.status < 400 else "an error"
            raise ValueError(f"image {url!r}: HTTP {resp.status} ({kind})")
        length = resp.getheader("Content-Length")
        if length and length.isdigit() and int(length) > limit:
            raise ValueError(f"image {url!r} is {length} bytes, larger than image_max_bytes={limit}")
        chunks, size = [], 0
        while True:
            if connection.sock is not None:
                connection.sock.settimeout(min(30.0, remaining()))
            chunk = resp.read1(_READ_CHUNK)
            if not chunk:
                break
            size += len(chunk)
            if size > limit:
                raise ValueError(f"image {url!r} is larger than image_max_bytes={limit}")
            chunks.append(chunk)
            remaining()
        return b"".join(chunks)
    except (http.client.HTTPException, OSError) as exc:
        remaining()  # a read that timed out at the deadline says so
        raise ValueError(f"image {url!r} cannot be fetched: {type(exc).__name__}: {exc}") from None
    finally:
        connection.close()


def _normalized(location: str) -> str:
    """A path or bucket URI in one form for prefix checks: local paths absolute with `..` resolved; bucket
    URIs as written, refused when they hold a `..` segment (object keys take it literally, readers may not)."""
    import os.path

    if "://" in location and not location.startswith("file://"):
        if "/../" in location + "/" or "/./" in location + "/":
            raise ValueError(f"image {location!r}: '..' and '.' segments are not allowed in a bucket URI")
        return location.rstrip("/")
    return os.path.normpath(os.path.abspath(location.removeprefix("file://")))


def check_image_location(location: str, prefixes: list[str]) -> None:
    """An image path or bucket URI must lie under one of ``prefixes`` (folders, compared segment by segment)."""
    where = _normalized(location)
    for prefix in prefixes:
        base = _normalized(prefix)
        if where == base or where.startswith(base.rstrip("/") + "/"):
            return
    raise ValueError(
        f"image {location!r} is outside image_path_prefixes {prefixes!r}; add its folder to "
        "image_path_prefixes to read images from there"
    )


def image_url(
    value: Any, max_bytes: int = 20 << 20, allow_private: bool = False, path_prefixes: list[str] | None = None
) -> str:
    """An image cell as a data: URL for the engine's multimodal stage. Bytes, paths, bucket URIs and http(s)
    URLs are read here, at most ``max_bytes`` each (a URL's host must be public unless ``allow_private``; a
    path or bucket URI must lie under ``path_prefixes`` when given), and checked to be an image; a data: URL
    passes as it is."""
    import base64
    import io as _io

    if isinstance(value, dict) and "bytes" in value:  # the {bytes, path} struct of image datasets
        value = value["bytes"] if value["bytes"] is not None else value.get("path")
    if is_empty(value):
        raise ValueError("the image cell is empty")
    if isinstance(value, str):
        if value.startswith("data:image/"):
            return value
        if value.startswith(("http://", "https://")):
            value = _fetch(value, max_bytes, allow_private)
        else:
            from airflow_provider_rayllm.job import filesystems

            if path_prefixes is not None:
                check_image_location(value, path_prefixes)
            fs, path = filesystems.filesystem_for(value)
            try:
                with fs.open_input_stream(path) as stream:
                    value = _read_capped(stream, max_bytes, f"image {value!r}")
            except OSError as exc:
                raise ValueError(f"image {value!r} cannot be read: {exc}") from None
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise ValueError(f"the image cell holds {type(value).__name__}, not bytes, a path or a URL")
    data = bytes(value)
    if len(data) > max_bytes:
        raise ValueError(f"the image is {len(data)} bytes, larger than image_max_bytes={max_bytes}")
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(_io.BytesIO(data)) as image:
            image.verify()
            kind = _IMAGE_FORMATS.get(image.format or "")
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise ValueError(f"not a readable image ({len(data)} bytes): {exc}") from None
    if kind is None:
        raise ValueError("image format is not one of PNG, JPEG, GIF, WEBP, BMP")
    return f"data:{kind};base64,{base64.b64encode(data).decode('ascii')}"
