"""HTTP path, side by side, in interleaved rounds: two parts, each with ours and a bare asyncio client.

caller: one HttpCaller actor (the operator's own map step, ``call_endpoint``) against a local chat endpoint
  that answers at once, over prepared requests already in Ray's object store; beside it a bare aiohttp
  client in the benchmark's process sending the same bodies to the same endpoint with the same requests in
  flight. Ours is timed from the map's start to its last batch read (actor start included); the bare
  client from its first request to its last answer. Its rows/s is the endpoint's and the machine's ceiling.
e2e: against vLLM's OpenAI-compatible server (SmolLM2 on the CPU engine), each side as a Ray job on one
  local cluster: HttpLLMBatchOperator (not deferred) from the task's start to the manifest in hand (job
  submission, driver, reading the JSONL, requests, writing Parquet, the manifest), against
  plain_http_client.py (read the same JSONL, send with the same requests in flight, write one Parquet file)
  from its submission through the Jobs API to its end.

Writes benchmarks/results/<date>-http.json; benchmarks/report.py turns it into docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import time
from datetime import date
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import LOG_DIR, bench_home, spread  # noqa: E402

MODEL_NAME = "smollm2"
INCLUDES = {
    "caller_ours": "one HttpCaller actor (call_endpoint, the operator's map step) over requests already in Ray's "
    "object store: actor start, requests, answers, token counts, output batches read back; ours_steady counts "
    "from the first output batch back to the last (actor start excluded)",
    "caller_asyncio": "a bare aiohttp client in one process, same bodies and requests in flight: requests and "
    "answers only",
    "e2e_ours": "HttpLLMBatchOperator, task start to manifest: submission, driver, checks, reading the JSONL, "
    "requests, answers, Parquet outputs, manifest",
    "e2e_asyncio": "plain_http_client.py as a Ray job, submission to end: reading the JSONL, requests, answers, "
    "one Parquet file",
}


def prompts(n: int) -> list[dict]:
    return [{"id": i, "prompt": f"Give one word that rhymes with number {i}."} for i in range(n)]


def chat_body(prompt: str, max_tokens: int) -> dict:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0.0,
        "max_tokens": max_tokens,
    }


def bare_client(url: str, bodies: list[dict], in_flight: int) -> float:
    """Seconds for a bare aiohttp client to send every body, ``in_flight`` at once."""
    import aiohttp

    async def main() -> float:
        semaphore = asyncio.Semaphore(in_flight)
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=in_flight), headers={"Content-Type": "application/json"}
        ) as session:

            async def one(body: dict) -> None:
                async with semaphore, session.post(url, data=json.dumps(body)) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}")
                    json.loads(await resp.read())

            started = time.perf_counter()
            await asyncio.gather(*(one(b) for b in bodies))
            return time.perf_counter() - started

    return asyncio.run(main())


def run_caller(answered: object, rows: int, error_column: str) -> tuple[float, float]:
    """(seconds from the map's start to its last batch, rows/s from its first batch back to its last)."""
    started = time.perf_counter()
    first_at = first_rows = None
    got = errors = 0
    for batch in answered.iter_batches(batch_size=None, batch_format="numpy"):  # type: ignore[attr-defined]
        got += len(batch[error_column])
        errors += sum(1 for e in batch[error_column] if e)
        if first_at is None:
            first_at, first_rows = time.perf_counter(), got
    ended = time.perf_counter()
    if got != rows or errors or first_at is None or first_rows is None:
        raise RuntimeError(f"caller: {got} rows of {rows}, {errors} errors")
    return ended - started, (got - first_rows) / max(ended - first_at, 1e-9)


def caller_part(args: argparse.Namespace, save: Callable[[str, dict], None]) -> dict:
    import ray

    from airflow_provider_rayllm.contract.spec import HttpProcessorSpec
    from airflow_provider_rayllm.job.engines.http import call_endpoint, openai_body
    from airflow_provider_rayllm.job.stream import ERROR, KEPT_INPUT, PRE_ERROR, REQUEST
    from tests.integration.services import echo_server

    rows = prompts(args.caller_rows)
    sampling = {"temperature": 0.0, "max_tokens": args.max_tokens}
    samples: dict[str, list[float]] = {"ours": [], "ours_steady": [], "asyncio": []}
    with echo_server(0.0, LOG_DIR, count=False) as base:
        spec = HttpProcessorSpec(
            base_url=f"{base}/v1", model=MODEL_NAME, batch_size=args.batch_size, max_in_flight=args.in_flight
        )
        bodies = [chat_body(r["prompt"], args.max_tokens) for r in rows]
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            prepared = [
                {
                    KEPT_INPUT: {"id": r["id"]},
                    PRE_ERROR: "",
                    # The endpoint's body, as the job's request step writes it for the callers.
                    REQUEST: json.dumps(
                        openai_body({"messages": b["messages"], "sampling_params": sampling}, spec.endpoint, spec.model)
                    ),
                }
                for r, b in zip(rows, bodies)
            ]
            # Blocks of one batch each, as the job's stream hands them to its callers.
            ds = ray.data.from_items(prepared).repartition(target_num_rows_per_block=args.batch_size).materialize()
            bare_client(spec.url, bodies[:2000], args.in_flight)  # warm the endpoint
            for round_no in range(args.rounds):
                for name in ["ours", "asyncio"][round_no % 2 :] + ["ours", "asyncio"][: round_no % 2]:
                    if name == "ours":
                        seconds, steady = run_caller(call_endpoint(ds, spec), len(rows), ERROR)
                        samples["ours_steady"].append(steady)
                    else:
                        seconds = bare_client(spec.url, bodies, args.in_flight)
                    samples[name].append(len(rows) / seconds)
                    steady = f", {samples['ours_steady'][-1]:.0f} once up" if name == "ours" else ""
                    print(f"caller round {round_no + 1} {name}: {len(rows) / seconds:.0f} rows/s{steady}", flush=True)
                save("caller", caller_summary(len(rows), samples))  # a stopped run keeps its finished rounds
        finally:
            ray.shutdown()
    return caller_summary(len(rows), samples)


def caller_summary(rows: int, samples: dict[str, list[float]]) -> dict:
    return {
        "rows": rows,
        # ours: the whole map, actor start included; ours_steady: from its first batch back to its last.
        "rows_per_s": {name: spread(values) for name, values in samples.items()},
        "ours_over_asyncio": spread([o / a for o, a in zip(samples["ours"], samples["asyncio"])]),
        "ours_steady_over_asyncio": spread([o / a for o, a in zip(samples["ours_steady"], samples["asyncio"])]),
    }


class E2E:
    def __init__(self, args: argparse.Namespace, home: Path, info: object, base_url: str):
        from tests.integration.helpers import write_jsonl

        self.args, self.home, self.info, self.base_url = args, home, info, base_url
        self.input = write_jsonl(home / "in" / "prompts.jsonl", prompts(args.rows))
        self.plain_dir = home / "plain"
        self.plain_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / "benchmarks" / "plain_http_client.py", self.plain_dir / "plain_http_client.py")
        os.environ["AIRFLOW_CONN_LLM_BENCH"] = json.dumps({"conn_type": "http", "host": base_url})

    def ours(self, name: str) -> float:
        from airflow_provider_rayllm.operators.http_batch import HttpLLMBatchOperator
        from tests.integration.helpers import StandInTI

        op = HttpLLMBatchOperator(
            task_id="bench",
            ray_conn_id="ray_bench",
            http_conn_id="llm_bench",
            model=MODEL_NAME,
            input_uri=self.input,
            output_uri=str(self.home / "out" / name),
            prompt_column="prompt",
            sampling_params={"temperature": 0.0, "max_tokens": self.args.max_tokens},
            batch_size=self.args.batch_size,
            max_in_flight=self.args.in_flight,
            deferrable=False,
            poll_interval=0.5,
        )
        started = time.perf_counter()
        manifest = op.execute({"ti": StandInTI("http_bench", name, "bench")})
        seconds = time.perf_counter() - started
        if manifest["rows_out"] != self.args.rows or manifest.get("rows_errored"):
            raise RuntimeError(f"ours/{name}: {manifest['rows_out']} rows out, {manifest.get('rows_errored')} errors")
        return seconds

    def plain(self, name: str) -> float:
        from ray.job_submission import JobSubmissionClient

        out = self.home / "out" / f"{name}.parquet"
        out.parent.mkdir(parents=True, exist_ok=True)
        client = JobSubmissionClient(self.info.dashboard_url, headers={"Authorization": f"Bearer {self.info.token}"})
        url = f"{self.base_url}/chat/completions"
        started = time.perf_counter()
        sid = client.submit_job(
            entrypoint=(
                f"python plain_http_client.py {self.input} {out} {url} {MODEL_NAME} "
                f"{self.args.in_flight} {self.args.max_tokens}"
            ),
            runtime_env={"working_dir": str(self.plain_dir)},
        )
        while not client.get_job_status(sid).is_terminal():
            time.sleep(0.5)  # as often as the operator polls
        seconds = time.perf_counter() - started
        log = client.get_job_logs(sid)
        if f"PLAIN_DONE rows={self.args.rows} " not in log:
            raise RuntimeError(f"plain/{name} failed: {log[-3000:]}")
        return seconds


