"""Our job driver on the device, submitted the way VLLMBatchOperator submits it.

    python3 ourjob.py --phase ourjob_gen --task generate [--n 2048] [--engine-kwargs JSON] ...
    python3 ourjob.py --phase ourjob_embed --task embed --model /tmp/gpu/minilm [--n 8192]

1. Makes sure the local Ray head answers (ray_head.py start).
2. Writes N rows {"id", "prompt"} to a local JSONL file (the same prompts as the offline phase).
3. Builds the spec with the project's own JobSpec model (so it follows whatever the spec is at run time)
   and writes it as spec.json into a fresh package folder.
4. Submits through the Jobs API (JobSubmissionClient) with the operator's entrypoint (read from
   operators/base.py), runtime_env {working_dir: package folder, worker_process_setup_hook, py_modules:
   [<repo>/airflow_provider_rayllm]} and metadata, like the operator; waits; stops the job at --deadline.
5. Collects the job log (full in logs/<phase>.full.log, trimmed in logs/<phase>.log), the manifest
   (the RAYLLM_MANIFEST line and _manifest.json under the sink), the timeline from the log, GPU samples
   (gpu.csv), and checks afterwards that no process holds the GPU (leftovers are reported, then killed).
6. For embeddings, compares 64 rows with sentence-transformers on the CPU (cosine similarity).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import time
import traceback
from datetime import datetime

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import ray_head  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
PACKAGE_DIR = os.path.join(REPO, "airflow_provider_rayllm")
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def operator_entrypoint() -> str:
    """The command the operator submits (contract.ENTRYPOINT)."""
    return contract_name("ENTRYPOINT", "python -m airflow_provider_rayllm.job spec.json")


def contract_name(name: str, default: str) -> str:
    """A name both halves share (contract.py, or where it lived before), without importing Airflow."""
    for module in (
        "airflow_provider_rayllm.contract.names",
        "airflow_provider_rayllm.contract",
        "airflow_provider_rayllm.job.secrets",
        "airflow_provider_rayllm.spec",
    ):
        try:
            value = getattr(__import__(module, fromlist=[name]), name, None)
        except Exception:
            continue
        if isinstance(value, str):
            return value
    return default


def setup_hook() -> str:
    return contract_name("SETUP_HOOK", "airflow_provider_rayllm.job.worker_setup.setup")


_DRIVER = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}).*?rayllm: (.*)$")
_VLLM = re.compile(r"(?:INFO|WARNING|DEBUG|ERROR) (\d\d-\d\d \d\d:\d\d:\d\d)")


def _local_epoch(stamp: str, fmt: str) -> float:
    return time.mktime(datetime.strptime(stamp, fmt).timetuple())


# The driver's own lines (its wording may change: several spellings are accepted, and a step whose line is not
# found is taken from the progress lines' arrival times instead).
DRIVER_MARKS = {
    "driver_started": ("submission ",),
    "checks_done": ("profile ", "vLLM engine for "),
    "source_read": ("source:", "input:"),
    "rows_prepared": ("rows in:",),
    "rows_done": ("rows out:",),
}


def timeline(log: str, t_submit: float) -> dict:
    """Seconds after submission of each step the log shows (None where a step left no line). Both the driver's
    and vLLM's stamps are the device's local time, as is t_submit."""
    marks: dict[str, float | None] = {k: None for k in (*DRIVER_MARKS, "engine_ready", "written")}
    year = datetime.now().year
    for line in log.splitlines():
        m = _DRIVER.match(line)
        if m:
            t = _local_epoch(m.group(1), "%Y-%m-%d %H:%M:%S") + int(m.group(2)) / 1000
            for key, prefixes in DRIVER_MARKS.items():
                if marks[key] is None and m.group(3).startswith(prefixes):
                    marks[key] = t
            marks["written"] = t  # the driver's last line
        if marks["engine_ready"] is None and "init engine" in line and "took" in line:
            v = _VLLM.search(line)
            if v:
                marks["engine_ready"] = _local_epoch(f"{year}-{v.group(1)}", "%Y-%m-%d %H:%M:%S")
    return {k: (None if v is None else round(v - t_submit, 2)) for k, v in marks.items()}


class ProgressWatch:
    """Reads the job log every few seconds while the job runs and notes when each RAYLLM_PROGRESS line first
    appeared (the lines carry no clock time): the first rows done and all rows done, to ~poll seconds."""

    def __init__(self, poll_s: float = 2.0):
        self.poll_s, self.last, self.seen = poll_s, 0.0, 0
        self.arrivals: list[tuple[float, dict]] = []

    def poll(self, client, sid: str, t_submit: float) -> None:
        if time.time() - self.last < self.poll_s:
            return
        self.last = time.time()
        try:
            lines = progress_lines(client.get_job_logs(sid))
        except Exception:
            return
        for p in lines[self.seen :]:
            self.arrivals.append((round(time.time() - t_submit, 1), p))
        self.seen = len(lines)

    def marks(self) -> dict:
        first = next((t for t, p in self.arrivals if int(p.get("rows_done") or 0) > 0), None)
        done = next(
            (
                t
                for t, p in self.arrivals
                if int(p.get("rows_total") or 0) > 0 and int(p.get("rows_done") or 0) >= int(p["rows_total"])
            ),
            None,
        )
        return {
            "progress_first_rows_s": first,
            "progress_all_rows_s": done,
            "progress_polls_s": self.poll_s,
            "progress_samples": [[t, p.get("rows_done"), p.get("tokens_out")] for t, p in self.arrivals][-60:],
        }


class EngineCoreWatch:
    """Looks every few seconds for vLLM's engine core processes (title VLLM::EngineCore...) and the engine actor's
    other children, and notes, once per pid: its title, its parent (pid and title), whether Ray's _raylet library
    is mapped in it, its threads and resident memory, and when it was first seen (seconds after submission).
    The title tells spawn from fork: a spawned engine core shows `multiprocessing.spawn import spawn_main` until
    vLLM renames it, next to a multiprocessing resource_tracker; _raylet is mapped either way (spawn's child
    imports the Ray worker's main module), seen on 2026-12-05."""

    def __init__(self, poll_s: float = 3.0):
        self.poll_s, self.last = poll_s, 0.0
        self.seen: dict[int, dict] = {}

    @staticmethod
    def _read(path: str, limit: int = 4096) -> str:
        try:
            with open(path, "rb") as f:
                return f.read(limit).replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            return ""

    def poll(self, t_submit: float) -> None:
        if time.time() - self.last < self.poll_s:
            return
        self.last = time.time()
        for pid_s in os.listdir("/proc"):
            if not pid_s.isdigit() or int(pid_s) in self.seen:
                continue
            cmd = self._read(f"/proc/{pid_s}/cmdline", 300)
            status = self._read(f"/proc/{pid_s}/status", 8192)
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            ppid = fields.get("PPid", "").strip()
            # the engine core by its title, or any child of the engine's Ray actor (should the title differ)
            parent = self._read(f"/proc/{ppid}/cmdline", 300) if ppid else ""
            if "EngineCore" not in cmd and not any(actor in parent for actor in ENGINE_ACTORS):
                continue
            maps = self._read(f"/proc/{pid_s}/maps", 64 * 1024 * 1024)
            self.seen[int(pid_s)] = {
                "first_seen_s": round(time.time() - t_submit, 1),
                "title": cmd[:160],
                "ppid": int(ppid) if ppid.isdigit() else None,
                "parent_title": self._read(f"/proc/{ppid}/cmdline", 200)[:160] if ppid else "",
                "raylet_mapped": "_raylet" in maps,
                "threads": fields.get("Threads", "").strip(),
                "vm_rss": fields.get("VmRSS", "").strip(),
            }

    def result(self) -> list[dict]:
        return [{"pid": pid, **v} for pid, v in sorted(self.seen.items())]


# vLLM's and our lines about how the engine core process was started, and any CUDA trouble.
_MP_LINE = re.compile(
    r"multiprocess|spawn|fork|VLLM_WORKER_MULTIPROC_METHOD|Automatically detected platform|CUDA error|"
    r"re-initialize CUDA|cuda.*initiali[sz]|EngineCore.*(?:pid|started|failed)|engine core",
    re.I,
)


def mp_lines(log: str, limit: int = 40) -> list[str]:
    out = [line[-400:] for line in log.splitlines() if _MP_LINE.search(line)]
    return out[:limit] + (["..."] + out[-10:] if len(out) > limit + 10 else out[limit:])


# The engine actors' classes: Ray's vLLM stage, and ours for embeddings (engines/vllm/embed.py).
ENGINE_ACTORS = ("vLLMEngineStageUDF", "VLLMEmbedStage")


def engine_ready_at(dashboard: str, actors: tuple[str, ...], lo: float, hi: float) -> float | None:
    """When the engine's actor finished its constructor (which starts vLLM's engine): the end of its actor
    creation task, in Ray's own task record (milliseconds), for the first such actor between lo and hi."""
    from ray.util.state import list_tasks

    tasks = list_tasks(address=dashboard, detail=True, limit=10000, raise_on_missing_output=False)  # the API's most
    ends = [
        t.end_time_ms / 1000
        for t in tasks
        if getattr(t, "type", "") == "ACTOR_CREATION_TASK"
        and any(actor in (getattr(t, "func_or_class_name", "") or "") for actor in actors)
        and getattr(t, "end_time_ms", None)
        and lo <= t.end_time_ms / 1000 <= hi
    ]
    return min(ends) if ends else None


def exact_windows(info, manifest: dict, dashboard: str, actors: tuple[str, ...] = ENGINE_ACTORS) -> dict:
    """The job's windows from exact clock times (epoch seconds), for report.py:
    whole job = Ray's own job record, submitted -> terminal (milliseconds);
    engine busy = the engine actor's constructor returned (Ray's task record) -> the last answer the job counted;
    first answer = the first answered row the job counted. The driver's counts are relative to its start
    (the manifest's started_at, microseconds)."""
    out: dict = {"submitted": info.start_time / 1000 if info.start_time else None}
    out["ended"] = info.end_time / 1000 if info.end_time else None
    tl = manifest.get("timeline") or {}
    try:
        started = datetime.fromisoformat(manifest["started_at"]).timestamp()
    except (KeyError, TypeError, ValueError):
        return out
    out["driver_started"] = started
    for key, name in (("first_answer_s", "first_answer"), ("last_answer_s", "last_answer")):
        out[name] = started + tl[key] if tl.get(key) is not None else None
    ready, source = None, None
    try:
        ready = engine_ready_at(dashboard, actors, started, out["last_answer"] or out["ended"] or time.time())
        source = "ray task record: engine actor constructor end" if ready else None
    except Exception as exc:  # the state API may refuse; the driver's own mark (10 s poll) is the fallback
        out["engine_ready_error"] = repr(exc)[:300]
    if ready is None and tl.get("engine_ready_s") is not None:
        ready, source = started + tl["engine_ready_s"], "manifest timeline engine_ready_s (10 s poll)"
    out["engine_ready"], out["engine_ready_from"] = ready, source
    return out


def progress_lines(log: str) -> list[dict]:
    out = []
    for line in log.splitlines():
        i = line.find("RAYLLM_PROGRESS ")
        if i >= 0:
            try:
                out.append(json.loads(line[i + len("RAYLLM_PROGRESS ") :]))
            except ValueError:
                pass
    return out


def manifest_from_log(log: str) -> dict | None:
    for line in reversed(log.splitlines()):
        i = line.find("RAYLLM_MANIFEST ")
        if i >= 0:
            try:
                return json.loads(line[i + len("RAYLLM_MANIFEST ") :])
            except ValueError:
                return None
    return None


def error_lines(log: str) -> list[str]:
    return [line[-400:] for line in log.splitlines() if "RAYLLM_ERROR " in line][-5:]


def output_files(sink: str, manifest: dict | None) -> list[str]:
    outputs = (manifest or {}).get("outputs_uri")
    roots = [outputs.removeprefix("file://")] if outputs else []
    roots.append(sink)
    for root in roots:
        files = sorted(
            f
            for f in glob.glob(os.path.join(root, "**", "*"), recursive=True)
            if f.endswith((".parquet", ".jsonl", ".json"))
            and "/errors" not in f
            and not f.endswith("manifest.json")
            and not any(part.startswith(("_", ".")) for part in os.path.relpath(f, root).split(os.sep)[:-1])
        )
        if files:
            return files
    return []


def embed_check(files: list[str], model_dir: str, rows: int = 64) -> dict:
    """Cosine similarity of our job's embeddings with sentence-transformers' for `rows` rows (on the CPU)."""
    import numpy as np
    import pyarrow.dataset as pads
    from sentence_transformers import SentenceTransformer

    fmt = "parquet" if files[0].endswith(".parquet") else "json"
    table = pads.dataset(files, format=fmt).head(rows)
    data = table.to_pylist()
    col = next((c for c in ("response", "embeddings", "embedding") if c in table.column_names), None)
    if col is None or "prompt" not in table.column_names:
        return {"ok": False, "error": f"no prompt/embedding column in {table.column_names}"}
    ours = np.array([r[col] for r in data], dtype=np.float32)
    ref = SentenceTransformer(model_dir, device="cpu").encode([r["prompt"] for r in data], convert_to_numpy=True)
    cos = (ours * ref).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(ref, axis=1))
    return {
        "ok": bool(cos.min() > 0.99),
        "rows": len(data),
        "dim": int(ours.shape[1]),
        "cosine_min": float(cos.min()),
        "cosine_mean": float(cos.mean()),
        "ours_norm_mean": float(np.linalg.norm(ours, axis=1).mean()),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", required=True)
    ap.add_argument("--task", choices=("generate", "embed"), default="generate")
    ap.add_argument("--n", type=int, default=common.N_PROMPTS)
    ap.add_argument("--in-tokens", type=int, default=common.IN_TOKENS)
    ap.add_argument("--max-tokens", type=int, default=common.MAX_TOKENS)
    ap.add_argument("--model", default=os.path.join(common.W, "model"))
    ap.add_argument("--engine-kwargs", default="{}", help="JSON merged over the base engine_kwargs")
    ap.add_argument("--runtime-env", default=None, help="JSON: the spec's processor.runtime_env")
    ap.add_argument(
        "--compile-cache", default=None, help="the spec's processor.compile_cache (a path or bucket prefix)"
    )
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--max-concurrent-batches", type=int, default=None)
    ap.add_argument("--deadline", type=float, default=time.time() + 540, help="epoch seconds: stop the job then")
    # Prefix workload (benchmarks/prefix_bench.py's rows): documents x questions, question-major, instead of N
    # distinct prompts; --prefix-window sets the prompt's prefix_window_rows (omitted: the spec's default).
    ap.add_argument("--prefix-docs", type=int, default=0)
    ap.add_argument("--prefix-questions", type=int, default=64)
    ap.add_argument("--prefix-words", type=int, default=880, help="words per document (~1,000 tokens)")
    ap.add_argument("--prefix-window", type=int, default=None)
    args = ap.parse_args()
    if args.prefix_docs:
        args.n = args.prefix_docs * args.prefix_questions

    res: dict = {"ok": False, "task": args.task, "n": args.n, "model": args.model}
    mon = None
    phase_dir = os.path.join(common.W, "jobs", args.phase)
    os.makedirs(phase_dir, exist_ok=True)
    try:
        head = ray_head.start()
        res["head"] = {k: head.get(k) for k in ("dashboard", "auth_mode", "reused", "up_s")}
        ray_head.apply_auth_env(head)

        # Rows: the same prompts as the offline phase (by the model's own tokenizer).
        t = time.time()
        source = os.path.join(phase_dir, "input.jsonl")
        if args.prefix_docs:
            from benchmarks.prefix_bench import rows as prefix_rows

            with open(source, "w") as f:
                for row in prefix_rows(args.prefix_docs, args.prefix_questions, args.prefix_words):
                    f.write(json.dumps({"id": row["id"], "prompt": row["prompt"]}) + "\n")
            res["prefix_workload"] = {
                "documents": args.prefix_docs,
                "questions_per_document": args.prefix_questions,
                "document_words": args.prefix_words,
                "input_order": "question-major: consecutive rows never share a document",
                "prefix_window_rows": args.prefix_window,
            }
        else:
            prompts, avg_in = common.make_prompts(args.model, args.n, args.in_tokens)
            with open(source, "w") as f:
                for i, p in enumerate(prompts):
                    f.write(json.dumps({"id": i, "prompt": p}) + "\n")
            res["avg_prompt_tokens_raw"] = avg_in
        res["rows_written_s"] = round(time.time() - t, 2)

        # The spec, through the project's own model.
        from airflow_provider_rayllm.contract.spec import JobSpec

        stamp = time.strftime("%Y%m%d-%H%M%S")
        sink = f"/tmp/out-{args.phase}-{stamp}"
        if args.task == "generate":
            engine_kwargs = {"load_format": "dummy", "max_model_len": 2048}
            prompt = {
                "prompt_column": "prompt",
                "output_column": "response",
                "sampling_params": {"max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0},
            }
            if args.prefix_window is not None:
                prompt["prefix_window_rows"] = args.prefix_window
        else:
            # MiniLM's limit (sentence-transformers' max_seq_length); a profile's default of 2048 would be refused
            engine_kwargs = {"max_model_len": 256}
            prompt = {"prompt_column": "prompt", "output_column": "response"}
        engine_kwargs.update(json.loads(args.engine_kwargs))
        processor = {
            "model_source": args.model,
            "task_type": args.task,
            "engine_kwargs": engine_kwargs,
            "resource_profile": "auto",
        }
        if args.runtime_env:
            processor["runtime_env"] = json.loads(args.runtime_env)
        if args.compile_cache:
            processor["compile_cache"] = args.compile_cache
        if args.batch_size:
            processor["batch_size"] = args.batch_size
        if args.max_concurrent_batches:
            processor["max_concurrent_batches"] = args.max_concurrent_batches
        body = {
            "version": 1,
            "kind": "vllm",
            "source": {"uris": [source], "format": "jsonl"},
            "prompt": prompt,
            "processor": processor,
            "sink": {"uri": sink, "format": "parquet"},
            "run": {"dag_id": "gpu_bench", "run_id": stamp, "task_id": args.phase},
        }
        spec = JobSpec.model_validate(body)
        pkg = os.path.join(phase_dir, f"pkg-{stamp}")
        os.makedirs(pkg)
        spec_file = contract_name("SPEC_FILE", "spec.json")
        with open(os.path.join(pkg, spec_file), "w") as f:
            f.write(spec.to_json())
        res["spec"] = json.loads(spec.to_json())

        # Submitted as the operator submits it.
        from ray.job_submission import JobSubmissionClient

        entrypoint = operator_entrypoint()
        runtime_env = {"working_dir": pkg, "worker_process_setup_hook": setup_hook(), "py_modules": [PACKAGE_DIR]}
        sid = f"gpu-{args.phase}-{stamp}".replace("_", "-")
        metadata = {
            "rayllm_output_uri": sink,
            "rayllm_submission_id": sid,
            "rayllm_spec_hash": spec.content_hash()[:16],
            "airflow_dag_id": "gpu_bench",
            "airflow_run_id": stamp,
            "airflow_task_id": args.phase,
            "airflow_map_index": "-1",
            "airflow_clear_number": "0",
        }
        res.update(entrypoint=entrypoint, runtime_env=runtime_env, submission_id=sid, sink=sink)
        client = JobSubmissionClient(head["dashboard"])
        mon = common.GpuMon(args.phase)
        t_submit = time.time()
        client.submit_job(entrypoint=entrypoint, submission_id=sid, runtime_env=runtime_env, metadata=metadata)
        res["submit_s"] = round(time.time() - t_submit, 2)
        print(f"== submitted {sid}: {entrypoint}", flush=True)
        status, t_running, stopped = None, None, False
        last_print = 0.0
        watch = ProgressWatch()
        cores = EngineCoreWatch()
        while True:
            watch.poll(client, sid, t_submit)
            cores.poll(t_submit)
            status = str(client.get_job_status(sid)).split(".")[-1]
            if status == "RUNNING" and t_running is None:
                t_running = time.time()
            if status in TERMINAL:
                break
            if time.time() > args.deadline and not stopped:
                print(f"== deadline: stopping {sid}", flush=True)
                client.stop_job(sid)
                stopped = True
            if time.time() - last_print > 30:
                last_print = time.time()
                used = common.gpu_used_mib()
                print(f"   {sid}: {status} after {time.time() - t_submit:.0f} s; GPU {used} MiB", flush=True)
            if stopped and time.time() > args.deadline + 40:
                break
            time.sleep(1)
        t_end = time.time()
        gpu_all = mon.stop()
        log = client.get_job_logs(sid)
        info = client.get_job_info(sid)
        with open(os.path.join(common.LOGS, f"{args.phase}.full.log"), "w") as f:
            f.write(log)
        with open(os.path.join(common.LOGS, f"{args.phase}.log"), "w") as f:
            f.write(common.trim_text(log))

        tl = timeline(log, t_submit)
        tl.update(watch.marks())
        for t, p in [(t_end - t_submit, x) for x in progress_lines(log)[watch.seen :]]:
            watch.arrivals.append((round(t, 1), p))  # lines that came after the last poll: at the end at most
        tl.update(watch.marks())
        manifest = manifest_from_log(log)
        try:
            with open(os.path.join(sink, contract_name("MANIFEST_NAME", "_manifest.json"))) as f:
                manifest_file = json.load(f)
        except (OSError, ValueError):
            manifest_file = None
        m = manifest_file or manifest or {}
        out_tokens = int(m.get("output_tokens") or 0)
        in_tokens = int(m.get("input_tokens") or 0)
        rows_out = int(m.get("rows_out") or 0)
        wall = t_end - t_submit
        if tl["rows_done"] is None and tl.get("progress_all_rows_s") is not None:
            # the driver's "rows out" line is gone: the progress line saying all rows are done (to ~3 s)
            tl["rows_done"] = tl["progress_all_rows_s"]
            tl["rows_done_from"] = "progress line arrival"
        if tl["rows_done"] is None and m.get("finished_at"):
            try:  # else the manifest's finish time bounds the engine phase (writing included)
                tl["rows_done"] = round(datetime.fromisoformat(m["finished_at"]).timestamp() - t_submit, 2)
                tl["rows_done_from"] = "manifest.finished_at"
            except ValueError:
                pass
        eng = None
        if tl["engine_ready"] is not None and tl["rows_done"] is not None and tl["rows_done"] > tl["engine_ready"]:
            eng = tl["rows_done"] - tl["engine_ready"]
        prog = progress_lines(log)
        try:
            windows = exact_windows(info, m, head["dashboard"])
        except Exception as exc:
            windows = {"error": repr(exc)[:300]}
        res.update(
            {
                "windows": windows,
                "status": status,
                "stopped_at_deadline": stopped,
                "wall_s": round(wall, 2),
                "queued_s": round(t_running - t_submit, 2) if t_running else None,
                "job_info": {
                    "start_time": info.start_time,
                    "end_time": info.end_time,
                    "message": (info.message or "")[:500],
                    "driver_exit_code": getattr(info, "driver_exit_code", None),
                },
                "timeline_s": tl,
                "engine_phase_s": eng,
                "rows_out": rows_out,
                "rows_errored": m.get("rows_errored"),
                "input_tokens": in_tokens,
                "output_tokens": out_tokens,
                "output_tok_per_s_wall": out_tokens / wall if wall > 0 else None,
                "output_tok_per_s_engine_phase": out_tokens / eng if eng and out_tokens else None,
                "rows_per_s_engine_phase": rows_out / eng if eng and rows_out else None,
                "input_tok_per_s_engine_phase": in_tokens / eng if eng and in_tokens else None,
                "progress_last": prog[-1] if prog else None,
                "progress_lines": len(prog),
                "manifest": {k: v for k, v in m.items() if k not in ("output_files", "error_files")},
                "manifest_file_found": manifest_file is not None,
                "manifest_in_log": manifest is not None,
                "output_files": len(m.get("output_files") or []),
                "error_lines": error_lines(log),
                "gpu": gpu_all,
                "gpu_engine_phase": mon.summary(t_submit + tl["engine_ready"], t_submit + tl["rows_done"])
                if eng
                else None,
                "vllm_log": common.parse_vllm_log(log),
                "prefix_cache_hit_rate_logged_pct": [
                    float(v) for v in re.findall(r"Prefix cache hit rate: ([\d.]+)%", log)
                ],
                "engine_core_processes": cores.result(),
                "mp_lines": mp_lines(log),
                "prefix_grouping_lines": [line[-300:] for line in log.splitlines() if "prefix grouping" in line][:3],
            }
        )
        if args.task == "generate":
            res["all_rows_full_length"] = out_tokens == args.n * args.max_tokens
        res["ok"] = status == "SUCCEEDED" and rows_out == args.n
        print(
            f"RESULT_OURJOB {args.phase}: {status}, {rows_out} rows, {out_tokens} tokens out, wall {wall:.1f} s, "
            f"engine phase {eng} s, timeline {tl}",
            flush=True,
        )
    except Exception:
        res["error"] = "\n".join(traceback.format_exc().splitlines()[-30:])
        print(res["error"], flush=True)
        if mon is not None and "gpu" not in res:
            res["gpu"] = mon.stop()

    # Nothing of the job may stay on the GPU once it is over.
    after = common.wait_gpu_free(timeout=30, limit_mib=10**9)
    res["gpu_after_job"] = after
    if after["leftover_apps"]:
        for app in after["leftover_apps"]:
            print(f"== LEFTOVER after {args.phase}: pid {app['pid']} {app['used_mib']} MiB {app['cmd']}", flush=True)
        res["leftovers_killed"] = common.kill_gpu_apps(after["leftover_apps"])
        res["gpu_used_mib_after_kill"] = common.gpu_used_mib()

    if args.task == "embed" and res.get("status") == "SUCCEEDED":
        try:
            files = output_files(res["sink"], res.get("manifest"))
            res["embed_check"] = embed_check(files, args.model) if files else {"ok": False, "error": "no output files"}
        except Exception as exc:
            res["embed_check"] = {"ok": False, "error": repr(exc)[:500]}
        print(f"== embedding check: {res['embed_check']}", flush=True)
    common.merge_phase(args.phase, res)
    return 0 if res["ok"] else 5


if __name__ == "__main__":
    sys.exit(main())
