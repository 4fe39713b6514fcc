"""vLLM's own offline path over the same prompts and engine settings (the baseline of engine efficiency).

    python offline_generate.py SETTINGS_JSON PROMPTS_JSONL

Prints one JSON line: output tokens, seconds of generation (engine start and a warm-up excluded).
"""

import json
import sys
import time

from vllm import LLM, SamplingParams


def main() -> None:
    settings = json.loads(sys.argv[1])
    with open(sys.argv[2], encoding="utf-8") as handle:
        prompts = [json.loads(line)["prompt"] for line in handle if line.strip()]
    # task_type is a key of Ray's processor settings (our manifest's engine_kwargs carry it), not of vLLM's.
    engine_kwargs = {k: v for k, v in settings["engine_kwargs"].items() if k != "task_type"}
    llm = LLM(model=settings["model_source"], **engine_kwargs)
    params = SamplingParams(**settings["sampling_params"])
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    llm.chat(conversations[:8], params, use_tqdm=False)  # warm-up
    started = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print("OFFLINE " + json.dumps({"rows": len(outputs), "output_tokens": tokens, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
