"""Airflow connections -> the environment the Ray job's processes get (as job secrets)."""

import json
import time

import pytest

from airflow_provider_rayllm.contract.names import GCP_KEYFILE_JSON
from airflow_provider_rayllm.exceptions import InvalidSpec
from airflow_provider_rayllm.job.secrets import load_into_env, scrub
from airflow_provider_rayllm.operators import credentials


def conn(monkeypatch, name, **fields):
    monkeypatch.setenv(f"AIRFLOW_CONN_{name.upper()}", json.dumps(fields))


def test_aws_connection(monkeypatch):
    conn(
        monkeypatch,
        "a",
        conn_type="aws",
        login="AKIA1",
        password="s3cret",
        extra={"region_name": "eu-west-1", "endpoint_url": "http://127.0.0.1:9000"},
    )
    assert credentials.aws_env("a") == {
        "AWS_ACCESS_KEY_ID": "AKIA1",
        "AWS_SECRET_ACCESS_KEY": "s3cret",
        "AWS_REGION": "eu-west-1",
        "AWS_DEFAULT_REGION": "eu-west-1",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
    }


def test_without_the_amazon_provider_the_fields_are_read_and_a_role_is_refused(monkeypatch):
    """The same connection read without the provider's hook gives the same variables; what only the hook can
    resolve (an assumed role) is a clear error, not dropped."""
    import sys

    monkeypatch.setitem(sys.modules, "airflow.providers.amazon.aws.hooks.base_aws", None)
    extra = {"region_name": "eu-west-1", "endpoint_url": "http://127.0.0.1:9000"}
    conn(monkeypatch, "a", conn_type="aws", login="AKIA1", password="s3cret", extra=extra)
    assert credentials.aws_env("a")["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9000"
    conn(monkeypatch, "r", conn_type="aws", extra={"role_arn": "arn:aws:iam::1:role/x"})
    with pytest.raises(InvalidSpec, match="role_arn: resolving it needs the Amazon provider"):
        credentials.aws_env("r")


def test_an_aws_connection_without_credentials_gives_the_job_none(monkeypatch):
    """The cluster's own role answers; the worker's environment keys are not shipped to the job."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "WORKER-KEY")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "worker-secret")
    conn(monkeypatch, "n", conn_type="aws", extra={"region_name": "us-east-2"})
    assert credentials.aws_env("n") == {"AWS_REGION": "us-east-2", "AWS_DEFAULT_REGION": "us-east-2"}


def test_a_gcp_connection_whose_credentials_only_the_worker_can_resolve_is_refused(monkeypatch):
    conn(monkeypatch, "g", conn_type="google_cloud_platform", extra={"impersonation_chain": "sa@p.iam"})
    with pytest.raises(InvalidSpec, match="impersonation_chain"):
        credentials.gcp_env("g")


def test_aws_half_credentials_are_refused(monkeypatch):
    conn(monkeypatch, "a", conn_type="aws", login="AKIA1")
    with pytest.raises(InvalidSpec, match="give both"):
        credentials.aws_env("a")


def test_gcs_emulator_reaches_both_clients(monkeypatch):
    conn(monkeypatch, "g", conn_type="google_cloud_platform", extra={"storage_emulator_host": "http://127.0.0.1:9023"})
    env = credentials.gcp_env("g")
    assert env["STORAGE_EMULATOR_HOST"] == env["CLOUD_STORAGE_EMULATOR_ENDPOINT"] == "http://127.0.0.1:9023"


def test_gcp_keyfile_travels_as_text(monkeypatch):
    key = {"type": "service_account", "private_key": "-----KEY-----"}
    conn(monkeypatch, "g", conn_type="google_cloud_platform", extra={"keyfile_dict": json.dumps(key), "project": "p1"})
    env = credentials.gcp_env("g")
    assert json.loads(env[GCP_KEYFILE_JSON]) == key and env["GOOGLE_CLOUD_PROJECT"] == "p1"


@pytest.mark.parametrize(
    "fields, dialect, uri",
    [
        (
            {"conn_type": "postgres", "host": "db", "port": 5432, "login": "u", "password": "p@ss/w", "schema": "wh"},
            "postgresql",
            "postgresql://u:p%40ss%2Fw@db:5432/wh",
        ),
        ({"conn_type": "mysql", "host": "m", "login": "root", "schema": "test"}, "mysql", "mysql://root@m/test"),
        ({"conn_type": "sqlite", "host": "/data/w.db"}, "sqlite", "sqlite:/data/w.db"),
        (
            {
                "conn_type": "postgres",
                "host": "db",
                "login": "u",
                "schema": "wh",
                "extra": {"sslmode": "require", "connect_timeout": 5, "cursor": "dictcursor"},
            },
            "postgresql",
            "postgresql://u@db/wh?sslmode=require&connect_timeout=5",
        ),
        (
            {"conn_type": "mysql", "host": "m", "login": "root", "schema": "test", "extra": {"ssl_ca": "/ca.pem"}},
            "mysql",
            "mysql://root@m/test?ssl_ca=%2Fca.pem",
        ),
    ],
)
def test_sql_connections(monkeypatch, fields, dialect, uri):
    conn(monkeypatch, "s", **fields)
    assert credentials.sql_source("s") == (dialect, {"RAYLLM_SQL_URI": uri})


def test_unsupported_sql_connection(monkeypatch):
    conn(monkeypatch, "s", conn_type="http", host="x")
    with pytest.raises(InvalidSpec, match="connection type 'http'"):
        credentials.sql_source("s")


def test_hf_token(monkeypatch):
    conn(monkeypatch, "hf", conn_type="generic", password="hf_abc")
    assert credentials.hf_env("hf")["HF_TOKEN"] == "hf_abc"
    assert "HF_ENDPOINT" not in credentials.hf_env("hf"), "no host: the job keeps huggingface.co"
    conn(monkeypatch, "hf2", conn_type="generic")
    with pytest.raises(InvalidSpec, match="holds no token"):
        credentials.hf_env("hf2")


def test_hf_connection_host_is_the_hub_the_job_talks_to(monkeypatch):
    conn(monkeypatch, "hub", conn_type="generic", host="http://127.0.0.1:8123/", password="hf_abc")
    assert credentials.hf_env("hub")["HF_ENDPOINT"] == "http://127.0.0.1:8123"
    conn(monkeypatch, "hub2", conn_type="generic", host="hub.example.com", port=8443, password="hf_abc")
    assert credentials.hf_env("hub2")["HF_ENDPOINT"] == "https://hub.example.com:8443"


def test_secrets_file_loads_into_env_and_keyfile_becomes_private_file(tmp_path, monkeypatch):
    (tmp_path / "secrets.json").write_text(json.dumps({"AWS_SECRET_ACCESS_KEY": "zzz9", GCP_KEYFILE_JSON: '{"k": 1}'}))
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    names = load_into_env(str(tmp_path))
    import os
    import stat

    assert names == ["AWS_SECRET_ACCESS_KEY", "GOOGLE_APPLICATION_CREDENTIALS"]
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == "zzz9"
    key_file = os.environ["GOOGLE_APPLICATION_CREDENTIALS"]
    assert json.loads(open(key_file).read()) == {"k": 1}
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    assert os.path.dirname(key_file) == str(tmp_path), "the key stays with the job's package, not in /tmp"
    load_into_env(str(tmp_path))  # a second worker of the same job: same file, still whole
    assert json.loads(open(key_file).read()) == {"k": 1} and len(list(tmp_path.iterdir())) == 2
    assert scrub("failed with key zzz9", ["zzz9"]) == "failed with key ***"


def test_secret_names_are_hidden_and_token_counts_are_shown():
    from airflow_provider_rayllm.contract.secrets import redact

    shown = redact(
        {
            "hf_token": "hf_abc",
            "api_key": "k",
            "nested": {"VENDOR_API_TOKEN": "v", "accessToken": "a"},
            "max_num_batched_tokens": 16384,
            "max_tokens": 64,
            "tokenizer": "/models/tok",
            "tokenizer_mode": "auto",
            "base_url": "https://user:pass@example.com/v1",
        }
    )
    assert shown["hf_token"] == shown["api_key"] == "***"
    assert shown["nested"] == {"VENDOR_API_TOKEN": "***", "accessToken": "***"}
    assert (shown["max_num_batched_tokens"], shown["max_tokens"]) == (16384, 64)
    assert (shown["tokenizer"], shown["tokenizer_mode"]) == ("/models/tok", "auto")
    assert shown["base_url"] == "https://***@example.com/v1"


@pytest.mark.parametrize(
    "name", ["STRIPE_KEY", "api-key", "MY_SECRET", "DB_PASSWORD", "DATABASE_URL", "SENTRY_DSN", "GITHUB_TOKEN"]
)
def test_each_kind_of_secret_name_is_a_secret(name):
    from airflow_provider_rayllm.contract.secrets import is_secret_name, secret_env_vars

    assert is_secret_name(name)
    kept, moved = secret_env_vars({"env_vars": {name: "canary-value", "LOG_LEVEL": "debug"}})
    assert moved == {name: "canary-value"} and kept == {"env_vars": {"LOG_LEVEL": "debug"}}


@pytest.mark.parametrize("name", ["max_num_batched_tokens", "tokenizer", "monkey", "hockey", "KEYBOARD_LAYOUT"])
def test_settings_that_only_look_like_secrets_are_shown(name):
    from airflow_provider_rayllm.contract.secrets import is_secret_name

    assert not is_secret_name(name)


@pytest.mark.parametrize(
    "url, shown",
    [
        ("postgresql://u:p@ss@db:5432/x", "postgresql://***@db:5432/x"),  # a password holding "@"
        ("redis://:hunter2@cache:6379/0", "redis://***@cache:6379/0"),  # no user, only a password
        ("https://user:pass@example.com/v1?q=a@b", "https://***@example.com/v1?q=a@b"),  # "@" after the host stays
        ("s3://bucket/key@2x.png", "s3://bucket/key@2x.png"),  # no credentials: "@" in the path
    ],
)
def test_credentials_in_a_url_are_redacted_however_they_are_written(url, shown):
    from airflow_provider_rayllm.contract.secrets import has_url_credentials, redact, secret_env_vars

    assert redact(url) == shown
    assert has_url_credentials(url) == (url != shown)
    # A URL with credentials is a secret whatever the variable's name.
    assert bool(secret_env_vars({"env_vars": {"UPSTREAM": url}})[1]) == (url != shown)


_STOPPED_DRIVER = """
import sys, time
from airflow_provider_rayllm.job import driver, entrypoint, secrets
# the job runs until Ray stops it; the tasks that reach the other nodes then take long to start
driver.run = lambda *args: (print("running", flush=True), time.sleep(120))
secrets.cleanup = lambda *args, **kwargs: time.sleep(120)
sys.exit(entrypoint.main([sys.argv[1]]))
"""


def write_job_package(folder, secret_values: dict) -> None:
    """A job package as the operator writes it: a small spec and the secrets file beside it."""
    spec = {
        "source": {"uris": "/data/in.jsonl"},
        "prompt": {"prompt_column": "prompt", "sampling_params": {"max_tokens": 8}},
        "processor": {"model_source": "/models/smol"},
        "sink": {"uri": "/out/run1"},
    }
    (folder / "spec.json").write_text(json.dumps(spec))
    (folder / "secrets.json").write_text(json.dumps(secret_values))


def test_a_stopped_driver_removes_its_nodes_secrets_at_once(tmp_path):
    """Ray kills a stopped job's driver a while after its SIGTERM: the secrets on the driver's node must be
    gone before the slow part of the cleanup starts, not after it."""
    import os
    import signal
    import subprocess
    import sys

    write_job_package(tmp_path, {"API_KEY": "s3cret-value", GCP_KEYFILE_JSON: "{}"})
    driver = subprocess.Popen(
        [sys.executable, "-c", _STOPPED_DRIVER, "spec.json"], cwd=tmp_path, stdout=subprocess.PIPE, text=True
    )
    try:
        lines = [driver.stdout.readline()]
        while lines[-1] and lines[-1].strip() != "running":
            lines.append(driver.stdout.readline())
        assert lines[-1].strip() == "running", lines
        assert sorted(p.name for p in tmp_path.iterdir()) == ["gcp-keyfile.json", "secrets.json", "spec.json"]
        os.kill(driver.pid, signal.SIGTERM)
        deadline = time.time() + 30
        while (tmp_path / "secrets.json").exists() and time.time() < deadline:
            time.sleep(0.1)
        assert driver.poll() is None, "the driver is still in its (slow) cleanup"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.json"]
    finally:
        driver.kill()
        driver.wait()


def test_a_mysql_connections_tls_and_timeouts_reach_the_jobs_driver(monkeypatch):
    """The extras travel in the URI's query (above) and the job turns them into pymysql's arguments."""
    from urllib.parse import parse_qsl, urlsplit

    from airflow_provider_rayllm.job.databases import mysql_options

    extra = {"ssl_ca": "/ca.pem", "ssl_verify_cert": True, "connect_timeout": 7, "cursorclass": "x"}
    conn(monkeypatch, "m", conn_type="mysql", host="m", login="root", schema="test", extra=extra)
    _, env = credentials.sql_source("m")
    query = dict(parse_qsl(urlsplit(env["RAYLLM_SQL_URI"]).query))
    assert mysql_options(query) == {
        "ssl": {"ca": "/ca.pem"},
        "ssl_verify_cert": True,
        "connect_timeout": 7,
        "read_timeout": 600,  # not in the extras: the job's own deadline
        "write_timeout": 600,
    }


def test_the_operator_writes_the_secrets_file_private_from_its_creation(tmp_path, monkeypatch):
    """The file is created with mode 0600 (never wider, even for a moment) beside the owner file that names the
    submission, which a later job reads to tell a leftover from a live job's file."""
    import os
    import stat

    from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

    seen = {}

    class Hook:
        def submit_job(self, *, runtime_env, submission_id, **kw):
            folder = runtime_env["working_dir"]
            seen["mode"] = stat.S_IMODE(os.stat(os.path.join(folder, "secrets.json")).st_mode)
            seen["owner"] = json.loads(open(os.path.join(folder, "rayllm-job.json")).read())
            seen["secrets"] = json.loads(open(os.path.join(folder, "secrets.json")).read())

    old = os.umask(0)  # even a permissive umask gives 0600
    try:
        op = VLLMBatchOperator(
            task_id="t",
            model_source="/m",
            input_uri="/in.jsonl",
            prompt_column="q",
            output_uri=str(tmp_path / "out"),
            runtime_env={"env_vars": {"HF_TOKEN": "hf_canary_value"}},
        )
        op.__dict__["hook"] = Hook()
        spec = op.build_spec({"ti": _Ti()}, tmp_path)
        op._submit("sub-1", spec, tmp_path)
    finally:
        os.umask(old)
    assert seen["mode"] == 0o600
    assert seen["owner"] == {"submission_id": "sub-1"}
    assert seen["secrets"]["HF_TOKEN"] == "hf_canary_value"


class _Ti:
    dag_id, run_id, task_id, map_index, try_number = "dag", "manual__1", "t", -1, 1


def test_a_later_job_removes_only_the_secrets_that_ended_jobs_left(tmp_path, monkeypatch):
    """A node's packages: an ended job's (its driver was killed before its cleanup), a running job's, one whose
    job was submitted after the cluster's job list was read (a retry right after a stop: the listing does not
    know it), one that is not ours, and the sweeping job's own. Only the ended job's secrets go."""
    from airflow_provider_rayllm.job import secrets

    root = tmp_path / "working_dir_files"
    packages = {}
    for name, owner in (
        ("ended", "sub-ended"),
        ("running", "sub-running"),
        ("newer", "sub-retry"),
        ("foreign", None),
        ("mine", "sub-me"),
    ):
        folder = root / f"_ray_pkg_{name}"
        folder.mkdir(parents=True)
        (folder / "secrets.json").write_text(json.dumps({"K": "v"}))
        if owner:
            (folder / "rayllm-job.json").write_text(json.dumps({"submission_id": owner}))
        packages[name] = folder
    (packages["ended"] / "gcp-keyfile.json").write_text("{}")
    monkeypatch.chdir(packages["mine"])
    removed = secrets._leftovers_here(["sub-ended", "sub-stopped-long-ago"])  # what the listing says ended
    assert sorted(removed) == sorted(
        [str(packages["ended"] / "secrets.json"), str(packages["ended"] / "gcp-keyfile.json")]
    )
    left = {name: (folder / "secrets.json").exists() for name, folder in packages.items()}
    assert left == {"ended": False, "running": True, "newer": True, "foreign": True, "mine": True}
