"""Engine settings the job derives before any engine starts."""

from airflow_provider_rayllm.contract.spec import VLLMProcessorSpec
from airflow_provider_rayllm.job.engines import vllm as vllm_pipeline


def spec(**kw):
    return VLLMProcessorSpec(model_source="/m", **kw)


def test_cpu_profile_defaults_and_user_overrides():
    kwargs = vllm_pipeline.engine_kwargs_for(spec(engine_kwargs={"max_model_len": 512}), "cpu")
    assert kwargs["max_model_len"] == 512 and kwargs["enforce_eager"] is True
    assert vllm_pipeline.placement_for(
        spec(engine_kwargs={"tensor_parallel_size": 2}), "cpu", {"tensor_parallel_size": 2}
    ) == {
        "bundles": [{"CPU": vllm_pipeline.CPU_ENGINE_BUNDLE_CPUS}] * 2,
        "strategy": "PACK",
    }
    assert vllm_pipeline.placement_for(spec(), "gpu", {}) is None
    assert vllm_pipeline.resolve_profile(spec(), gpus=0) == "cpu"
    assert vllm_pipeline.resolve_profile(spec(), gpus=8) == "gpu"


def test_cpu_lora_gets_a_second_slot():
    kwargs = vllm_pipeline.engine_kwargs_for(spec(engine_kwargs={"enable_lora": True, "max_loras": 1}), "cpu")
    assert kwargs["max_loras"] == 2
    assert (
        vllm_pipeline.engine_kwargs_for(spec(engine_kwargs={"enable_lora": True, "max_loras": 1}), "gpu")["max_loras"]
        == 1
    )


def test_usage_statistics_opt_out_reaches_the_engine_env():
    env = vllm_pipeline.engine_runtime_env(spec(runtime_env={"env_vars": {"FOO": "1"}, "pip": ["x"]}))
    assert env["env_vars"] == {
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAYLLM_FORK_ENGINE_CORE": "1",
        "FOO": "1",
    }
    assert env["pip"] == ["x"]
    several = {"tensor_parallel_size": 2}
    assert vllm_pipeline.engine_runtime_env(spec(usage_stats=True), "gpu", several) is None


def test_rows_in_flight_default_to_twice_the_engines_batch_and_an_underfed_engine_is_named():
    feed = vllm_pipeline.feed_for(spec(batch_size=32), {"max_num_seqs": 256})
    assert (feed.max_concurrent_batches, feed.max_pending_requests) == (16, 512)
    assert feed.rows_in_flight == 2 * 256 and feed.warning is None
    staged = vllm_pipeline.feed_for(spec(batch_size=64), {"max_num_seqs": 100, "pipeline_parallel_size": 2})
    assert staged.rows_in_flight >= 2 * 100 * 2, "each pipeline stage holds a batch of its own"
    given = vllm_pipeline.feed_for(
        spec(batch_size=8, max_concurrent_batches=2, max_pending_requests=50), {"max_num_seqs": 64}
    )
    assert (given.max_concurrent_batches, given.max_pending_requests) == (2, 50)
    assert given.warning.startswith("batch_size x max_concurrent_batches = 8 x 2 = 16")
    assert vllm_pipeline.feed_for(spec(), {}).max_concurrent_batches == 8


def test_model_source_check_refuses_missing_folders_and_leaves_hub_ids_to_the_engine(tmp_path):
    import pytest

    from airflow_provider_rayllm.job.errors import JobError

    # A Hugging Face id is downloaded by the engine; it is not a folder to look for on the cluster.
    vllm_pipeline.check_model_source("HuggingFaceTB/SmolLM2-135M-Instruct")
    for missing in (str(tmp_path / "nope"), "./no-such-model", f"file://{tmp_path}/nope"):
        with pytest.raises(JobError, match="is not a folder on the cluster"):
            vllm_pipeline.check_model_source(missing)
    (tmp_path / "m").mkdir()
    with pytest.raises(JobError, match="has no config.json"):
        vllm_pipeline.check_model_source(str(tmp_path / "m"))


