"""What a user waits for before the first answer: our job against a plain vLLM offline script, same model
(SmolLM2, CPU vLLM), same rows, on one local Ray cluster.

Each round runs, in a rotated order:
- ours: VLLMBatchOperator (not deferred). Job submitted -> first answered row and -> SUCCEEDED, from the Jobs
  API's start and end times, with the breakdown: driver start (process, imports, ray.init), driver checks
  and plan start (the manifest's ``plan_started_s``), engine actor up to vLLM's first log line (Ray Data
  starting the actor, its imports), engine ready (vLLM's "init engine" line), first answer, last answer,
  publish (last answer -> job end);
- offline: vLLM's ``LLM.chat`` as a plain script: process start (before any import) -> first token and ->
  process end, over the same rows with the engine settings our job resolved.
Once per run (with --before DIR): the driver's preflight alone, timed in a fresh Ray driver process, with the
package at DIR (the code before the change) and with this one: the per-job saving of the driver's checks.

Writes benchmarks/results/<date>-startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from datetime import date, datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import bench_home, cpu_versions, machine, write_results  # noqa: E402
from benchmarks.engine_bench import engine_ready_at, prompts, spread  # noqa: E402

_VLLM_STAMP = re.compile(r"(?:INFO|WARNING|DEBUG) (\d\d-\d\d \d\d:\d\d:\d\d) ")

OFFLINE = r"""
import time
started = time.time()
import json, sys
from vllm import LLM, SamplingParams
settings = json.loads(sys.argv[1])
with open(sys.argv[2], encoding="utf-8") as handle:
    prompts = [json.loads(line)["prompt"] for line in handle if line.strip()]
kwargs = {k: v for k, v in settings["engine_kwargs"].items() if k != "task_type"}
llm = LLM(model=settings["model_source"], disable_log_stats=False, **kwargs)
ready = time.time()
outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], SamplingParams(**settings["sampling_params"]), use_tqdm=False)
done = time.time()
stats = [getattr(o, "metrics", None) for o in outputs]
firsts = [m.arrival_time + m.first_token_latency for m in stats if getattr(m, "first_token_latency", 0)]
first = min(firsts) if firsts else done
tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
print("OFFLINE " + json.dumps({"started": started, "ready": ready, "first_token": first, "done": done, "rows": len(outputs), "output_tokens": tokens}), flush=True)
"""

PREFLIGHT = r"""
import json, sys, time
import ray
from airflow_provider_rayllm.contract.names import SPEC_FILE
from airflow_provider_rayllm.contract.spec import parse_spec
from airflow_provider_rayllm.job import compat, driver
compat.install()
ray.init(log_to_driver=False)
spec = parse_spec(open(sys.argv[1] + "/" + SPEC_FILE).read())
started = time.time()
driver.preflight(spec, sys.argv[1])
print("PREFLIGHT " + json.dumps({"seconds": time.time() - started, "vllm": "vllm" in sys.modules, "torch": "torch" in sys.modules}), flush=True)
"""


def vllm_stamps(log: str) -> list[float]:
    """Epoch seconds (1 s resolution) of vLLM's log lines, in log order."""
    out = []
    for m in _VLLM_STAMP.finditer(log):
        stamp = datetime.strptime(f"{date.today().year}-{m.group(1)}", "%Y-%m-%d %H:%M:%S")
        out.append(stamp.replace(tzinfo=timezone.utc).timestamp())
    return out


