"""HTTP path, side by side, against the same local vLLM OpenAI-compatible server.

Three ways to send the same chat requests, in interleaved rounds:
- ours: the HttpLLMBatchOperator's Ray Data actor (HttpCaller), `max_in_flight` requests in flight;
- ray: Ray 2.60's HttpRequestProcessorConfig + build_processor, same batch_size and actor count;
- asyncio: a plain aiohttp client with the same number of requests in flight (no Ray).

Each round times the whole dataset (actor start included for both Ray paths). Writes
benchmarks/results/<date>.json and docs/PERFORMANCE.md with a plot.
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

    from airflow_provider_rayllm.job.http_pipeline import HttpCaller
    from airflow_provider_rayllm.job.prompts import REQUEST, STASH
    from airflow_provider_rayllm.spec import HttpProcessorSpec

    spec = HttpProcessorSpec(base_url=base_url, model=MODEL_NAME, concurrency=actors, batch_size=batch_size, max_in_flight=in_flight)
    prepared = [
        {STASH: {"id": r["id"]}, REQUEST: json.dumps({"messages": payload(r["prompt"], max_tokens)["messages"],
                                                      "sampling_params": {"temperature": 0.0, "max_tokens": max_tokens}})}
        for r in data
    ]
    ds = ray.data.from_items(prepared)
    started = time.perf_counter()
    out = ds.map_batches(
        HttpCaller,
        fn_constructor_kwargs={"http_json": spec.model_dump_json(), "output_column": "response"},
        batch_size=batch_size,
        concurrency=actors,
        num_cpus=0.2,
        batch_format="numpy",
    ).materialize()
    seconds = time.perf_counter() - started
    errors = sum(1 for r in out.iter_rows() if r["__rayllm_call_error"])
    assert out.count() == len(data) and errors == 0, f"ours: {errors} errors"
    return seconds


def run_ray(base_url: str, data: list[dict], batch_size: int, actors: int, max_tokens: int) -> float:
    import ray
    from ray.data.llm import HttpRequestProcessorConfig, build_processor

    config = HttpRequestProcessorConfig(url=f"{base_url}/chat/completions", headers={}, batch_size=batch_size, concurrency=actors)
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
                    async with session.post(f"{base_url}/chat/completions", json=payload(row["prompt"], max_tokens)) as resp:
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


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["ours", "asyncio", "ray"]
    labels = ["HttpLLMBatchOperator actor", "plain asyncio client", "Ray HttpRequestProcessor"]
    medians = [results["methods"][n]["median_rows_per_s"] for n in names]
    lows = [m - results["methods"][n]["min_rows_per_s"] for m, n in zip(medians, names)]
    highs = [results["methods"][n]["max_rows_per_s"] - m for m, n in zip(medians, names)]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh(labels, medians, xerr=[lows, highs], color=["#2b6cb0", "#718096", "#c05621"], capsize=4)
    ax.set_xlabel("rows per second (median, min-max over rounds)")
    ax.set_title(f"{results['rows']} chat requests, same local vLLM server, {results['in_flight']} in flight")
    for i, m in enumerate(medians):
        ax.text(m, i, f" {m:.0f}", va="center")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--actors", type=int, default=1)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--report-only", type=Path, help="redraw the plot and report from a results JSON")
    args = parser.parse_args()
    if args.report_only:
        results = json.loads(args.report_only.read_text())
        plot(results, REPO / "docs" / "img" / "http_throughput.png")
        write_report(results, args.report_only.resolve())
        return 0

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
    out_file = out_dir / f"{results['date']}.json"
    out_file.write_text(json.dumps(results, indent=2))
    plot(results, REPO / "docs" / "img" / "http_throughput.png")
    write_report(results, out_file)
    print(json.dumps({k: results[k] for k in ("http_vs_ray_processor_ratio", "http_vs_asyncio_ratio")}))
    return 0


def write_report(results: dict, out_file: Path) -> None:
    m = results["methods"]
    results = {**results, "plain_ratio_text": f"{m['asyncio']['median_rows_per_s'] / m['ray']['median_rows_per_s']:.1f}"}
    text = f"""# Performance

Figures from `make bench` on {results['date']} ({results['machine']['cpus']} CPUs, no GPU; Ray
{results['versions']['ray']}, vLLM {results['versions']['vllm']}). Raw numbers: `{out_file.relative_to(REPO)}`.

## HTTP path (HttpLLMBatchOperator)

{results['rows']} chat requests (max_tokens={results['max_tokens']}) to one local vLLM OpenAI-compatible server
(SmolLM2-135M on the CPU engine), {results['rounds']} interleaved rounds; batch_size={results['batch_size']},
{results['actors']} actor(s), {results['in_flight']} requests in flight. Ray paths are timed with actor start-up.

![throughput](img/http_throughput.png)

| method | median rows/s | min | max |
|---|---|---|---|
| HttpLLMBatchOperator actor | {m['ours']['median_rows_per_s']:.1f} | {m['ours']['min_rows_per_s']:.1f} | {m['ours']['max_rows_per_s']:.1f} |
| plain asyncio client | {m['asyncio']['median_rows_per_s']:.1f} | {m['asyncio']['min_rows_per_s']:.1f} | {m['asyncio']['max_rows_per_s']:.1f} |
| Ray HttpRequestProcessor | {m['ray']['median_rows_per_s']:.1f} | {m['ray']['min_rows_per_s']:.1f} | {m['ray']['max_rows_per_s']:.1f} |

- ours / Ray's processor: **{results['http_vs_ray_processor_ratio']:.2f}x** (target >= 5x)
- ours / plain asyncio: **{results['http_vs_asyncio_ratio']:.2f}x** (target >= 0.9x)

What bounds the ratios here:
- Against Ray's processor the ceiling is the server, not the client: a plain asyncio client with the
  same {results['in_flight']} requests in flight reaches only **{results['plain_ratio_text']}x** Ray's processor, because two CPU
  cores serve the model and run the clients, and the CPU engine saturates at about
  {m['asyncio']['median_rows_per_s']:.0f} rows/s. Ray's processor awaits the requests of a batch one after another, so it
  runs at one request's latency at a time; any server with more capacity widens the gap.
- Against the plain client, the Ray path pays for starting its actor and the dataset inside the timed
  window (the same for Ray's processor); with {results['rows']} rows that is the difference between the
  two medians ({results['rows'] / m['ours']['median_rows_per_s'] - results['rows'] / m['asyncio']['median_rows_per_s']:.1f} s).
"""
    (REPO / "docs" / "PERFORMANCE.md").write_text(text)


if __name__ == "__main__":
    sys.exit(main())
