"""A bare asyncio client as a plain script, submitted as a Ray job (the end-to-end baseline of http_bench).

    python plain_http_client.py INPUT_JSONL OUTPUT_PARQUET URL MODEL IN_FLIGHT MAX_TOKENS

It does what the HTTP job must do at the least: read the prompts, send each to the endpoint with IN_FLIGHT
requests at once over one aiohttp session, and write the answers with their usage to one Parquet file. No
retries, no error rows, no Ray Data: the time of the requests themselves, plus reading and writing.
"""

import asyncio
import json
import sys
import time

import aiohttp
import pyarrow as pa
import pyarrow.parquet as pq


async def answer_all(rows: list[dict], url: str, model: str, in_flight: int, max_tokens: int) -> list[dict]:
    semaphore = asyncio.Semaphore(in_flight)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=in_flight)) as session:

        async def one(row: dict) -> dict:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": row["prompt"]}],
                "temperature": 0.0,
                "max_tokens": max_tokens,
            }
            async with semaphore, session.post(url, json=body) as resp:
                answer = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {answer}")
            usage = answer.get("usage") or {}
            return {
                "id": row["id"],
                "response": answer["choices"][0]["message"]["content"],
                "num_input_tokens": usage.get("prompt_tokens", 0),
                "num_generated_tokens": usage.get("completion_tokens", 0),
            }

        return await asyncio.gather(*(one(r) for r in rows))


def main() -> None:
    input_path, output_path, url, model = sys.argv[1:5]
    in_flight, max_tokens = int(sys.argv[5]), int(sys.argv[6])
    started = time.time()
    with open(input_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    answers = asyncio.run(answer_all(rows, url, model, in_flight, max_tokens))
    pq.write_table(pa.Table.from_pylist(answers), output_path)
    print(f"PLAIN_DONE rows={len(answers)} seconds={time.time() - started:.2f}", flush=True)


if __name__ == "__main__":
    main()
