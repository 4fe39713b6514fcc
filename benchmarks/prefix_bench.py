"""Prefix grouping against the input's own order: one document (~1,000 tokens) asked many questions, on the CPU
vLLM engine (SmolLM2) with prefix caching on, one local Ray cluster, both sides in every round.

The input lists the questions question-major (document 0, 1, ..., P-1, then the next question to each), so
in input order consecutive requests never share a document. The engine's KV cache is set small
(``kv_cache_memory_bytes``, default 64 MiB, about 2,900 tokens of SmolLM2: fewer documents than the input
has), which is the case grouping is for: a cache that holds every document hits in any order. The default workload
(4 documents x 16 questions) is small because the input-order side pays a full prefill per row: on 2 busy
CPUs about 300 prompt tokens/s, so 64 questions to each of 8 documents would take that side alone about
half an hour.

Sides, alternated in each round:
- grouped: VLLMBatchOperator with the default ``prefix_window_rows`` (2,048 rows: the whole input here);
- input order: the same task with ``prefix_window_rows=0``.
Each side's figures: job wall (Jobs API: submitted -> SUCCEEDED, engine start-up included), the answering
window (vLLM's "init engine" line -> the last answered row), prompt and output tokens per second over
that window and over the job wall, and vLLM's logged prefix-cache hit rates.

Writes benchmarks/results/<date>-prefix.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
from datetime import date, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import bench_home, cpu_versions, machine, spread, write_results  # noqa: E402
from benchmarks.engine_bench import engine_ready_at  # noqa: E402

_HIT_RATE = re.compile(r"Prefix cache hit rate: ([\d.]+)%")
WORDS = (
    "river bread comet violin glacier owl bridge tea harbour lantern orchard meadow copper signal engine "
    "quarry ledger valley thunder pepper marble falcon window garden pocket ribbon saddle timber vessel"
).split()
SIDES = {"grouped": None, "input_order": 0}


def document(seed: int, words: int) -> str:
    rng = random.Random(seed)
    sentences = []
    while sum(len(s.split()) for s in sentences) < words:
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + ".")
    return f"Document {seed}. " + " ".join(sentences)


def rows(prefixes: int, questions: int, words: int) -> list[dict[str, Any]]:
    docs = [document(d, words) for d in range(prefixes)]
    return [
        {"id": q * prefixes + d, "doc": d, "prompt": f"{docs[d]}\n\nQuestion {q}: which word comes first?"}
        for q in range(questions)
        for d in range(prefixes)
    ]


class Bench:
    def __init__(self, args: argparse.Namespace, home: Path):
        from airflow_provider_rayllm.hooks.ray_job import RayJobHook
        from airflow_provider_rayllm.local.models import smollm2_path
        from tests.integration.helpers import write_jsonl

        self.args, self.home = args, home
        self.model = str(smollm2_path())
        self.input = write_jsonl(home / "in" / "questions.jsonl", rows(args.prefixes, args.questions, args.words))
        self.hook = RayJobHook(ray_conn_id="ray_bench")
        self.engine_kwargs = {
            "enable_prefix_caching": True,
            "kv_cache_memory_bytes": args.kv_cache_mib << 20,
            "max_model_len": args.max_model_len,
        }

    def run(self, side: str, name: str) -> dict[str, Any]:
        from airflow_provider_rayllm.operators.vllm_batch import VLLMBatchOperator
        from tests.integration.helpers import StandInTI

        op = VLLMBatchOperator(
            task_id="bench",
            ray_conn_id="ray_bench",
            model_source=self.model,
            input_uri=self.input,
            output_uri=str(self.home / "out" / name),
            prompt_column="prompt",
            sampling_params={"max_tokens": self.args.max_tokens, "temperature": 0.0, "ignore_eos": True},
            engine_kwargs=self.engine_kwargs,
            batch_size=self.args.batch_size,
            prefix_window_rows=SIDES[side],
            deferrable=False,
            poll_interval=0.5,
        )
        manifest = op.execute({"ti": StandInTI("prefix_bench", name, "bench")})
        info = self.hook.get_job_info(manifest["submission_id"]) or {}
        wall = (float(info["end_time"]) - float(info["start_time"])) / 1000
        log = self.hook.get_job_logs(manifest["submission_id"])
        t = manifest["timeline"]
        # vLLM's "init engine" line (1 s resolution) to the last answered row: the engine's work, no start-up.
        origin = datetime.fromisoformat(manifest["started_at"]).timestamp()
        ready = engine_ready_at(log)
        window = origin + t["last_answer_s"] - ready if ready is not None else float("nan")
        tokens_in, tokens_out = manifest["input_tokens"], manifest["output_tokens"]
        hits = [float(v) for v in _HIT_RATE.findall(log)]
        return {
            "job_wall_s": wall,
            "answering_s": window,
            "prompt_tokens_per_s": tokens_in / window,
            "output_tokens_per_s": tokens_out / window,
            "prompt_tokens_per_s_wall": tokens_in / wall,
            "rows": manifest["rows_out"],
            "rows_errored": manifest["rows_errored"],
            "input_tokens": tokens_in,
            "output_tokens": tokens_out,
            "prefix_cache_hit_rate_logged_pct": hits,
        }


def grouping_cost(rows_in_window: int = 2048) -> dict[str, Any]:
    """The grouping stage alone on one default window (32 documents x 64 questions, chat requests as the job
    builds them), in this process: what the feature costs where it cannot help."""
    import time

    import pyarrow as pa

    from airflow_provider_rayllm.job.requests.prefix import PrefixGrouping
    from airflow_provider_rayllm.job.stream import KEPT_INPUT, REQUEST

    window = rows(32, rows_in_window // 32, 880)
    requests = [json.dumps({"messages": [{"role": "user", "content": r["prompt"]}]}) for r in window]
    batch = pa.table({KEPT_INPUT: [{"id": r["id"]} for r in window], REQUEST: requests})
    times = []
    for _ in range(3):
        started = time.perf_counter()
        PrefixGrouping()(batch)
        times.append(time.perf_counter() - started)
    seconds = statistics.median(times)
    return {
        "rows": len(window),
        "request_mib": round(sum(len(r) for r in requests) / 2**20, 1),
        "seconds": round(seconds, 4),
        "rows_per_s": round(len(window) / seconds),
    }


def summarize(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:

    keys = ("job_wall_s", "answering_s", "prompt_tokens_per_s", "output_tokens_per_s", "prompt_tokens_per_s_wall")
    figures = {side: {k: spread([r[k] for r in values]) for k in keys} for side, values in runs.items() if values}
    ratios = {}
    if len(figures) == 2:
        g, o = figures["grouped"], figures["input_order"]
        ratios = {
            "prompt_tokens_per_s": g["prompt_tokens_per_s"]["median"] / o["prompt_tokens_per_s"]["median"],
            "answering_s": o["answering_s"]["median"] / g["answering_s"]["median"],
            "job_wall_s": o["job_wall_s"]["median"] / g["job_wall_s"]["median"],
        }
    results = {
        "date": date.today().isoformat(),
        "command": " ".join([".venv/bin/python benchmarks/prefix_bench.py", *sys.argv[1:]]),
        "workload": {
            "prefixes": args.prefixes,
            "questions_per_prefix": args.questions,
            "document_words": args.words,
            "input_order": "question-major: consecutive rows never share a document",
            "max_tokens": args.max_tokens,
            "batch_size": args.batch_size,
            "engine_kwargs": {
                "enable_prefix_caching": True,
                "kv_cache_memory_bytes": args.kv_cache_mib << 20,
                "max_model_len": args.max_model_len,
            },
        },
        "sides": {
            "grouped": "VLLMBatchOperator, prefix_window_rows default (2048 rows: the whole input in one window)",
            "input_order": "the same task with prefix_window_rows=0 (rows reach the engine in the input's order)",
        },
        "figures_include": {
            "job_wall_s": "Jobs API submitted -> SUCCEEDED: driver start, engine start-up, answering, publish",
            "answering_s": "vLLM's 'init engine' log line (1 s resolution) -> last answered row (manifest timeline): "
            "the engine's work, no start-up",
            "prompt_tokens_per_s": "prompt tokens (cached ones included, as vLLM reports them) / answering_s",
        },
        "rounds": min(len(v) for v in runs.values()),
        "model": "SmolLM2-135M-Instruct (CPU vLLM)",
        "ratio_grouped_over_input_order": ratios,
        "grouping_stage_alone": grouping_cost(),
        "figures": figures,
        "runs": runs,
        "versions": cpu_versions(),
        "machine": machine(),
    }
    write_results("prefix", results)
    return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--words", type=int, default=880, help="words per document (~1,000 SmolLM2 tokens)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--kv-cache-mib", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1536)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    home = bench_home("prefix-bench")

    from airflow_provider_rayllm.local.cluster import LocalRayCluster

    cluster = LocalRayCluster(state_dir=home / "ray", num_cpus=2)
    info = cluster.start()
    os.environ["AIRFLOW_CONN_RAY_BENCH"] = info.airflow_conn_uri()
    bench = Bench(args, home)
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    results: dict[str, Any] = {}
    try:
        for round_no in range(args.rounds):
            order = list(SIDES) if round_no % 2 == 0 else list(reversed(SIDES))
            for side in order:
                result = bench.run(side, f"r{round_no}-{side}")
                runs[side].append(result)
                shown = {k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}
                print(f"round {round_no + 1} {side}: {shown}", flush=True)
            results = summarize(args, runs)  # a stopped run still leaves its finished rounds
    finally:
        cluster.stop()
    print(json.dumps(results.get("ratio_grouped_over_input_order")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