def test_cpu_defaults_are_vllms_own_offline_scheduler_limits():
    """Ray Data starts vLLM's async engine, which gets vLLM's generic scheduler limits; a batch job gets
    the limits vLLM gives its offline LLM class on this platform instead (read from vLLM, not copied)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    batched_tokens, seqs = EngineArgs(model="/m").get_batch_defaults(world_size=1)
    kwargs = vllm_pipeline.engine_kwargs_for(spec(), "cpu")
    assert kwargs["max_num_seqs"] == seqs[UsageContext.LLM_CLASS]
    assert kwargs["max_num_batched_tokens"] == batched_tokens[UsageContext.LLM_CLASS]
    assert UsageContext.ENGINE_CONTEXT not in seqs, "the engine context now has its own defaults; revisit ours"
    # The user's values win; a step still holds a whole prompt of max_model_len.
    assert vllm_pipeline.engine_kwargs_for(spec(engine_kwargs={"max_num_seqs": 1}), "cpu")["max_num_seqs"] == 1
    long = vllm_pipeline.engine_kwargs_for(spec(engine_kwargs={"max_model_len": 8192}), "cpu")
    assert long["max_num_batched_tokens"] == 8192
    mine = vllm_pipeline.engine_kwargs_for(
        spec(engine_kwargs={"max_model_len": 8192, "max_num_batched_tokens": 512}), "cpu"
    )
    assert mine["max_num_batched_tokens"] == 512


def test_cpu_model_parallel_gets_the_executor_and_mode_the_cpu_engine_runs():
    kwargs = vllm_pipeline.engine_kwargs_for(spec(engine_kwargs={"pipeline_parallel_size": 2}), "cpu")
    assert kwargs["distributed_executor_backend"] == "mp" and kwargs["enforce_eager"] is False
    kwargs = vllm_pipeline.engine_kwargs_for(spec(engine_kwargs={"tensor_parallel_size": 2}), "cpu")
    assert kwargs["distributed_executor_backend"] == "mp" and kwargs["enforce_eager"] is True  # tp runs eager
    # The user's words win, and the GPU profile keeps Ray Data's choice ("ray" for several workers).
    mine = vllm_pipeline.engine_kwargs_for(
        spec(engine_kwargs={"pipeline_parallel_size": 2, "distributed_executor_backend": "ray"}), "cpu"
    )
    assert mine["distributed_executor_backend"] == "ray"
    gpu = vllm_pipeline.engine_kwargs_for(spec(engine_kwargs={"tensor_parallel_size": 2}), "gpu")
    assert "distributed_executor_backend" not in gpu and vllm_pipeline.executor_backend(gpu) == "ray"
    assert vllm_pipeline.executor_backend(vllm_pipeline.engine_kwargs_for(spec(), "cpu")) == "uni"


def test_model_parallel_settings_the_cpu_engine_would_refuse_fail_first():
    import pytest

    from airflow_provider_rayllm.job.errors import JobError

    ray_backend = {"pipeline_parallel_size": 2, "distributed_executor_backend": "ray"}
    with pytest.raises(JobError, match=r"distributed_executor_backend='ray'.*does not support the Ray executor"):
        vllm_pipeline.check_parallel("cpu", ray_backend, None)
    vllm_pipeline.check_parallel("gpu", ray_backend, None)  # GPU engines take the Ray executor
    with pytest.raises(JobError, match=r"enforce_eager=True with pipeline_parallel_size=2"):
        vllm_pipeline.check_parallel(
            "cpu", {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp", "enforce_eager": True}, None
        )
    spread = {"bundles": [{"CPU": 1}, {"CPU": 1}], "strategy": "STRICT_SPREAD"}
    with pytest.raises(JobError, match=r"strategy='STRICT_SPREAD' with distributed_executor_backend='mp'"):
        vllm_pipeline.check_parallel("cpu", {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}, spread)
    vllm_pipeline.check_parallel("gpu", {"tensor_parallel_size": 2}, {**spread, "bundles": [{"GPU": 1}, {"GPU": 1}]})
    vllm_pipeline.check_parallel(
        "cpu", {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}, {**spread, "strategy": "STRICT_PACK"}
    )


def test_several_cpu_workers_split_the_node_unless_the_user_binds_them():
    env = vllm_pipeline.engine_runtime_env(spec(), "cpu", {"pipeline_parallel_size": 2})
    assert env["env_vars"]["VLLM_CPU_SIM_MULTI_NUMA"] == "1"
    mine = vllm_pipeline.engine_runtime_env(
        spec(runtime_env={"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}), "cpu", {"pipeline_parallel_size": 2}
    )
    assert "VLLM_CPU_SIM_MULTI_NUMA" not in mine["env_vars"] and mine["env_vars"]["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert "VLLM_CPU_SIM_MULTI_NUMA" not in vllm_pipeline.engine_runtime_env(spec(), "cpu", {})["env_vars"]
    assert (
        "VLLM_CPU_SIM_MULTI_NUMA"
        not in vllm_pipeline.engine_runtime_env(spec(), "gpu", {"tensor_parallel_size": 2})["env_vars"]
    )


def test_gpu_limits_follow_the_card():
    big = vllm_pipeline.GpuCard("NVIDIA H200", 140.4)
    for card, expected in [
        (big, vllm_pipeline.BIG_GPU_ENGINE_LIMITS),
        (vllm_pipeline.GpuCard("NVIDIA A100-SXM4-80GB", 80.0), vllm_pipeline.GPU_ENGINE_DEFAULTS),
        (vllm_pipeline.GpuCard("NVIDIA L4", 22.5), vllm_pipeline.GPU_ENGINE_DEFAULTS),
        (None, vllm_pipeline.GPU_ENGINE_DEFAULTS),
    ]:
        kwargs = vllm_pipeline.engine_kwargs_for(spec(), "gpu", card)
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            assert kwargs[name] == expected[name], (card, name)
    assert vllm_pipeline.BIG_GPU_ENGINE_LIMITS["max_num_seqs"] > vllm_pipeline.GPU_ENGINE_DEFAULTS["max_num_seqs"]
    mine = vllm_pipeline.engine_kwargs_for(spec(engine_kwargs={"max_num_seqs": 64}), "gpu", big)
    assert mine["max_num_seqs"] == 64
    # The feed keeps 2x the engine's sequences in flight on the big card too.
    feed = vllm_pipeline.feed_for(spec(), vllm_pipeline.engine_kwargs_for(spec(), "gpu", big))
    assert feed.rows_in_flight >= 2 * vllm_pipeline.BIG_GPU_ENGINE_LIMITS["max_num_seqs"]


def test_pooling_models_keep_vllms_own_prefill_and_caching_choice():
    card = vllm_pipeline.GpuCard("NVIDIA H200", 140.4)
    generate = vllm_pipeline.engine_kwargs_for(spec(), "gpu", card)
    assert generate["enable_chunked_prefill"] and generate["enable_prefix_caching"]
    embed = vllm_pipeline.engine_kwargs_for(spec(task_type="embed"), "gpu", card)
    assert "enable_chunked_prefill" not in embed and "enable_prefix_caching" not in embed
    asked = vllm_pipeline.engine_kwargs_for(
        spec(task_type="embed", engine_kwargs={"enable_prefix_caching": True}), "gpu"
    )
    assert asked["enable_prefix_caching"] is True


def test_score_is_refused_before_an_engine_starts_when_vllm_has_no_score_task():
    import pytest
    import vllm.tasks

    from airflow_provider_rayllm.job.engines.vllm.checks import check_task_type
    from airflow_provider_rayllm.job.errors import JobError

    check_task_type("classify")  # the replacement passes
    if not hasattr(vllm.tasks, "check_removed_pooling_task"):
        pytest.skip("this vLLM still has the score task")
    with pytest.raises(JobError, match=r"task_type='score'.*vLLM .* has no score task.*task_type='classify'"):
        check_task_type("score")


def test_a_one_worker_cpu_engine_runs_its_worker_in_the_engine_core_unless_the_user_says_otherwise():
    one = vllm_pipeline.engine_runtime_env(spec(), "cpu", {})
    assert one["env_vars"][vllm_pipeline.ONE_PROCESS_ENV] == "0"
    assert vllm_pipeline.ONE_PROCESS_ENV not in (vllm_pipeline.engine_runtime_env(spec(), "gpu", {}) or {})["env_vars"]
    several = vllm_pipeline.engine_runtime_env(spec(), "cpu", {"tensor_parallel_size": 2})
    assert vllm_pipeline.ONE_PROCESS_ENV not in several["env_vars"]
    chosen = vllm_pipeline.engine_runtime_env(spec(), "cpu", {"distributed_executor_backend": "mp"})
    assert vllm_pipeline.ONE_PROCESS_ENV not in chosen["env_vars"]
    mine = vllm_pipeline.engine_runtime_env(
        spec(runtime_env={"env_vars": {vllm_pipeline.ONE_PROCESS_ENV: "1"}}), "cpu", {}
    )
    assert mine["env_vars"][vllm_pipeline.ONE_PROCESS_ENV] == "1"


def test_only_a_one_worker_engine_has_its_engine_core_forked_from_the_actor():
    from airflow_provider_rayllm.job.compat import FORK_ENV

    for profile in ("cpu", "gpu"):
        assert vllm_pipeline.engine_runtime_env(spec(), profile, {})["env_vars"][FORK_ENV] == "1", profile
        several = vllm_pipeline.engine_runtime_env(spec(), profile, {"tensor_parallel_size": 2})
        assert FORK_ENV not in (several or {}).get("env_vars", {}), profile
        executor = vllm_pipeline.engine_runtime_env(spec(), profile, {"distributed_executor_backend": "ray"})
        assert FORK_ENV not in (executor or {}).get("env_vars", {}), profile
    gpu = vllm_pipeline.engine_runtime_env(spec(), "gpu", {})["env_vars"]
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in gpu, "a GPU engine's worker placement is vLLM's own"
    said = vllm_pipeline.engine_runtime_env(spec(runtime_env={"env_vars": {FORK_ENV: "0"}}), "cpu", {})
    assert said["env_vars"][FORK_ENV] == "0", "the user's own setting stands"


def test_a_refusal_the_cluster_answers_comes_before_vllm_is_imported(tmp_path):
    """An accelerator type no node offers fails in the driver before it imports vLLM (seconds of torch
    and vLLM for nothing). A fresh interpreter, so that vLLM's absence from sys.modules means something."""
    import subprocess
    import sys
    import textwrap

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    script = textwrap.dedent(
        f"""
        import sys
        import ray
        ray.cluster_resources = lambda: {{"CPU": 2.0, "accelerator_type:L4": 1.0}}
        from airflow_provider_rayllm.job.engines.vllm.engine import VLLMEngine
        from airflow_provider_rayllm.job.errors import JobError
        from airflow_provider_rayllm.contract.spec import parse_spec
        spec = parse_spec({{
            "source": {{"uris": "/data/in.jsonl"}},
            "prompt": {{"prompt_column": "prompt"}},
            "processor": {{"model_source": {str(model)!r}, "accelerator_type": "A100"}},
            "sink": {{"uri": "/out/run1"}},
        }})
        try:
            VLLMEngine(spec, "/pkg").check()
        except JobError as exc:
            print("refused:", exc)
        print("vllm imported:", "vllm" in sys.modules)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused: accelerator_type='A100': no node of the Ray cluster offers" in done.stdout, done.stdout
    assert "the cluster's accelerator types: L4" in done.stdout
    assert "vllm imported: False" in done.stdout


def test_one_worker_embeddings_go_straight_to_llm_embed_and_the_rest_through_rays_stage():
    from airflow_provider_rayllm.job.engines.vllm.embed import _vectors, direct_embed

    def reason(**fields):
        spec = VLLMProcessorSpec(model_source="m", **{"task_type": "embed", **fields})
        return direct_embed(spec, {**spec.engine_kwargs})

    assert reason() is None
    assert reason(task_type="generate") == "task_type 'generate'"
    assert reason(task_type="classify") == "task_type 'classify'"
    assert reason(engine_kwargs={"tensor_parallel_size": 2}) == "tensor or pipeline parallel engine"
    assert reason(placement_group_config={"bundles": [{"CPU": 1}]}) == "placement_group_config given"
    assert reason(dynamic_lora_loading_path="/adapters") == "LoRA adapters"
    assert reason(tokenize_stage=True) == "Ray's tokenize or multimodal stage asked for"

    # The vectors leave as one float32 column of fixed size, null where a row failed.
    column = _vectors([[0.5, 0.25], None, [1.0, 0.0]])
    assert str(column.type) == "fixed_size_list<item: float>[2]"
    assert column.to_pylist() == [[0.5, 0.25], None, [1.0, 0.0]]
    assert str(_vectors([[0.5], [1.0, 0.0]]).type) == "list<item: float>"
