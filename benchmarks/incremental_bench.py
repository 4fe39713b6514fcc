"""Incremental runs against full runs, side by side: a table of --rows reviews, of which --changed-pct percent
changed since the last run (most edited, a few deleted and as many added), answered by a local chat endpoint
that takes --delay-s per request (client and server share the machine's cores).

Once: the base run (day 1, every row computed, published). Then each round, in a rotated order, over the same
day-2 table:
- full: HttpLLMBatchOperator with the same settings and incremental off: every row is asked;
- incremental: the same with incremental=True and incremental_from the base run: only new and changed rows
  are asked, the others are adopted from the base's files.
Each side is timed from the task's start to the manifest in hand; rows computed and tokens spent come from
the manifest (tokens count the rows answered in this run, not the reused ones).

Writes benchmarks/results/<date>-incremental.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import LOG_DIR, bench_home, machine, write_results  # noqa: E402
from benchmarks.engine_bench import spread  # noqa: E402


def tables(rows: int, changed_pct: float) -> tuple[list[dict], list[dict], dict[str, int]]:
    """(day 1, day 2, what changed): of the changed rows, 80 % edited, 10 % deleted, 10 % added."""
    day1 = [{"id": i, "text": f"Review {i}: the product arrived on time and works as described."} for i in range(rows)]
    changed = int(rows * changed_pct / 100)
    deleted, added = changed // 10, changed // 10
    edited = changed - deleted - added
    step = max(1, rows // changed) if changed else rows
    picks = list(range(0, rows, step))[: edited + deleted]
    edits, gone = set(picks[:edited]), set(picks[edited:])
    day2 = []
    for row in day1:
        if row["id"] in gone:
            continue
        day2.append({**row, "text": row["text"] + " (edited)"} if row["id"] in edits else row)
    day2 += [{"id": rows + i, "text": f"New review {i}: fine."} for i in range(added)]
    return day1, day2, {"edited": edited, "deleted": deleted, "added": added}


class Bench:
    def __init__(self, args: argparse.Namespace, home: Path):
        from tests.integration.helpers import write_jsonl

        self.args, self.home = args, home
        day1, day2, self.changes = tables(args.rows, args.changed_pct)
        self.day2_rows = len(day2)
        self.day1 = write_jsonl(home / "in" / "day1.jsonl", day1)
        self.day2 = write_jsonl(home / "in" / "day2.jsonl", day2)
        self.base = str(home / "out" / "base")

    def run(self, name: str, input_uri: str, output_uri: str, **incremental: object) -> dict:
        from airflow_provider_rayllm.operators.http_batch import HttpLLMBatchOperator
        from tests.integration.helpers import StandInTI

        op = HttpLLMBatchOperator(
            task_id="bench",
            ray_conn_id="ray_bench",
            http_conn_id="llm_bench",
            model="echo",
            input_uri=input_uri,
            output_uri=output_uri,
            prompt_template="Label this review as positive or negative: {text}",
            id_column="id",
            sampling_params={"max_tokens": 8},
            batch_size=self.args.batch_size,
            max_in_flight=self.args.in_flight,
            object_store_window_mb=16,
            deferrable=False,
            poll_interval=0.5,
            **incremental,  # type: ignore[arg-type]
        )
        started = time.perf_counter()
        manifest = op.execute({"ti": StandInTI("incremental_bench", name, "bench")})
        seconds = time.perf_counter() - started
        if manifest.get("rows_errored"):
            raise RuntimeError(f"{name}: {manifest['rows_errored']} error rows")
        inc = manifest.get("incremental") or {}
        return {
            "seconds": seconds,
            "rows_out": manifest["rows_out"],
            "rows_computed": inc.get("rows_computed", manifest["rows_in"]),
            "rows_reused": inc.get("rows_reused", 0),
            "rows_dropped": inc.get("rows_dropped", 0),
            "tokens": manifest["input_tokens"] + manifest["output_tokens"],
        }

    def full(self, name: str) -> dict:
        return self.run(name, self.day2, str(self.home / "out" / name))

    def incremental(self, name: str) -> dict:
        return self.run(name, self.day2, str(self.home / "out" / name), incremental=True, incremental_from=self.base)


def summary(samples: dict[str, list[dict]]) -> dict:
    out: dict = {}
    for side, runs in samples.items():
        if runs:
            out[side] = {key: spread([r[key] for r in runs]) for key in runs[0]}
    if samples["full"] and samples["incremental"]:
        # Paired by round: the full run's seconds over the incremental run's.
        pairs = zip(samples["full"], samples["incremental"])
        out["speedup"] = spread([f["seconds"] / i["seconds"] for f, i in pairs])
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--changed-pct", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--delay-s", type=float, default=0.05, help="the endpoint's seconds per request")
    parser.add_argument("--batch-size", type=int, default=2000)
    parser.add_argument("--in-flight", type=int, default=256)
    args = parser.parse_args()

    home = bench_home("incremental-bench")
    import ray

    from airflow_provider_rayllm.local.cluster import LocalRayCluster
    from tests.integration.services import echo_server

    bench = Bench(args, home)
    results: dict = {
        "date": date.today().isoformat(),
        "description": (
            f"HttpLLMBatchOperator over a {args.rows}-row table of which {args.changed_pct:g} % changed since the "
            f"base run ({bench.changes}), against a local chat endpoint taking {args.delay_s} s per request, "
            f"{args.in_flight} requests in flight, batch_size {args.batch_size}, id_column 'id'. full: incremental "
            "off; incremental: incremental=True, incremental_from the base run. Seconds from the task's start to "
            "the manifest; tokens are the ones spent in the run (in + out)."
        ),
        "rows": args.rows,
        "day2_rows": bench.day2_rows,
        "changes": bench.changes,
        "rounds": args.rounds,
        "delay_s": args.delay_s,
        "command": " ".join(["benchmarks/incremental_bench.py", *sys.argv[1:]]),
        "versions": {"ray": ray.__version__, "python": sys.version.split()[0]},
        "machine": machine(),
    }
    samples: dict[str, list[dict]] = {"full": [], "incremental": []}
    with echo_server(args.delay_s, LOG_DIR, count=False) as url:
        os.environ["AIRFLOW_CONN_LLM_BENCH"] = json.dumps({"conn_type": "http", "host": f"{url}/v1"})
        cluster = LocalRayCluster(state_dir=home / "ray", num_cpus=2)
        info = cluster.start()
        os.environ["AIRFLOW_CONN_RAY_BENCH"] = info.airflow_conn_uri()
        try:
            base = bench.run("base", bench.day1, bench.base, incremental=True)
            results["base"] = base
            print(f"base: {base}", flush=True)
            for round_no in range(args.rounds):
                order = ["full", "incremental"][round_no % 2 :] + ["full", "incremental"][: round_no % 2]
                for side in order:
                    run = getattr(bench, side)(f"r{round_no}-{side}")
                    samples[side].append(run)
                    print(f"round {round_no + 1} {side}: {run}", flush=True)
                results.update(summary(samples))
                path = write_results("incremental", results)  # a stopped run keeps its finished rounds
        finally:
            cluster.stop()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
