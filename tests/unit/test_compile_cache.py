"""vLLM's cache folder carried through a bucket (``compile_cache``): restored into a node-local folder before the
engine starts, and what the engine writes saved back. The bucket is the tests' local S3 endpoint (moto's server,
the real protocol)."""

from __future__ import annotations

import os
import time

import pytest

from airflow_provider_rayllm.contract.spec import VLLMProcessorSpec
from airflow_provider_rayllm.job.engines.vllm import compile_cache
from airflow_provider_rayllm.job.engines.vllm.settings import engine_runtime_env


@pytest.fixture()
def bucket(s3_endpoint, monkeypatch):
    import boto3

    name = f"cache-{time.time_ns()}"
    client = boto3.client(
        "s3", endpoint_url=s3_endpoint, aws_access_key_id="k", aws_secret_access_key="s", region_name="us-east-1"
    )
    client.create_bucket(Bucket=name)
    for key, value in {"AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}.items():
        monkeypatch.setenv(key, value)
    return client, name


def _objects(client, bucket: str) -> dict[str, bytes]:
    listed = client.list_objects_v2(Bucket=bucket).get("Contents", [])
    return {o["Key"]: client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in listed}


def test_a_nodes_cache_is_saved_to_the_bucket_and_restored_on_a_fresh_node(bucket, tmp_path):
    client, name = bucket
    uri = f"s3://{name}/vllm-cache"
    first = tmp_path / "node-1"
    # What vLLM writes: a model class's inspection and a compiled graph under its hash folder.
    (first / "modelinfos").mkdir(parents=True)
    (first / "modelinfos" / "llama.json").write_text('{"architecture": "LlamaForCausalLM"}')
    saver = compile_cache.Saver(uri, str(first), quiet_s=0.0)
    (first / "torch_compile_cache" / "5b93e9b21f" / "rank_0_0").mkdir(parents=True)
    graph = os.urandom(300_000)
    (first / "torch_compile_cache" / "5b93e9b21f" / "rank_0_0" / "model").write_bytes(graph)
    assert saver.save() == 2
    assert saver.save() == 0, "an unchanged file is not copied again"
    stored = _objects(client, name)
    assert set(stored) == {
        "vllm-cache/modelinfos/llama.json",
        "vllm-cache/torch_compile_cache/5b93e9b21f/rank_0_0/model",
    }
    assert stored["vllm-cache/torch_compile_cache/5b93e9b21f/rank_0_0/model"] == graph

    # A fresh node: everything comes back, byte for byte; a second restore copies nothing.
    second = tmp_path / "node-2"
    files, size, remote = compile_cache.restore(uri, str(second))
    assert (files, size) == (2, len(graph) + len('{"architecture": "LlamaForCausalLM"}'))
    assert (second / "torch_compile_cache" / "5b93e9b21f" / "rank_0_0" / "model").read_bytes() == graph
    assert compile_cache.restore(uri, str(second))[:2] == (0, 0)
    # The fresh node's saver copies only what its engine writes there, not what it restored.
    saver = compile_cache.Saver(uri, str(second), remote, quiet_s=0.0)
    (second / "modelinfos" / "bert.json").write_text("{}")
    assert saver.save() == 1 and "vllm-cache/modelinfos/bert.json" in _objects(client, name)


def test_a_file_still_being_written_waits_for_the_next_look_and_close_takes_it(bucket, tmp_path):
    client, name = bucket
    saver = compile_cache.Saver(f"s3://{name}/c", str(tmp_path), quiet_s=60.0)
    (tmp_path / "growing").write_bytes(b"part")
    assert saver.save() == 0 and _objects(client, name) == {}
    saver.close()
    assert _objects(client, name) == {"c/growing": b"part"}


def test_an_unreadable_prefix_starts_the_engine_cold(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setattr(compile_cache, "_SAVER", None)
    env = {compile_cache.ENV: "s3://nowhere/c", compile_cache.CACHE_ROOT_ENV: str(tmp_path / "root")}
    saver = compile_cache.start_if_asked(env)
    try:
        assert saver is not None and (tmp_path / "root").is_dir()
        assert "could not read s3://nowhere/c" in capsys.readouterr().out
    finally:
        saver._stop.set()
        monkeypatch.setattr(compile_cache, "_SAVER", None)


def test_the_engines_environment_names_the_cache_and_a_bad_value_is_refused():
    bucket = engine_runtime_env(VLLMProcessorSpec(model_source="m", compile_cache="gs://b/cache/"), "gpu")
    env = bucket["env_vars"]
    assert env[compile_cache.ENV] == "gs://b/cache"
    assert env["VLLM_CACHE_ROOT"] == compile_cache.local_root("gs://b/cache")
    assert env["TRITON_CACHE_DIR"] == os.path.join(env["VLLM_CACHE_ROOT"], "triton_cache"), "carried with the rest"
    volume = engine_runtime_env(VLLMProcessorSpec(model_source="m", compile_cache="/mnt/vllm-cache"), "gpu")
    assert volume["env_vars"]["VLLM_CACHE_ROOT"] == "/mnt/vllm-cache" and compile_cache.ENV not in volume["env_vars"]
    assert volume["env_vars"]["TRITON_CACHE_DIR"] == "/mnt/vllm-cache/triton_cache"
    assert "VLLM_CACHE_ROOT" not in (engine_runtime_env(VLLMProcessorSpec(model_source="m"), "gpu") or {}).get(
        "env_vars", {}
    )
    for bad in ("cache", "file:///tmp/c", "s3://", "http://host/c"):
        with pytest.raises(ValueError, match=f"compile_cache must be .*got {bad!r}"):
            VLLMProcessorSpec(model_source="m", compile_cache=bad)
    for name in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR"):
        with pytest.raises(ValueError, match=f"compile_cache and runtime_env's {name}"):
            VLLMProcessorSpec(model_source="m", compile_cache="/c", runtime_env={"env_vars": {name: "/other"}})
