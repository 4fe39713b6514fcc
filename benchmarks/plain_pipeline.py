"""The reference guide's quickstart as a plain script, for `ray job submit` (the baseline of engine_bench).

    python plain_pipeline.py INPUT_JSONL OUTPUT_DIR SETTINGS_JSON

SETTINGS_JSON holds the same engine and processor settings our operator resolved for the same data, so
the two runs differ only by what the operator adds. The CPU stage sizes (0.2 CPU for the light stages)
are part of those settings: without them a 2-core cluster cannot run the pipeline at all.
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
    config = vLLMEngineProcessorConfig(
        model_source=settings["model_source"],
        engine_kwargs=settings["engine_kwargs"],
        concurrency=1,
        batch_size=settings["batch_size"],
        max_concurrent_batches=settings["max_concurrent_batches"],
        placement_group_config={"bundles": [{"CPU": 1}], "strategy": "PACK"},
        chat_template_stage=light,
        tokenize_stage=light,
        detokenize_stage=light,
        runtime_env={"env_vars": {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}},
    )
    sampling = settings["sampling_params"]
    processor = build_processor(
        config,
        preprocess=lambda row: {"messages": [{"role": "user", "content": row["prompt"]}], "sampling_params": sampling},
        postprocess=lambda row: {"id": row.get("id"), "response": row["generated_text"], "tokens": row["num_generated_tokens"]},
        preprocess_map_kwargs=light,
        postprocess_map_kwargs=light,
    )
    # The read task asks for a whole CPU by default; beside the engine (1 CPU) and the light stages
    # (3 x 0.2) a 2-core cluster has none left for it, and the job waits forever.
    ds = processor(ray.data.read_json(input_path, lines=True, ray_remote_args=light))
    ds.write_parquet(output_dir)
    print(f"PLAIN_DONE {time.time() - started:.3f}", flush=True)


if __name__ == "__main__":
    main()
