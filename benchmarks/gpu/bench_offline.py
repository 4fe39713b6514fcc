"""vLLM's offline engine on the device: the ceiling our job is compared with.

    python3 bench_offline.py --phase offline [--mode chat|generate] [--n 2048] [--in-tokens 200]
        [--max-tokens 256] [--max-num-seqs 1024] [--max-num-batched-tokens 16384] [--model DIR]

N prompts of about 200 tokens, 256 tokens out each (ignore_eos, greedy), load_format="dummy" (random
weights in the 8B-shaped config). `chat` (default) applies the chat template as our job does
(prompt_column -> a user message), so both see the same token sequences. Times the imports, the engine's
start and the timed call separately; the scheduler limits are given explicitly (they differ between vLLM's
offline and async engines). The result goes into results.json under the phase name.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def first_done_bar():
    """A progress bar class for vLLM's `use_tqdm` that notes when the first request finished (vLLM calls
    update() of its "Processed prompts" bar as each request ends), writing nothing. vLLM also makes an
    "Adding requests" bar with the same class, updated as requests are queued: that one is not counted."""
    from tqdm import tqdm

    class FirstDone(tqdm):
        first_at: float | None = None

        def __init__(self, *a, **kw):
            kw["file"] = open(os.devnull, "w")  # noqa: SIM115 (closed with the process)
            self.counts = str(kw.get("desc") or "").startswith("Processed")
            super().__init__(*a, **kw)

        def update(self, n=1):
            if n and self.counts and FirstDone.first_at is None:
                FirstDone.first_at = time.time()
            return super().update(n)

    return FirstDone


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", default="offline")
    ap.add_argument("--mode", choices=("chat", "generate", "embed"), default="chat")
    ap.add_argument("--n", type=int, default=common.N_PROMPTS)
    ap.add_argument("--in-tokens", type=int, default=common.IN_TOKENS)
    ap.add_argument("--max-tokens", type=int, default=common.MAX_TOKENS)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--enforce-eager", action="store_true")
    # No warm-up by default: the whole process is what a user's offline script costs, and it is compared with
    # our whole job (submission -> SUCCEEDED), which has none either.
    ap.add_argument("--warmup", type=int, default=0, help="prompts of a 16-token warm-up call before the timed one")
    ap.add_argument("--model", default=os.environ.get("BENCH_MODEL", os.path.join(common.W, "model")))
    args = ap.parse_args()

    res: dict = {
        "ok": False,
        "mode": args.mode,
        "n_prompts": args.n,
        "max_tokens": args.max_tokens,
        "model": args.model,
    }
    mon = common.GpuMon(args.phase)
    llm = None
    try:
        t0 = time.time()
        import vllm
        from vllm import LLM, SamplingParams

        res["vllm_version"] = vllm.__version__
        res["import_s"] = round(time.time() - t0, 2)
        tp = time.time()
        prompts, avg_in = common.make_prompts(args.model, args.n, args.in_tokens)
        res["prompt_build_s"] = round(time.time() - tp, 2)
        res["avg_prompt_tokens_raw"] = avg_in
        if args.mode == "embed":  # a real small model (MiniLM) with vLLM's own defaults for it
            kw = dict(model=args.model, seed=0, gpu_memory_utilization=args.gpu_memory_utilization)
        else:
            kw = dict(
                model=args.model,
                load_format="dummy",
                max_model_len=args.max_model_len,
                dtype="bfloat16",
                gpu_memory_utilization=args.gpu_memory_utilization,
                seed=0,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
            )
        if args.enforce_eager:
            kw["enforce_eager"] = True
        res["llm_kwargs"] = kw
        t1 = time.time()
        llm = LLM(**kw)
        res["engine_init_s"] = round(time.time() - t1, 2)
        try:
            sc = llm.llm_engine.vllm_config.scheduler_config
            cc = llm.llm_engine.vllm_config.cache_config
            res["scheduler"] = {
                "max_num_seqs": sc.max_num_seqs,
                "max_num_batched_tokens": sc.max_num_batched_tokens,
                "chunked_prefill": getattr(sc, "enable_chunked_prefill", None),
                "prefix_caching": getattr(cc, "enable_prefix_caching", None),
            }
        except Exception as exc:  # only informative
            res["scheduler_error"] = repr(exc)

        bar = first_done_bar()

        def run(batch, sp, tqdm_bar=False):
            if args.mode == "embed":
                return llm.embed(batch, use_tqdm=tqdm_bar)
            if args.mode == "chat":
                return llm.chat([[{"role": "user", "content": p}] for p in batch], sp, use_tqdm=tqdm_bar)
            return llm.generate(batch, sp, use_tqdm=tqdm_bar)

        if args.warmup:
            tw = time.time()
            run(prompts[: args.warmup], None if args.mode == "embed" else SamplingParams(max_tokens=16, temperature=0))
            res["warmup_s"] = round(time.time() - tw, 2)
        sp = (
            None if args.mode == "embed" else SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0)
        )
        t2 = time.time()
        outs = run(prompts, sp, bar)
        t3 = time.time()
        # Exact clock times (epoch seconds) for report.py's windows: the process start (go.sh's, before the
        # interpreter), the engine ready, the timed call and its first finished request.
        res["times"] = {
            "process_start": float(os.environ["PHASE_T0"]) if os.environ.get("PHASE_T0") else None,
            "engine_ready": t1 + res["engine_init_s"],
            "call_start": t2,
            "first_answer": bar.first_at,
            "first_answer_from": "Processed prompts bar",
            "call_end": t3,
        }
        n_in = sum(len(o.prompt_token_ids or []) for o in outs)
        if args.mode == "embed":
            dim = len(outs[0].outputs.embedding)
            res.update(
                ok=True,
                gen_s=round(t3 - t2, 3),
                rows=len(outs),
                input_tokens=n_in,
                dim=dim,
                avg_prompt_tokens=n_in / len(outs),
                rows_per_s=len(outs) / (t3 - t2),
                input_tok_per_s=n_in / (t3 - t2),
                gpu_during_gen=mon.summary(t2, t3),
                gen_window=[t2, t3],
            )
            print(f"RESULT_OFFLINE {args.phase}: {len(outs)} embeddings (dim {dim}) in {t3 - t2:.2f} s", flush=True)
        else:
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            res.update(
                ok=True,
                gen_s=round(t3 - t2, 3),
                output_tokens=n_out,
                input_tokens=n_in,
                avg_prompt_tokens=n_in / len(outs),
                output_tok_per_s=n_out / (t3 - t2),
                total_tok_per_s=(n_out + n_in) / (t3 - t2),
                gpu_during_gen=mon.summary(t2, t3),
                gen_window=[t2, t3],
                sample_text=outs[0].outputs[0].text[:80],
            )
            print(
                f"RESULT_OFFLINE {args.phase}: {n_out} tokens out in {t3 - t2:.1f} s = {n_out / (t3 - t2):,.0f} tok/s",
                flush=True,
            )
    except Exception:
        res["error"] = "\n".join(traceback.format_exc().splitlines()[-30:])
        print(res["error"], flush=True)
    res["gpu"] = mon.stop()
    # Shut the engine down properly: a process left behind keeps ~129 GB and the next engine refuses to start.
    if llm is not None:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception as exc:
            print("engine shutdown:", repr(exc), flush=True)
        del llm
        gc.collect()
    res["after_shutdown"] = common.wait_gpu_free(timeout=45, limit_mib=10**9, exclude=(os.getpid(),))
    common.merge_phase(args.phase, res)
    return 0 if res["ok"] else 3


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