class Bench:
    def __init__(self, args: argparse.Namespace, home: Path, info: object):
        from airflow_provider_rayllm.hooks.ray_job import RayJobHook
        from airflow_provider_rayllm.local.models import smollm2_path
        from tests.integration.helpers import write_jsonl

        self.args, self.home, self.info = args, home, info
        self.model = str(smollm2_path())
        self.sampling = {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True}
        self.input = write_jsonl(home / "in" / "prompts.jsonl", prompts(args.rows))
        self.hook = RayJobHook(ray_conn_id="ray_bench")
        self.resolved: dict | None = None
        self.spec_dir: Path | None = None

    def _operator(self, name: str):
        from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator

        return VLLMBatchOperator(
            task_id="bench",
            ray_conn_id="ray_bench",
            model_source=self.model,
            input_uri=self.input,
            output_uri=str(self.home / "out" / name),
            prompt_column="prompt",
            sampling_params=self.sampling,
            deferrable=False,
            poll_interval=0.5,
        )

    def ours(self, name: str) -> dict:
        from tests.integration.helpers import StandInTI

        manifest = self._operator(name).execute({"ti": StandInTI("startup_bench", name, "bench")})
        info = self.hook.get_job_info(manifest["submission_id"]) or {}
        submitted, ended = float(info["start_time"]) / 1000, float(info["end_time"]) / 1000
        log = self.hook.get_job_logs(manifest["submission_id"])
        origin = datetime.fromisoformat(manifest["started_at"]).timestamp()
        t = manifest["timeline"]
        stamps = vllm_stamps(log)
        init = engine_ready_at(log)
        self.resolved = {"engine_kwargs": manifest["engine_kwargs"]}

        def at(offset: float | None) -> float | None:
            return None if offset is None else origin + offset - submitted

        plan = at(t.get("plan_started_s"))
        return {
            "submitted_to_first_answer_s": at(t.get("first_answer_s")),
            "submitted_to_succeeded_s": ended - submitted,
            "driver_start_s": origin - submitted,
            "driver_checks_and_plan_s": t.get("plan_started_s"),
            "plan_to_vllm_first_log_s": (stamps[0] - submitted - plan) if stamps and plan is not None else None,
            "submitted_to_engine_ready_s": None if init is None else init - submitted,
            "submitted_to_last_answer_s": at(t.get("last_answer_s")),
            "publish_s": None if t.get("last_answer_s") is None else ended - (origin + t["last_answer_s"]),
            "rows": manifest["rows_out"],
            "output_tokens": manifest["output_tokens"],
        }

    def offline(self, env: dict) -> dict:
        assert self.resolved is not None
        settings = {"model_source": self.model, "sampling_params": self.sampling, **self.resolved}
        env = {**env, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        launched = time.time()
        proc = subprocess.run(
            [sys.executable, "-c", OFFLINE, json.dumps(settings), self.input], env=env, capture_output=True, text=True
        )
        ended = time.time()
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("OFFLINE ")), None)
        if proc.returncode != 0 or line is None:
            raise RuntimeError(f"offline failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-3000:]}")
        r = json.loads(line[len("OFFLINE ") :])
        return {
            "start_to_first_token_s": r["first_token"] - launched,
            "start_to_end_s": ended - launched,
            "interpreter_start_s": r["started"] - launched,
            "start_to_engine_ready_s": r["ready"] - launched,
            "rows": r["rows"],
            "output_tokens": r["output_tokens"],
        }

    def preflight(self, package_root: str, env: dict) -> dict:
        """The driver's preflight with the package at package_root, in a fresh Ray driver process."""
        if self.spec_dir is None:
            from airflow_provider_rayllm.contract.names import SPEC_FILE
            from tests.integration.helpers import StandInTI

            self.spec_dir = self.home / "preflight"
            self.spec_dir.mkdir(parents=True, exist_ok=True)
            spec = self._operator("preflight").build_spec(
                {"ti": StandInTI("startup_bench", "pf", "bench")}, self.spec_dir
            )
            (self.spec_dir / SPEC_FILE).write_text(spec.to_json())
        env = {**env, "PYTHONPATH": package_root, "RAY_ADDRESS": self.info.gcs_address}
        proc = subprocess.run(
            [sys.executable, "-c", PREFLIGHT, str(self.spec_dir)], env=env, capture_output=True, text=True, cwd="/"
        )
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PREFLIGHT ")), None)
        if proc.returncode != 0 or line is None:
            raise RuntimeError(f"preflight failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-3000:]}")
        return json.loads(line[len("PREFLIGHT ") :])


def summarize(args: argparse.Namespace, runs: dict[str, list[dict]], preflights: dict[str, list[dict]]) -> dict:

    def med(kind: str, key: str) -> dict | None:
        values = [r[key] for r in runs[kind] if r.get(key) is not None]
        return spread(values) if values else None

    ours_keys = [k for k in (runs["ours"][0] if runs["ours"] else {}) if k.endswith("_s")]
    offline_keys = [k for k in (runs["offline"][0] if runs["offline"] else {}) if k.endswith("_s")]
    checks = {side: spread([p["seconds"] for p in values]) for side, values in preflights.items() if values}
    saving = checks["before"]["median"] - checks["after"]["median"] if {"before", "after"} <= set(checks) else None
    results = {
        "date": date.today().isoformat(),
        "command": " ".join([".venv/bin/python benchmarks/startup_bench.py", *sys.argv[1:]]),
        "rows": args.rows,
        "max_tokens": args.max_tokens,
        "rounds": len(runs["ours"]),
        "model": "SmolLM2-135M-Instruct (CPU vLLM)",
        "ours": {k: med("ours", k) for k in ours_keys},
        "offline": {k: med("offline", k) for k in offline_keys},
        "driver_preflight_s": checks,
        "driver_preflight_imports": {side: values[-1] for side, values in preflights.items() if values},
        "per_job_saving_s": saving,
        "runs": runs,
        "versions": cpu_versions(),
        "machine": machine(),
    }
    write_results("startup", results)
    return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", help="a checkout of the package before the change, for the preflight figure")
    args = parser.parse_args()

    home = bench_home("startup-bench")

    from airflow_provider_rayllm.local.cluster import LocalRayCluster

    cluster = LocalRayCluster(state_dir=home / "ray", num_cpus=2)
    info = cluster.start()
    os.environ["AIRFLOW_CONN_RAY_BENCH"] = info.airflow_conn_uri()
    bench = Bench(args, home, info)
    runs: dict[str, list[dict]] = {"ours": [], "offline": []}
    preflights: dict[str, list[dict]] = {"before": [], "after": []}
    results: dict = {}
    try:
        for round_no in range(args.rounds):
            order = ["ours", "offline"] if round_no % 2 == 0 else ["offline", "ours"]
            if bench.resolved is None:
                order = ["ours", "offline"]  # ours first: its manifest gives offline its settings
            for kind in order:
                result = bench.ours(f"r{round_no}") if kind == "ours" else bench.offline(cluster.env())
                runs[kind].append(result)
                shown = {k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}
                print(f"round {round_no + 1} {kind}: {shown}", flush=True)
            if args.before:
                for side, root in (("before", args.before), ("after", str(REPO))):
                    preflights[side].append(bench.preflight(root, cluster.env()))
                    print(f"round {round_no + 1} preflight {side}: {preflights[side][-1]}", flush=True)
            results = summarize(args, runs, preflights)  # a stopped run still leaves its finished rounds
    finally:
        cluster.stop()
    print(json.dumps({k: results.get(k) for k in ("per_job_saving_s", "driver_preflight_s")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
