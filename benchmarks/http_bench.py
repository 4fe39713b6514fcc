"""HTTP path, side by side, against the same local vLLM OpenAI-compatible server.

Three ways to send the same chat requests, in interleaved rounds:
- ours: the HttpLLMBatchOperator's Ray Data actor (HttpCaller), `max_in_flight` requests in flight;
- ray: Ray 2.60's HttpRequestProcessorConfig + build_processor, same batch_size and actor count;
- asyncio: a plain aiohttp client with the same number of requests in flight (no Ray).

Each round times the whole dataset (actor start included for both Ray paths). Writes
benchmarks/results/<date>-http.json; benchmarks/report.py turns it into docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL_NAME = "smollm2"


def rows(n: int) -> list[dict]:
    return [{"id": i, "prompt": f"Give one word that rhymes with number {i}."} for i in range(n)]


def payload(prompt: str, max_tokens: int) -> dict:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0.0,
        "max_tokens": max_tokens,
    }


def run_ours(base_url: str, data: list[dict], batch_size: int, actors: int, in_flight: int, max_tokens: int) -> float:
    import ray

    from airflow_provider_rayllm.contract.spec import HttpProcessorSpec
    from airflow_provider_rayllm.job.engines.http import HttpCaller
    from airflow_provider_rayllm.job.stream import ERROR, KEPT_INPUT, PRE_ERROR, REQUEST

    spec = HttpProcessorSpec(
        base_url=base_url, model=MODEL_NAME, concurrency=actors, batch_size=batch_size, max_in_flight=in_flight
    )
    prepared = [
        {
            KEPT_INPUT: {"id": r["id"]},
            PRE_ERROR: "",
            REQUEST: json.dumps(
                {
                    "messages": payload(r["prompt"], max_tokens)["messages"],
                    "sampling_params": {"temperature": 0.0, "max_tokens": max_tokens},
                }
            ),
        }
        for r in data
    ]
    ds = ray.data.from_items(prepared)
    started = time.perf_counter()
    out = ds.map_batches(
        HttpCaller,
        fn_constructor_kwargs={"http_json": spec.model_dump_json()},
        batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(size=actors),
        num_cpus=0.2,
        batch_format="numpy",
    ).materialize()
    seconds = time.perf_counter() - started
    errors = sum(1 for r in out.iter_rows() if r[ERROR])
    assert out.count() == len(data) and errors == 0, f"ours: {errors} errors"
    return seconds


def run_ray(base_url: str, data: list[dict], batch_size: int, actors: int, max_tokens: int) -> float:
    import ray
    from ray.data.llm import HttpRequestProcessorConfig, build_processor

    config = HttpRequestProcessorConfig(
        url=f"{base_url}/chat/completions", headers={}, batch_size=batch_size, concurrency=actors
    )
    processor = build_processor(
        config,
        preprocess=lambda row: {"payload": payload(row["prompt"], max_tokens)},
        postprocess=lambda row: {"response": row["http_response"]["choices"][0]["message"]["content"]},
    )
    ds = ray.data.from_items(data)
    started = time.perf_counter()
    out = processor(ds).materialize()
    seconds = time.perf_counter() - started
    assert out.count() == len(data)
    return seconds


def run_asyncio(base_url: str, data: list[dict], in_flight: int, max_tokens: int) -> float:
    import aiohttp

    async def main() -> float:
        semaphore = asyncio.Semaphore(in_flight)
        connector = aiohttp.TCPConnector(limit=in_flight)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def one(row: dict) -> None:
                async with semaphore:
                    async with session.post(
                        f"{base_url}/chat/completions", json=payload(row["prompt"], max_tokens)
                    ) as resp:
                        assert resp.status == 200, resp.status
                        await resp.json()

            started = time.perf_counter()
            await asyncio.gather(*(one(r) for r in data))
            return time.perf_counter() - started

    return asyncio.run(main())


def summarize(samples: list[float]) -> dict:
    return {
        "median_rows_per_s": statistics.median(samples),
        "min_rows_per_s": min(samples),
        "max_rows_per_s": max(samples),
        "samples_rows_per_s": samples,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--actors", type=int, default=1)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()

    import ray
    import vllm

    from airflow_provider_rayllm.local.models import smollm2_path
    from tests.integration.services import vllm_openai_server

    log_dir = REPO / "benchmarks" / "results" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    data = rows(args.rows)
    samples: dict[str, list[float]] = {"ours": [], "ray": [], "asyncio": []}
    with vllm_openai_server(smollm2_path(), MODEL_NAME, log_dir) as base_url:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        run_asyncio(base_url, data[:32], args.in_flight, args.max_tokens)  # warm the server
        for round_no in range(args.rounds):
            # Interleaved: each round runs every method once, in a rotated order.
            order = ["ours", "asyncio", "ray"][round_no % 3 :] + ["ours", "asyncio", "ray"][: round_no % 3]
            for name in order:
                if name == "ours":
                    secs = run_ours(base_url, data, args.batch_size, args.actors, args.in_flight, args.max_tokens)
                elif name == "ray":
                    secs = run_ray(base_url, data, args.batch_size, args.actors, args.max_tokens)
                else:
                    secs = run_asyncio(base_url, data, args.in_flight, args.max_tokens)
                samples[name].append(len(data) / secs)
                print(f"round {round_no + 1} {name}: {len(data) / secs:.1f} rows/s ({secs:.1f} s)", flush=True)
        ray.shutdown()

    methods = {name: summarize(values) for name, values in samples.items()}
    ours, ray_proc, plain = (methods[n]["median_rows_per_s"] for n in ("ours", "ray", "asyncio"))
    results = {
        "date": date.today().isoformat(),
        "rows": args.rows,
        "rounds": args.rounds,
        "batch_size": args.batch_size,
        "actors": args.actors,
        "in_flight": args.in_flight,
        "max_tokens": args.max_tokens,
        "http_vs_ray_processor_ratio": ours / ray_proc,
        "http_vs_asyncio_ratio": ours / plain,
        "asyncio_vs_ray_processor_ratio": plain / ray_proc,
        "methods": methods,
        "versions": {"ray": ray.__version__, "vllm": vllm.__version__, "python": platform.python_version()},
        "machine": {"cpus": __import__("os").cpu_count(), "platform": platform.platform()},
    }
    out_dir = REPO / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{results['date']}-http.json").write_text(json.dumps(results, indent=2))
    print(json.dumps({k: results[k] for k in ("http_vs_ray_processor_ratio", "http_vs_asyncio_ratio")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
