"""Rows become requests; a row that cannot be prompted becomes an error, not a crash."""

import json
import time

import pytest

from airflow_provider_rayllm.contract.names import REQUEST_KEY_COLUMN
from airflow_provider_rayllm.contract.spec import PromptSpec
from airflow_provider_rayllm.job.requests.keys import KEY_CHARS
from airflow_provider_rayllm.job.requests.prompts import RequestBuilder
from airflow_provider_rayllm.job.stream import KEPT_INPUT, PRE_ERROR, REQUEST


def build(prompt: dict, task_type="generate", keep=("id", "q")):
    return RequestBuilder(PromptSpec(**prompt), task_type, list(keep), package_dir="/nonexistent")


def test_prompt_column_with_system_prompt():
    out = build({"prompt_column": "q", "system_prompt": "Be brief.", "sampling_params": {"max_tokens": 5}})(
        {"id": 1, "q": "Why?"}
    )
    request = json.loads(out[REQUEST])
    assert request["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
    assert request["sampling_params"] == {"max_tokens": 5}
    kept = dict(out[KEPT_INPUT])
    assert len(kept.pop(REQUEST_KEY_COLUMN)) == KEY_CHARS, "every request carries its key beside the kept columns"
    assert kept == {"id": 1, "q": "Why?"}
    assert out[PRE_ERROR] == ""


def test_template_uses_columns():
    out = build({"template": "Summarize {q} (id {id})"})({"id": 7, "q": "text"})
    assert json.loads(out[REQUEST])["messages"][-1]["content"] == "Summarize text (id 7)"


def test_empty_column_is_an_error_row_not_an_exception():
    out = build({"prompt_column": "q"})({"id": 2, "q": None})
    assert out[PRE_ERROR].startswith("prompt: ValueError: column 'q' is empty")
    assert out[KEPT_INPUT]["id"] == 2


def test_nan_from_a_reader_counts_as_empty():
    out = build({"template": "About {q}"})({"id": 2, "q": float("nan")})
    assert "template column(s) ['q'] are empty" in out[PRE_ERROR]


def test_non_text_prompt_is_an_error_row():
    out = build({"prompt_column": "q"})({"id": 3, "q": 42})
    assert "holds int, not text" in out[PRE_ERROR]


def test_embed_requests_use_prompt_not_messages():
    out = build({"prompt_column": "q", "pooling_params": {"normalize": True}}, task_type="embed")({"id": 1, "q": "hi"})
    assert json.loads(out[REQUEST]) == {"prompt": "hi", "pooling_params": {"normalize": True}}


def test_messages_column_passes_through():
    msgs = [{"role": "user", "content": "hello"}]
    out = build({"messages_column": "m"}, keep=["m"])({"m": msgs})
    assert json.loads(out[REQUEST])["messages"] == msgs


def test_import_path_preprocess_is_used():
    out = build({"preprocess": {"import_path": "tests.unit.helpers:to_request"}})({"id": 1, "q": "x"})
    assert json.loads(out[REQUEST]) == {
        "messages": [{"role": "user", "content": "X"}],
        "sampling_params": {"max_tokens": 3},
    }


def test_preprocess_returning_non_dict_is_an_error_row():
    out = build({"preprocess": {"import_path": "tests.unit.helpers:bad_request"}})({"id": 1, "q": "x"})
    assert "returned list, not a dict" in out[PRE_ERROR]


def test_structured_output_names_are_normalized():
    from airflow_provider_rayllm.job.requests.sampling import normalize_sampling_params

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert normalize_sampling_params({"max_tokens": 5, "guided_json": schema}) == {
        "max_tokens": 5,
        "structured_outputs": {"json": json.dumps(schema)},
    }
    assert normalize_sampling_params({"guided_decoding": {"choice": ["x", "y"]}}) == {
        "structured_outputs": {"choice": ["x", "y"]}
    }
    assert normalize_sampling_params({"temperature": 0}) == {"temperature": 0}


def test_bad_sampling_params_are_refused_before_the_engine():
    from airflow_provider_rayllm.job.engines.vllm.checks import check_sampling_params
    from airflow_provider_rayllm.job.errors import JobError

    check_sampling_params({"max_tokens": 4, "structured_outputs": {"regex": "[0-9]+"}})
    with pytest.raises(JobError, match="max_tokenz"):
        check_sampling_params({"max_tokenz": 4})
    with pytest.raises(JobError, match="temperature must be non-negative"):
        check_sampling_params({"temperature": -1})


def test_lora_routing_by_row():
    from airflow_provider_rayllm.job.requests.lora import LoraRouting

    local = LoraRouting("/models/base", "/adapters/", ["pirate", "formal"])
    assert local.model_for(None) == "/models/base"
    assert local.model_for("") == "/models/base"
    assert local.model_for("pirate") == "/adapters/pirate"
    with pytest.raises(ValueError, match="not one of lora_adapters"):
        local.model_for("casual")
    bucket = LoraRouting("/models/base", "s3://b/adapters", None)
    assert bucket.model_for("casual") == "casual"  # Ray downloads it from the bucket by name
    with pytest.raises(ValueError, match="plain folder name"):
        bucket.model_for("../etc")


def test_unknown_adapter_is_an_error_row():
    from airflow_provider_rayllm.job.requests.lora import LoraRouting

    builder = RequestBuilder(
        PromptSpec(prompt_column="q", lora_column="adapter"),
        "generate",
        ["q", "adapter"],
        "/x",
        LoraRouting("/m", "/adapters", ["a1"]),
    )
    ok = json.loads(builder({"q": "hi", "adapter": "a1"})[REQUEST])
    assert ok["model"] == "/adapters/a1"
    assert json.loads(builder({"q": "hi", "adapter": None})[REQUEST])["model"] == "/m"
    assert "not one of lora_adapters" in builder({"q": "hi", "adapter": "zz"})[PRE_ERROR]


def _png(color=(200, 10, 10)) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buf, format="PNG")
    return buf.getvalue()


