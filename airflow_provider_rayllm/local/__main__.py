"""`python -m airflow_provider_rayllm.local start|stop|restart|status|conn|demo|models|services|ui`."""

from __future__ import annotations

import argparse
import json
import sys

from airflow_provider_rayllm.local.cluster import DEFAULT_STATE_DIR, LocalRayCluster


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m airflow_provider_rayllm.local")
    parser.add_argument(
        "command", choices=["start", "stop", "restart", "status", "conn", "demo", "models", "services", "ui"]
    )
    parser.add_argument("--state-dir", default=str(DEFAULT_STATE_DIR))
    parser.add_argument("--num-cpus", type=int, default=None)
    parser.add_argument("--worker-nodes", type=int, default=0, help="for `start`: extra raylets on this machine")
    parser.add_argument("--worker-cpus", type=int, default=2, help="for `start`: logical CPUs of each extra raylet")
    parser.add_argument("--output-base", default=None, help="for `conn`: the default output prefix")
    parser.add_argument(
        "--no-llm", action="store_true", help="for `services`: no OpenAI-compatible server (saves a minute and 2 GB)"
    )
    parser.add_argument("--detach", action="store_true", help="for `services`: return once they are up")
    parser.add_argument("--stop", action="store_true", help="for `services`: stop the ones --detach started")
    parser.add_argument("--port", type=int, default=8080, help="for `ui`: the API server's port (a free one if taken)")
    parser.add_argument(
        "--use-environment",
        action="store_true",
        help="for `ui`: serve the Airflow this environment configures (AIRFLOW_HOME, its database), not the demo's",
    )
    args = parser.parse_args(argv)
    if args.command == "ui":
        from airflow_provider_rayllm.local import ui

        return ui.serve(args.port, home=None if args.use_environment else ui.WORK / "airflow")
    if args.command == "demo":
        from airflow_provider_rayllm.local.demo import main as demo_main

        return demo_main()
    if args.command == "services":
        from pathlib import Path

        from airflow_provider_rayllm.local import services

        if args.stop:
            return services.stop_detached()
        if args.detach:
            return services.detach(with_llm=not args.no_llm, state_dir=Path(args.state_dir))
        return services.run(with_llm=not args.no_llm, state_dir=Path(args.state_dir))
    if args.command == "models":
        from airflow_provider_rayllm.local.models import main as models_main

        return models_main([])
    cluster = LocalRayCluster(state_dir=args.state_dir, num_cpus=args.num_cpus)
    if args.command == "start":
        info = cluster.start()
        for _ in range(args.worker_nodes - len(info.worker_nodes or [])):
            node = cluster.add_node(num_cpus=args.worker_cpus)
            print(f"worker raylet: {node['num_cpus']} CPUs, temp dir {node['temp_dir']}")
        print(f"Ray Jobs API: {info.dashboard_url}  GCS: {info.gcs_address}  token file: {info.token_file}")
        print('Airflow connection: export AIRFLOW_CONN_RAY_DEFAULT="$(python -m airflow_provider_rayllm.local conn)"')
    elif args.command == "stop":
        cluster.stop()
    elif args.command == "restart":
        info = cluster.restart()
        print(f"restarted: Ray Jobs API {info.dashboard_url} (same address and token; running jobs are lost)")
    elif args.command == "status":
        info = cluster.info()
        print(json.dumps(info.__dict__ if info else None, indent=2))
        return 0 if info else 1
    elif args.command == "conn":
        info = cluster.info()
        if info is None:
            print("no local cluster is running; `start` one first", file=sys.stderr)
            return 1
        print(info.airflow_conn_uri(output_base=args.output_base))
    return 0


if __name__ == "__main__":
    sys.exit(main())
