"""The `ray` connection is read into settings once; the token only travels as a header."""

import pytest
from airflow.sdk import Connection

from airflow_provider_rayllm.exceptions import RayLLMError
from airflow_provider_rayllm.hooks.ray_job import RayConnSettings, RayJobHook


def conn(**kw):
    return Connection(conn_id="ray_test", conn_type="ray", **kw)


def test_a_host_without_scheme_is_https_unless_it_is_this_machine():
    assert RayConnSettings.from_connection(conn(host="ray-head.svc", port=8265)).address == "https://ray-head.svc:8265"
    assert RayConnSettings.from_connection(conn(host="127.0.0.1", port=8265)).address == "http://127.0.0.1:8265"
    assert RayConnSettings.from_connection(conn(host="localhost", port=8265)).address == "http://localhost:8265"


def test_plain_http_to_another_machine_needs_the_connection_to_say_so():
    with pytest.raises(RayLLMError, match="plain http to another machine") as err:
        RayConnSettings.from_connection(conn(host="http://ray-head.svc:8265", password="s3cr3t-canary"))
    assert "s3cr3t-canary" not in str(err.value) and "allow_insecure_http" in str(err.value)
    trusted = RayConnSettings.from_connection(
        conn(host="http://ray-head.svc:8265", extra='{"allow_insecure_http": true}')
    )
    assert trusted.address == "http://ray-head.svc:8265"


def test_token_becomes_bearer_header_and_headers_merge():
    s = RayConnSettings.from_connection(
        conn(host="https://ray.example:443/", password="tok", extra='{"headers": {"X-Team": "ml"}, "verify": "false"}')
    )
    assert s.address == "https://ray.example:443"
    assert s.request_headers() == {"X-Team": "ml", "Authorization": "Bearer tok"}
    assert s.verify is False
    assert "tok" not in repr(s.dashboard_job_url("j"))


def test_ca_bundle_wins_over_verify_flag():
    s = RayConnSettings.from_connection(
        conn(host="https://h", extra='{"ca_bundle": "/etc/ray/ca.pem", "verify": true}')
    )
    assert s.verify == "/etc/ray/ca.pem"


def test_missing_host_is_a_clear_error():
    with pytest.raises(RayLLMError, match="host .*is empty"):
        RayConnSettings.from_connection(conn(host=""))


def test_bad_headers_extra():
    with pytest.raises(RayLLMError, match="headers must be a JSON object"):
        RayConnSettings.from_connection(conn(host="h", extra='{"headers": [1, 2]}'))


def test_hook_reads_connection_lazily():
    hook = RayJobHook(ray_conn_id="does_not_exist")  # no lookup happens here
    assert hook.ray_conn_id == "does_not_exist"
    assert "settings" not in hook.__dict__