def test_image_cells_become_data_urls(tmp_path):
    import base64

    from airflow_provider_rayllm.job.requests.images import image_url

    data = _png()
    expected = "data:image/png;base64," + base64.b64encode(data).decode()
    assert image_url(data) == expected
    assert image_url({"bytes": data, "path": None}) == expected
    (tmp_path / "a.png").write_bytes(data)
    assert image_url(str(tmp_path / "a.png")) == expected
    assert image_url(expected) == expected


def test_an_image_url_is_fetched_with_a_cap_and_never_from_the_clusters_own_network():
    """A URL in the data is fetched by the job itself: from loopback, link-local (cloud metadata) or private
    addresses only when the task allows it, and never more than image_max_bytes."""
    import base64
    import http.server
    import threading

    from airflow_provider_rayllm.job.requests.images import image_url

    data = _png()

    class Serve(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = data if self.path == "/cat.png" else b"x" * 4096
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Serve)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(ValueError, match="not a public address"):
            image_url(f"{base}/cat.png")
        with pytest.raises(ValueError, match="169.254.169.254"):
            image_url("http://169.254.169.254/latest/meta-data/")
        fetched = image_url(f"{base}/cat.png", allow_private=True)
        assert fetched == "data:image/png;base64," + base64.b64encode(data).decode()
        with pytest.raises(ValueError, match="larger than image_max_bytes=1000"):
            image_url(f"{base}/big.png", max_bytes=1000, allow_private=True)
    finally:
        server.shutdown()


@pytest.mark.parametrize("address", ["100.64.0.1", "100.100.100.200", "192.0.2.7", "10.1.2.3", "[::1]"])
def test_only_globally_routable_addresses_are_fetched(address):
    """Shared (100.64.0.0/10, where one cloud keeps its metadata endpoint at 100.100.100.200), documentation
    and private ranges are refused as loopback is, before any connection."""
    from airflow_provider_rayllm.job.requests.images import image_url
    from tests.integration.helpers import record_figure

    with pytest.raises(ValueError, match="not a public address"):
        image_url(f"http://{address}/cat.png")
    record_figure("image_fetch_not_public", merge=True, **{f"refused {address}": True})


