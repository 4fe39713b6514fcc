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


def _check_public_host(url: str, allow_private: bool) -> None:
    """A URL the job would fetch must not reach into the cluster's own network (loopback, link-local such
    as a cloud metadata endpoint, private ranges) unless the task allows it."""
    import ipaddress
    import socket
    import urllib.parse

    host = urllib.parse.urlsplit(url).hostname or ""
    if allow_private:
        return
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError as exc:
        raise ValueError(f"image URL host {host!r} does not resolve: {exc}") from None
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%")[0])
        if (
            ip.is_private
            or ip.is_loopback
            or ip.is_link_local
            or ip.is_reserved
            or ip.is_multicast
            or ip.is_unspecified
        ):
            raise ValueError(
                f"image URL {url!r} points at {address} (a loopback, link-local or private address); "
                "set image_allow_private_hosts=True to fetch from such hosts"
            )


def _read_capped(stream: Any, limit: int, what: str) -> bytes:
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{what} is larger than image_max_bytes={limit}")
    return data


def _fetch(url: str, limit: int, allow_private: bool) -> bytes:
    import urllib.error
    import urllib.request

    _check_public_host(url, allow_private)

    class NoRedirect(urllib.request.HTTPRedirectHandler):  # a redirect could lead to a private host
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(
            urllib.request.Request(url, headers={"User-Agent": "airflow-provider-rayllm"}), timeout=30
        ) as resp:
            length = resp.headers.get("Content-Length")
            if length and length.isdigit() and int(length) > limit:
                raise ValueError(f"image {url!r} is {length} bytes, larger than image_max_bytes={limit}")
            return _read_capped(resp, limit, f"image {url!r}")
    except urllib.error.HTTPError as exc:
        raise ValueError(f"image {url!r}: HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ValueError(f"image {url!r} cannot be fetched: {exc}") from None


def image_url(value: Any, max_bytes: int = 20 << 20, allow_private: bool = False) -> str:
    """An image cell as a data: URL for the engine's multimodal stage. Bytes, paths, bucket URIs and http(s)
    URLs are read here, at most ``max_bytes`` each (a URL's host must be public unless ``allow_private``),
    and checked to be an image; a data: URL passes as it is."""
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
