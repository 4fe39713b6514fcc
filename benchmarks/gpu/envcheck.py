"""What the device offers our job: versions, where each module comes from (the carried /tmp/site or the
image), and the imports the job driver and the Ray head need. Writes results.json's `envcheck` phase.

    python3 envcheck.py            (PYTHONPATH=/tmp/site:<repo>, set by go.sh)
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

SITE = os.environ.get("SITE", "/tmp/site")
MODULES = [
    # the job's own needs
    "pydantic",
    "pydantic_core",
    "pyarrow",
    "cloudpickle",
    "aiohttp",
    "tenacity",
    "numpy",
    "pandas",
    "fsspec",
    # Ray and its dashboard (the Jobs API)
    "ray",
    "grpc",
    "google.protobuf",
    "msgpack",
    "yaml",
    "requests",
    "click",
    "filelock",
    "jsonschema",
    "aiohttp_cors",
    "opencensus",
    "opentelemetry.sdk",
    "opentelemetry.exporter.prometheus",
    "prometheus_client",
    "colorful",
    "psutil",
    "setproctitle",
    # vLLM's
    "vllm",
    "torch",
    "triton",
    "transformers",
    "tokenizers",
    "safetensors",
    "huggingface_hub",
    "pycountry",
    "mistral_common",
    "openai",
    "fastapi",
    "zmq",
    "msgspec",
    "blake3",
    "cbor2",
    # tests / optional
    "sentence_transformers",
    "pytest",
    "boto3",
    "airflow",
]


def where(mod) -> str:
    path = getattr(mod, "__file__", None) or str(getattr(mod, "__path__", ["?"]))
    return "site" if str(path).startswith(SITE) else "image" if path else "?"


def check(name: str, fn) -> dict:
    t = time.time()
    try:
        value = fn()
        return {"ok": True, "s": round(time.time() - t, 2), **({"value": value} if value is not None else {})}
    except BaseException as exc:  # an import can raise SystemExit and the like
        return {
            "ok": False,
            "s": round(time.time() - t, 2),
            "error": f"{type(exc).__name__}: {exc}"[:500],
            "trace": traceback.format_exc().splitlines()[-6:],
        }


def main() -> int:
    res: dict = {
        "python": sys.version,
        "executable": sys.executable,
        "which_python": shutil.which("python"),
        "which_python3": shutil.which("python3"),
        "pythonpath": os.environ.get("PYTHONPATH"),
        "cpus": os.cpu_count(),
    }
    try:
        # The entrypoint's `python` must be an interpreter that has torch (go.sh puts a wrapper first on PATH).
        r = subprocess.run(
            ["python", "-c", "import sys, torch; print(sys.executable, torch.__version__)"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        res["python_on_path"] = r.stdout.strip() or r.stderr.strip()[-300:]
        res["python_on_path_has_torch"] = r.returncode == 0
        st = os.statvfs("/dev/shm")
        res["dev_shm_gib"] = round(st.f_bavail * st.f_frsize / 2**30, 1)
        st = os.statvfs("/tmp")
        res["tmp_free_gib"] = round(st.f_bavail * st.f_frsize / 2**30, 1)
        with open("/proc/meminfo") as f:
            res["meminfo"] = {k: v.strip() for k, v in (line.split(":", 1) for line in f.read().splitlines()[:3])}
        res["nvidia_smi"] = common.nvsmi(
            "--query-gpu=name,memory.total,memory.used,driver_version", "--format=csv,noheader"
        ).strip()
        res["kernel"] = os.uname().release
    except Exception as exc:
        res["host_error"] = repr(exc)

    # `import vllm` first and alone: its cold import time is part of every engine's start.
    res["import_vllm"] = check("vllm", lambda: importlib.import_module("vllm").__version__)
    mods = {}
    for name in MODULES:

        def load(name=name):
            mod = importlib.import_module(name)
            return {"version": getattr(mod, "__version__", None), "from": where(mod)}

        r = check(name, load)
        mods[name] = r.get("value") if r["ok"] else {"missing": r["error"]}
    res["modules"] = mods

    res["torch_cuda"] = check(
        "torch",
        lambda: (
            lambda t: {
                "version": t.__version__,
                "cuda": t.version.cuda,
                "available": t.cuda.is_available(),
                "device": t.cuda.get_device_name(0) if t.cuda.is_available() else None,
            }
        )(importlib.import_module("torch")),
    )
    res["vllm_chain"] = check(
        "vllm chain",
        lambda: [
            importlib.import_module(m) and m
            for m in (
                "vllm.v1.engine.core",
                "vllm.v1.worker.gpu_model_runner",
                "vllm.model_executor.models.llama",
                "vllm.model_executor.models.bert",
                "vllm._C_stable_libtorch",
            )
        ],
    )

    def fa():
        from vllm.vllm_flash_attn import flash_attn_interface as f

        return {
            "FA2": getattr(f, "FA2_AVAILABLE", "?"),
            "FA3": getattr(f, "FA3_AVAILABLE", "?"),
            "FA3_reason": str(getattr(f, "FA3_UNAVAILABLE_REASON", "")),
        }

    res["flash_attn"] = check("fa", fa)

    def ray_llm():
        from ray.data.llm import build_processor, vLLMEngineProcessorConfig  # noqa: F401

        return "ok"

    res["ray_data_llm"] = check("ray.data.llm", ray_llm)
    res["ray_dashboard_deps"] = check(
        "dashboard", lambda: importlib.import_module("ray.dashboard.optional_deps") and "ok"
    )
    res["ray_job_sdk"] = check("sdk", lambda: importlib.import_module("ray.job_submission") and "ok")

    # Our driver must import without Airflow (the Ray half never imports it). The job half is being
    # reorganized, so no module names are assumed: every module under job/ is imported, and the ones
    # job/__main__.py imports must succeed.
    def ours():
        import ast
        import pkgutil

        before = set(sys.modules)
        importlib.import_module("airflow_provider_rayllm.contract.spec")
        job = importlib.import_module("airflow_provider_rayllm.job")
        main_src = os.path.join(os.path.dirname(job.__file__), "__main__.py")
        needed = sorted(
            {
                n.module
                for n in ast.walk(ast.parse(open(main_src).read()))
                if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("airflow_provider_rayllm")
            }
        )
        failed = {}
        for m in needed:
            importlib.import_module(m)  # raises: the driver cannot start
        for info in pkgutil.walk_packages(job.__path__, "airflow_provider_rayllm.job."):
            if info.name.endswith("__main__"):
                continue
            try:
                importlib.import_module(info.name)
            except Exception as exc:
                failed[info.name] = f"{type(exc).__name__}: {exc}"[:200]
        pkg = sys.modules["airflow_provider_rayllm"]
        airflow = sorted(m for m in set(sys.modules) - before if m == "airflow" or m.startswith("airflow."))
        if airflow:
            raise RuntimeError(f"the job half imported Airflow: {airflow[:5]}")
        return {"from": os.path.dirname(pkg.__file__), "entry_modules": needed, "other_modules_failing": failed}

    res["our_job_imports"] = check("ours", ours)
    res["ok"] = all(res[k]["ok"] for k in ("import_vllm", "ray_data_llm", "ray_dashboard_deps", "our_job_imports"))
    try:
        res["pip_freeze_image"] = subprocess.run(
            [sys.executable, "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": ""},
        ).stdout.split()
    except Exception as exc:
        res["pip_freeze_error"] = repr(exc)

    common.merge_phase("envcheck", res)
    short = {
        k: (v if not isinstance(v, dict) or "ok" not in v else ("ok" if v["ok"] else v.get("error")))
        for k, v in res.items()
        if k not in ("modules", "pip_freeze_image", "meminfo")
    }
    for k, v in short.items():
        print(f"  {k}: {v}")
    for k, v in mods.items():
        print(f"  module {k}: {v}")
    return 0 if res["ok"] else 4


if __name__ == "__main__":
    sys.exit(main())