def e2e_part(args: argparse.Namespace, home: Path, save: Callable[[str, dict], None]) -> dict:
    from airflow_provider_rayllm.local.cluster import LocalRayCluster
    from airflow_provider_rayllm.local.models import smollm2_path
    from airflow_provider_rayllm.local.services import vllm_openai_server

    seconds: dict[str, list[float]] = {"ours": [], "asyncio": []}
    with vllm_openai_server(smollm2_path(), MODEL_NAME, LOG_DIR) as base_url:
        cluster = LocalRayCluster(state_dir=home / "ray", num_cpus=2)
        info = cluster.start()
        os.environ["AIRFLOW_CONN_RAY_BENCH"] = info.airflow_conn_uri()
        try:
            bench = E2E(args, home, info, base_url)
            bodies = [chat_body(r["prompt"], args.max_tokens) for r in prompts(64)]
            bare_client(f"{base_url}/chat/completions", bodies, args.in_flight)  # warm the server
            for round_no in range(args.rounds):
                for name in ["ours", "asyncio"][round_no % 2 :] + ["ours", "asyncio"][: round_no % 2]:
                    run = bench.ours if name == "ours" else bench.plain
                    seconds[name].append(run(f"r{round_no}-{name}"))
                    print(f"e2e round {round_no + 1} {name}: {seconds[name][-1]:.1f} s", flush=True)
                save("e2e", e2e_summary(args.rows, seconds))  # a stopped run keeps its finished rounds
        finally:
            cluster.stop()
    return e2e_summary(args.rows, seconds)