def _dripping_server(interval_s: float):
    """A server that answers at once and then sends its body one byte every ``interval_s``."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
            try:
                for _ in range(100000):
                    conn.sendall(b"x")
                    time.sleep(interval_s)
            except OSError:
                pass

    threading.Thread(target=serve, daemon=True).start()
    return listener


def test_a_server_that_drips_one_byte_at_a_time_is_an_error_row_in_bounded_time(monkeypatch):
    from airflow_provider_rayllm.job.requests import images

    monkeypatch.setattr(images, "FETCH_DEADLINE_S", 1.5)
    listener = _dripping_server(0.05)
    started = time.monotonic()
    try:
        with pytest.raises(ValueError, match="took longer than 2 s"):
            images.image_url(f"http://127.0.0.1:{listener.getsockname()[1]}/cat.png", allow_private=True)
    finally:
        listener.close()
    seconds = time.monotonic() - started
    assert seconds < 5
    from tests.integration.helpers import record_figure

    record_figure("image_server_drips", seconds_to_error=round(seconds, 2), deadline_s=images.FETCH_DEADLINE_S)


def test_the_fetch_connects_to_the_address_it_checked(monkeypatch):
    """The host is resolved once: a second lookup that answers another address (DNS rebinding) is never made."""
    import base64
    import http.server
    import socket
    import threading

    from airflow_provider_rayllm.job.requests.images import image_url

    data = _png()

    class Serve(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            assert self.headers["Host"].startswith("images.example.test")
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Serve)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    answers = iter(["127.0.0.1", "10.9.9.9"])
    real = socket.getaddrinfo

    def resolve(host, *args, **kwargs):
        if host != "images.example.test":  # an address (the connection's own lookup of a literal)
            return real(host, *args, **kwargs)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (next(answers), port))]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    try:
        fetched = image_url(f"http://images.example.test:{port}/cat.png", allow_private=True)
    finally:
        server.shutdown()
    assert fetched == "data:image/png;base64," + base64.b64encode(data).decode()
    assert next(answers) == "10.9.9.9", "resolved once"


def test_an_endless_file_is_an_error_not_an_out_of_memory():
    from airflow_provider_rayllm.job.requests.images import image_url

    with pytest.raises(ValueError, match="larger than image_max_bytes=65536"):
        image_url("/dev/zero", max_bytes=65536)


@pytest.mark.parametrize(
    "cell, message",
    [
        (b"\x89PNG not an image", "not a readable image"),
        (None, "empty"),
        (42, "holds int"),
        ("/no/such/picture.png", "cannot be read"),
    ],
)
def test_a_bad_image_cell_is_refused_with_its_reason(cell, message):
    from airflow_provider_rayllm.job.requests.images import image_url

    with pytest.raises(ValueError, match=message):
        image_url(cell)


def test_the_image_goes_before_the_text_in_the_user_message_and_a_bad_one_is_an_error_row(tmp_path):
    import json as _json

    from airflow_provider_rayllm.contract.spec import PromptSpec
    from airflow_provider_rayllm.job.requests.prompts import RequestBuilder
    from airflow_provider_rayllm.job.stream import PRE_ERROR, REQUEST

    prompt = PromptSpec(prompt_column="q", image_column="img", system_prompt="Be brief.")
    builder = RequestBuilder(prompt, "generate", ["id"], str(tmp_path))
    good = builder({"id": 1, "q": "What color?", "img": _png()})
    assert good[PRE_ERROR] == ""
    messages = _json.loads(good[REQUEST])["messages"]
    assert messages[0] == {"role": "system", "content": "Be brief."}
    image, text = messages[1]["content"]
    assert image["type"] == "image_url" and image["image_url"]["url"].startswith("data:image/png;base64,")
    assert text == {"type": "text", "text": "What color?"}
    bad = builder({"id": 2, "q": "What color?", "img": b"junk"})
    assert "not a readable image" in bad[PRE_ERROR]


def test_image_column_is_for_generation_with_a_prompt_column_or_template():
    from airflow_provider_rayllm.contract.spec import PromptSpec, SpecError, parse_spec

    with pytest.raises(ValueError, match="image_column works with prompt_column or template"):
        PromptSpec(messages_column="m", image_column="img")
    body = {
        "source": {"uris": ["/in.jsonl"]},
        "prompt": {"prompt_column": "q", "image_column": "img"},
        "sink": {"uri": "/out"},
        "processor": {"model_source": "/m", "task_type": "embed"},
    }
    with pytest.raises(SpecError, match="image_column needs task_type 'generate'"):
        parse_spec(json.dumps(body))


def test_the_guides_pil_image_part_becomes_an_image_url_part_the_engine_takes():
    import base64

    from airflow_provider_rayllm.job.engines.vllm.processor import unpack_request

    out = build({"preprocess": {"import_path": "tests.unit.helpers:guide_image_request"}})(
        {"id": 1, "q": "What color?", "image": {"bytes": _png()}}
    )
    assert out[PRE_ERROR] == ""
    text, image = json.loads(out[REQUEST])["messages"][0]["content"]
    assert text == {"type": "text", "text": "What color?"}
    assert image["type"] == "image_url" and image["image_url"]["url"].startswith("data:image/png;base64,")
    assert base64.b64decode(image["image_url"]["url"].split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    # The engine makes the text itself (no detokenize stage): the guide's detokenize=False is dropped there.
    assert "detokenize" not in unpack_request(dict(out))["sampling_params"]
    assert unpack_request(dict(out), engine_detokenizes=False)["sampling_params"]["detokenize"] is False


@pytest.mark.parametrize(
    "location, prefixes, allowed",
    [
        ("/data/images/a.png", ["/data/images"], True),
        ("/data/images/sub/a.png", ["/data/images/"], True),
        ("/data/images/../secrets/a.png", ["/data/images"], False),
        ("/data/images2/a.png", ["/data/images"], False),
        ("/root/.ray/auth_token", ["/data/images"], False),
        ("file:///data/images/a.png", ["/data/images"], True),
        ("s3://bucket/images/a.png", ["s3://bucket/images"], True),
        ("s3://bucket/imagesX/a.png", ["s3://bucket/images"], False),
        ("s3://other/images/a.png", ["s3://bucket/images"], False),
        ("s3://bucket/images/../private/a.png", ["s3://bucket/images"], False),
        ("/data/images/a.png", [], False),
    ],
)
def test_image_paths_are_read_only_under_the_allowed_prefixes(location, prefixes, allowed):
    from airflow_provider_rayllm.job.requests.images import check_image_location

    if allowed:
        check_image_location(location, prefixes)
    else:
        with pytest.raises(ValueError, match="image_path_prefixes|segments are not allowed"):
            check_image_location(location, prefixes)


def test_an_image_path_outside_the_inputs_folder_is_an_error_row_and_inside_is_read(tmp_path):
    import json as _json

    from airflow_provider_rayllm.contract.spec import PromptSpec
    from airflow_provider_rayllm.job.requests.prompts import RequestBuilder
    from airflow_provider_rayllm.job.sources import input_folders
    from airflow_provider_rayllm.job.stream import PRE_ERROR, REQUEST

    data = tmp_path / "data"
    data.mkdir()
    (data / "red.png").write_bytes(_png())
    elsewhere = tmp_path / "elsewhere.png"
    elsewhere.write_bytes(_png())
    folders = input_folders([str(data / "rows.jsonl")], [str(data / "rows.jsonl")])
    assert folders == [str(data)]
    prompt = PromptSpec(prompt_column="q", image_column="img", image_path_prefixes=folders)
    builder = RequestBuilder(prompt, "generate", ["id"], str(tmp_path))
    inside = builder({"id": 1, "q": "What color?", "img": str(data / "red.png")})
    assert inside[PRE_ERROR] == "" and _json.loads(inside[REQUEST])["messages"][0]["content"][0]["type"] == "image_url"
    outside = builder({"id": 2, "q": "What color?", "img": str(elsewhere)})
    assert "outside image_path_prefixes" in outside[PRE_ERROR]
    from tests.integration.helpers import record_figure

    rows = [inside, outside]
    record_figure(
        "image_path_outside_prefixes",
        rows=len(rows),
        read=sum(r[PRE_ERROR] == "" for r in rows),
        error_rows=sum(bool(r[PRE_ERROR]) for r in rows),
    )


@pytest.mark.parametrize(
    "uris, files, expected",
    [
        (["/in/rows.jsonl"], ["/in/rows.jsonl"], ["/in"]),
        (["/in"], ["/in/a.jsonl", "/in/b.jsonl"], ["/in"]),
        (["/in/2026-*/part-*.parquet"], ["/in/2026-01/part-0.parquet"], ["/in"]),
        (["s3://b/in/"], ["s3://b/in/a.parquet"], ["s3://b/in"]),
        (["s3://b/in/rows.parquet"], ["s3://b/in/rows.parquet"], ["s3://b/in"]),
        (["file:///in/rows.jsonl"], ["/in/rows.jsonl"], ["file:///in"]),
    ],
)
def test_the_inputs_folders(uris, files, expected):
    from airflow_provider_rayllm.job.sources import input_folders

    assert input_folders(uris, files) == expected
