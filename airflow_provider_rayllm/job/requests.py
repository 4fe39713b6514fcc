"""Rows -> requests: the first step after the read, declaratively or with the user's callable.

Every row leaves this step with three columns: the input columns it keeps (``STASH``), its request as
JSON (``REQUEST``) and, for a row that cannot be prompted, why (``PRE_ERROR``; the engines pass such a
row through untouched, so it reaches the sink as an error row in the same stream).
"""

from __future__ import annotations

import importlib
import json
import math
import os
from typing import Any, Callable

from airflow_provider_rayllm.contract.spec import CallableRef, PromptSpec
from airflow_provider_rayllm.job.errors import JobError

# Columns the job carries through Ray's stages; input columns are stashed so the engine's own
# output columns (``prompt``, ``messages``...) cannot overwrite them.
STASH = "__rayllm_in"
REQUEST = "__rayllm_request"
PRE_ERROR = "__rayllm_pre_error"


def load_callable(ref: CallableRef, package_dir: str) -> Callable[[dict], dict]:
    if ref.import_path:
        module_name, _, attr = ref.import_path.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise JobError(f"cannot import callable {ref.import_path!r} on the cluster: {exc}") from exc
        return obj
    import cloudpickle

    path = os.path.join(package_dir, str(ref.pickled))
    try:
        with open(path, "rb") as handle:
            return cloudpickle.load(handle)
    except Exception as exc:
        raise JobError(
            f"cannot load the pickled callable {ref.pickled!r}: {exc}. Callables pickled by the Airflow "
            "worker need the same Python version and the modules they use on the cluster"
        ) from exc


def _is_empty(value: Any) -> bool:
    # A JSON null or an empty CSV cell can arrive as None or as NaN, depending on the reader.
    return value is None or (isinstance(value, float) and math.isnan(value))


def _is_image(value: Any) -> bool:
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
                url = image_data_url(image) if _is_image(image) else image
                content[i] = {"type": "image_url", "image_url": {"url": url}}


