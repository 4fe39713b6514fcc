"""What the sink's row-by-row steps cost: answered rows (an Arrow block, as the write task gets it) -> Python rows
-> output rows (the engine's shaper, no postprocess) -> one file's bytes (JSON lines or Parquet).

The sink is the last step that still handles rows one by one. This measures the three steps in one process, on
rows shaped like a job's (kept input columns, the request key, the answer, token counts), for the vLLM engine's
answers (``generated_text``) and an OpenAI-compatible endpoint's (the response body as text, parsed by the
shaper), and says how many rows a second one core gets through them. Compare with a job's rows/s (the scale
benchmark's, or the engine's): the sink's share of a core is that rate over this one. Writes
benchmarks/results/<date>-sink.json. Not part of `make bench`: it decides whether a columnar sink is worth its
schema migration, and measures no job.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import date
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import pyarrow as pa  # noqa: E402

from airflow_provider_rayllm.contract.names import REQUEST_KEY_COLUMN  # noqa: E402
from airflow_provider_rayllm.job.engines.http import RESPONSE, HttpShaper  # noqa: E402
from airflow_provider_rayllm.job.engines.vllm.outputs import VLLMShaper  # noqa: E402
from airflow_provider_rayllm.job.shaping import Shaper  # noqa: E402
from airflow_provider_rayllm.job.sinks.files import encode  # noqa: E402
from airflow_provider_rayllm.job.stream import ERROR, KEPT_INPUT  # noqa: E402
from benchmarks.common import machine, spread, write_results  # noqa: E402

STEPS = ("to_python_rows", "shape", "encode")


def kept(n: int) -> pa.Array:
    return pa.array(
        [
            {"id": i, "question": f"Question {i}: what does the text say about it?", REQUEST_KEY_COLUMN: f"{i:032x}"}
            for i in range(n)
        ]
    )


def vllm_block(n: int) -> pa.Table:
    answers = [f"Answer {i}: " + "a few words of the model's answer " * 4 for i in range(n)]
    return pa.table(
        {
            KEPT_INPUT: kept(n),
            "generated_text": answers,
            "num_input_tokens": [40] * n,
            "num_generated_tokens": [32] * n,
            ERROR: pa.nulls(n, pa.string()),
        }
    )


def http_block(n: int) -> pa.Table:
    def body(i: int) -> str:
        message = {"role": "assistant", "content": f"Answer {i}: " + "a few words of the model's answer " * 4}
        usage = {"prompt_tokens": 40, "completion_tokens": 32, "total_tokens": 72}
        return json.dumps(
            {
                "id": f"chatcmpl-{i}",
                "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": usage,
            }
        )

    return pa.table(
        {
            KEPT_INPUT: kept(n),
            RESPONSE: [body(i) for i in range(n)],
            "attempts": [1] * n,
            ERROR: pa.nulls(n, pa.string()),
        }
    )


def spec() -> Any:
    prompt = SimpleNamespace(output_column="response", postprocess=None)
    http = SimpleNamespace(endpoint="chat/completions")
    return SimpleNamespace(prompt=prompt, gated=False, task_type="generate", http=http)


SHAPERS: dict[str, tuple[Callable[[int], pa.Table], Callable[[Any], Shaper]]] = {
    "vllm": (vllm_block, lambda s: VLLMShaper(s, "/nonexistent")),
    "http": (http_block, lambda s: HttpShaper(s, "/nonexistent")),
}


def one_round(block: pa.Table, shaper: Shaper, fmt: str) -> dict[str, float]:
    t0 = time.perf_counter()
    rows = block.to_pylist()
    t1 = time.perf_counter()
    outputs = [shaper.shape(row).output for row in rows]
    t2 = time.perf_counter()
    data = encode([o for o in outputs if o is not None], fmt)
    t3 = time.perf_counter()
    assert len(data) > 0 and all(o is not None for o in outputs)
    return {"to_python_rows": t1 - t0, "shape": t2 - t1, "encode": t3 - t2}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000, help="rows of the block (a write task's file is 1,000)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    cases: dict[str, Any] = {}
    for engine, (make_block, make_shaper) in SHAPERS.items():
        block, shaper = make_block(args.rows), make_shaper(spec())
        for fmt in ("jsonl", "parquet"):
            samples = [one_round(block, shaper, fmt) for _ in range(args.rounds)]
            us_per_row = {step: spread([s[step] * 1e6 / args.rows for s in samples]) for step in STEPS}
            rate = spread([args.rows / sum(s.values()) for s in samples])
            cases[f"{engine}-{fmt}"] = {"us_per_row": us_per_row, "rows_per_s_one_core": rate}
            figures = {k: round(v["median"], 2) for k, v in us_per_row.items()}
            print(f"{engine} {fmt}: {figures} us a row; {rate['median']:,.0f} rows/s on one core")
    results = {
        "date": date.today().isoformat(),
        "command": " ".join(["benchmarks/sink_bench.py", *sys.argv[1:]]),
        "rows": args.rows,
        "rounds": args.rounds,
        "includes": "one process, no Ray: the block's rows as Python dicts (Arrow to_pylist), the engine's shaper "
        "on each (no postprocess), and encode() of the output rows into one file's bytes; not the write itself "
        "(a rename or one PUT) or the progress actor's call",
        "cases": cases,
        "machine": machine(),
    }
    print(f"wrote {write_results('sink', results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