def e2e_summary(rows: int, seconds: dict[str, list[float]]) -> dict:
    return {
        "rows": rows,
        "seconds": {name: spread(values) for name, values in seconds.items()},
        "rows_per_s": {name: spread([rows / s for s in values]) for name, values in seconds.items()},
        # Paired by round: the plain client's seconds over ours (1.0 = as fast as the bare client).
        "ratio": spread([a / o for o, a in zip(seconds["ours"], seconds["asyncio"])]),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=2048, help="rows of the e2e part")
    parser.add_argument("--caller-rows", type=int, default=40_000, help="rows of the caller part")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--parts", default="caller,e2e")
    args = parser.parse_args()

    home = bench_home("http-bench")
    import ray
    import vllm

    results: dict = {
        "date": date.today().isoformat(),
        "rows_per_s_per_caller": None,
        "e2e_ratio_vs_asyncio": None,
        "includes": INCLUDES,
        "caller": None,
        "e2e": None,
        "rounds": args.rounds,
        "batch_size": args.batch_size,
        "actors": 1,
        "in_flight": args.in_flight,
        "max_tokens": args.max_tokens,
        "command": " ".join(["benchmarks/http_bench.py", *sys.argv[1:]]),
        "versions": {"ray": ray.__version__, "vllm": vllm.__version__, "python": platform.python_version()},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }
    out_dir = REPO / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)

    def save(part: str, figures: dict) -> None:
        results[part] = figures
        if results["caller"]:
            # One caller's own rate, once its actor is up (the whole map's, start included, is in "caller").
            results["rows_per_s_per_caller"] = results["caller"]["rows_per_s"]["ours_steady"]["median"]
        if results["e2e"]:
            results["e2e_ratio_vs_asyncio"] = results["e2e"]["ratio"]["median"]
        (out_dir / f"{results['date']}-http.json").write_text(json.dumps(results, indent=2))

    parts = args.parts.split(",")
    if "caller" in parts:
        save("caller", caller_part(args, save))
    if "e2e" in parts:
        save("e2e", e2e_part(args, home, save))
    print(json.dumps({k: results[k] for k in ("rows_per_s_per_caller", "e2e_ratio_vs_asyncio")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