def _jsonable(value: Any) -> Any:
    """Numpy values from Arrow rows become plain Python for the JSON request, and images data: URLs."""
    if _is_image(value):
        return image_data_url(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


# Older names of the structured-output settings, still common in user code and docs.
_GUIDED_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def normalize_sampling_params(params: dict[str, Any]) -> dict[str, Any]:
    """Structured outputs in vLLM's current form, with a JSON schema as text.

    A schema travels as a string so rows with different schemas can share one Arrow column.
    """
    params = dict(params)
    structured = dict(params.pop("structured_outputs", None) or params.pop("guided_decoding", None) or {})
    for old, new in _GUIDED_KEYS.items():
        if old in params:
            structured[new] = params.pop(old)
    if isinstance(structured.get("json"), dict):
        structured["json"] = json.dumps(structured["json"])
    if structured:
        params["structured_outputs"] = structured
    return params


class LoraRouting:
    """Which model a row asks for: the base model, or a LoRA adapter by name.

    Ray's engine stage reads the row's ``model``: the base model's source means no adapter; an adapter
    under a bucket is named and downloaded by Ray; a local adapter is given by its folder.
    """

    def __init__(self, model_source: str, adapters_path: str, allowed: list[str] | None):
        self.model_source = model_source
        self.adapters_path = adapters_path.rstrip("/")
        self.local = "://" not in adapters_path
        self.allowed = set(allowed) if allowed is not None else None

    def model_for(self, name: Any) -> str:
        if _is_empty(name) or name == "":
            return self.model_source
        if not isinstance(name, str):
            raise ValueError(f"LoRA adapter column holds {type(name).__name__}, not a name")
        if self.allowed is not None and name not in self.allowed:
            raise ValueError(f"LoRA adapter {name!r} is not one of lora_adapters {sorted(self.allowed)!r}")
        if "/" in name or name.startswith("."):
            raise ValueError(f"LoRA adapter name {name!r} must be a plain folder name")
        return os.path.join(self.adapters_path, name) if self.local else name


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
    if _is_empty(value):
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


class RequestBuilder:
    """Row -> {stash, request JSON, error}. A row that cannot be turned into a request becomes an error row."""

    def __init__(
        self,
        prompt: PromptSpec,
        task_type: str,
        keep: list[str],
        package_dir: str,
        lora: LoraRouting | None = None,
    ):
        self.prompt = prompt
        self.task_type = task_type
        self.keep = keep
        self.lora = lora
        self.preprocess = load_callable(prompt.preprocess, package_dir) if prompt.preprocess else None
        self.sampling_params = normalize_sampling_params(prompt.sampling_params)
        self.pooling_params = dict(prompt.pooling_params) if prompt.pooling_params else None

    def _text(self, row: dict[str, Any]) -> str:
        p = self.prompt
        if p.prompt_column is not None:
            value = row.get(p.prompt_column)
            if _is_empty(value):
                raise ValueError(f"column {p.prompt_column!r} is empty")
            if isinstance(value, (bytes, bytearray)):
                try:
                    return bytes(value).decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise ValueError(
                        f"column {p.prompt_column!r} holds bytes that are not UTF-8 text ({bytes(value)[:40]!r}: "
                        f"{exc.reason} at offset {exc.start}); re-encode the input as UTF-8"
                    ) from None
            if not isinstance(value, str):
                raise ValueError(f"column {p.prompt_column!r} holds {type(value).__name__}, not text")
            return value
        assert p.template is not None
        missing = [c for c in p.template_columns() if _is_empty(row.get(c))]
        if missing:
            raise ValueError(f"template column(s) {missing!r} are empty")
        return p.template.format(**row)

    def request(self, row: dict[str, Any]) -> dict[str, Any]:
        p = self.prompt
        if self.preprocess is not None:
            request = self.preprocess(dict(row))
            if not isinstance(request, dict):
                raise ValueError(f"preprocess returned {type(request).__name__}, not a dict")
            if isinstance(request.get("sampling_params"), dict):
                request["sampling_params"] = normalize_sampling_params(request["sampling_params"])
            guide_image_parts(request)
            return request
        request: dict[str, Any] = {}
        if self.task_type == "generate":
            if p.messages_column is not None:
                messages = _jsonable(row.get(p.messages_column))
                if not isinstance(messages, list) or not messages:
                    raise ValueError(f"column {p.messages_column!r} holds no chat messages")
            else:
                messages = []
                if p.system_prompt:
                    messages.append({"role": "system", "content": p.system_prompt})
                text = self._text(row)
                if p.image_column is not None:
                    url = image_url(row.get(p.image_column), p.image_max_bytes, p.image_allow_private_hosts)
                    messages.append(
                        {
                            "role": "user",
                            "content": [
                                {"type": "image_url", "image_url": {"url": url}},
                                {"type": "text", "text": text},
                            ],
                        }
                    )
                else:
                    messages.append({"role": "user", "content": text})
            request["messages"] = messages
            request["sampling_params"] = self.sampling_params
        else:
            request["prompt"] = self._text(row)
            if self.pooling_params:
                request["pooling_params"] = self.pooling_params
        return request

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        stash = {name: row.get(name) for name in self.keep}
        try:
            body = self.request(row)
            if self.lora is not None:
                body["model"] = self.lora.model_for(row.get(self.prompt.lora_column or ""))
            request = json.dumps(_jsonable(body))
            error = ""
        except Exception as exc:  # one bad row must not stop the job
            request, error = "{}", f"prompt: {type(exc).__name__}: {exc}"
        return {STASH: stash, REQUEST: request, PRE_ERROR: error}


class RequestStage:
    """Ray Data stage: a batch of input rows -> their requests, counted into the job's tally as read.

    With ``id_column`` it also refuses a duplicate or missing id (the uniqueness check, done as the rows
    stream by) and drops the rows an earlier attempt of this run already answered (resume). Holding the
    ids needs one place that sees every row, so with ``id_column`` the stage runs as a single actor; the
    ids live there, never in the driver.
    """

    def __init__(
        self,
        prompt: PromptSpec,
        task_type: str,
        keep: list[str],
        package_dir: str,
        tally: Any,
        lora: LoraRouting | None = None,
        saved_files: list[str] | None = None,
    ):
        self.builder = RequestBuilder(prompt, task_type, keep, package_dir, lora)
        self.tally = tally
        self.ids = IdGate(prompt.id_column, saved_files or [], tally) if prompt.id_column else None
        self.calls: dict[str, int] = {}

    def __call__(self, batch: Any) -> dict[str, list[Any]]:
        rows = batch.to_pylist()
        from airflow_provider_rayllm.job.progress import call_key

        key = call_key(self.calls)
        if self.ids is not None:
            rows, skipped = self.ids.admit(rows)
        else:
            skipped = 0
        built = [self.builder(row) for row in rows]
        import ray

        ray.get(self.tally.read.remote(key, len(rows) + skipped, skipped))
        return {
            STASH: [b[STASH] for b in built],
            REQUEST: [b[REQUEST] for b in built],
            PRE_ERROR: [b[PRE_ERROR] for b in built],
        }


class IdGate:
    """Each id once (a repeat fails the job, naming it); ids answered by an earlier attempt are skipped."""

    def __init__(self, id_column: str, saved_files: list[str], tally: Any):
        from airflow_provider_rayllm.job.publish.resume import read_ids

        self.column = id_column
        self.saved = read_ids(saved_files, id_column)
        self.seen: set[Any] = set()
        import ray

        ray.get(tally.saved.remote(len(self.saved)))

    def admit(self, rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
        kept = []
        for row in rows:
            value = row.get(self.column)
            if _is_empty(value):
                raise JobError(
                    f"id_column {self.column!r}: a row has no id (value {value!r}); ids must be set and unique"
                )
            if value in self.seen:
                raise JobError(f"id_column {self.column!r} must be unique per row: {value!r} appears more than once")
            self.seen.add(value)
            if value not in self.saved:
                kept.append(row)
        return kept, len(rows) - len(kept)
