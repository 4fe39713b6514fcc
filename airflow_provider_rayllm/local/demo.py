"""`make demo`: the quickstart DAG on the embedded stack, end to end.

Starts a local Ray head (token auth, free ports), runs example_vllm_batch with `airflow dags test`,
prints a few question/answer pairs, stops what it started, and prints the manifest as one line of
JSON as the last line of its output.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

from airflow_provider_rayllm.local import models
from airflow_provider_rayllm.local.airflow_env import airflow_bin, airflow_env, migrate
from airflow_provider_rayllm.local.cluster import LocalRayCluster
from airflow_provider_rayllm.local.ui import WORK, latest_demo_manifest


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_demo(work: Path = WORK) -> dict:
    started = time.time()
    models.smollm2_path()
    cluster = LocalRayCluster(state_dir=work / "ray")
    _say("starting a local Ray head (token auth on) ...")
    info = cluster.start()
    _say(f"Ray Jobs API at {info.dashboard_url}")
    output_base = work / "output"
    try:
        env = airflow_env(work / "airflow", cluster, info, output_base)
        migrate(env)
        log_path = work / "dags-test.log"
        _say(f"running `airflow dags test example_vllm_batch` (log: {log_path}) ...")
        with open(log_path, "w") as log:
            proc = subprocess.run(
                [airflow_bin(), "dags", "test", "example_vllm_batch"], env=env, stdout=log, stderr=subprocess.STDOUT
            )
        if proc.returncode != 0:
            _say(log_path.read_text()[-6000:])
            raise SystemExit(f"airflow dags test failed (exit {proc.returncode}); full log: {log_path}")
    finally:
        cluster.stop()
        _say("stopped the local Ray head")
    manifest = latest_demo_manifest(work)
    if manifest is None:
        raise SystemExit(f"the DAG run wrote no manifest under {output_base}")
    rows = []
    for f in manifest["output_files"]:
        rows.extend(pq.read_table(f["uri"]).to_pylist())
    rows.sort(key=lambda r: r.get("id", 0))
    for row in rows[:5]:
        print(f"Q: {row['prompt']}\nA: {row['response'].strip()}\n", flush=True)
    _say(f"demo finished in {time.time() - started:.0f} s; outputs under {manifest['outputs_folder']}")
    if manifest.get("report_uri"):
        _say(f"the run's report: {manifest['report_uri']} (open it in a browser)")
    _say("to see the run in Airflow's UI: make ui")
    return manifest


def main() -> int:
    manifest = run_demo()
    print(json.dumps(manifest, sort_keys=True), flush=True)
    ok = manifest["rows_in"] > 0 and manifest["rows_out"] == manifest["rows_in"] and manifest["rows_errored"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
