"""The reference guide's quickstart as a plain script, submitted as a Ray job (the baseline of engine_bench).

    python plain_pipeline.py INPUT_JSONL OUTPUT_DIR SETTINGS_JSON

SETTINGS_JSON holds the engine and processor settings our job resolved for the same data (its manifest's
``engine_kwargs`` and ``feed``), so the two runs differ only by what our job adds: its checks, building
requests from rows, counting, shaping and writing outputs and errors apart, and the manifest. The light
stages' fractional CPUs are part of those settings: without them a 2-core cluster cannot run the
pipeline at all.
"""

import json
import sys
import time

import ray
from ray.data.llm import build_processor, vLLMEngineProcessorConfig


def main() -> None:
    input_path, output_dir, settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    started = time.time()
    light = {"num_cpus": 0.2}
    feed = settings["feed"]
    stages = set(feed["stages"])
    config = vLLMEngineProcessorConfig(
        model_source=settings["model_source"],
        engine_kwargs=settings["engine_kwargs"],
        concurrency=1,
        batch_size=feed["batch_size"],
        max_concurrent_batches=feed["max_concurrent_batches"],
        max_pending_requests=feed["max_pending_requests"],
        placement_group_config=feed["placement_group_config"],
        chat_template_stage=light if "chat_template_stage" in stages else False,
        tokenize_stage=light if "tokenize_stage" in stages else False,
        detokenize_stage=light if "detokenize_stage" in stages else False,
        runtime_env={"env_vars": {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}},
    )
    sampling = settings["sampling_params"]
    processor = build_processor(
        config,
        preprocess=lambda row: {"messages": [{"role": "user", "content": row["prompt"]}], "sampling_params": sampling},
        postprocess=lambda row: {
            "id": row.get("id"),
            "response": row["generated_text"],
            "tokens": row["num_generated_tokens"],
        },
        preprocess_map_kwargs=light,
        postprocess_map_kwargs=light,
    )
    ds = ray.data.read_json(input_path, lines=True, num_cpus=light["num_cpus"])
    # Blocks of one batch, as our job cuts them: without it one input file is one block, and the engine
    # would see its rows a few batches at a time, in one task.
    ds = ds.repartition(target_num_rows_per_block=feed["batch_size"])
    processor(ds).write_parquet(output_dir, ray_remote_args=light)
    print(f"PLAIN_DONE {time.time() - started:.3f}", flush=True)


if __name__ == "__main__":
    main()
