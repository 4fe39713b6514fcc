"""Where a job driver's memory is: a diagnostic for the scale benchmark, never part of the product.

Put this folder (as an absolute path: the driver runs in a working directory of its own) first on
PYTHONPATH of the process that starts the local Ray cluster; every Python process of the cluster inherits it
and imports this module at start-up, and in the job's driver (``python -m airflow_provider_rayllm.job
spec.json``) alone it starts a thread that writes one JSON line every ``RAYLLM_DRIVER_HEAP_EVERY_S`` seconds
(15) to ``$RAYLLM_DRIVER_HEAP_DIR/driver-heap-<pid>.jsonl`` (``/tmp``): seconds since start, the RSS and its
anonymous part (/proc), what Python's allocator holds (``tracemalloc``, started here with one frame), the
number of objects the garbage collector tracks, and what Arrow's memory pool holds. A driver whose anonymous
memory grows while the other three stay flat holds it in native code that none of them sees (Ray's C++ core
worker, gRPC).

    PYTHONPATH=$PWD/benchmarks/driver_heap python benchmarks/scale_bench.py --sizes 1000000 --out /tmp/scale-heap.json
"""

from __future__ import annotations

import sys

if "airflow_provider_rayllm.job" in getattr(sys, "orig_argv", []) and "spec.json" in sys.orig_argv:
    import gc
    import json
    import os
    import threading
    import time
    import tracemalloc

    tracemalloc.start(1)

    def _watch() -> None:
        every = float(os.environ.get("RAYLLM_DRIVER_HEAP_EVERY_S", "15"))
        folder = os.environ.get("RAYLLM_DRIVER_HEAP_DIR", "/tmp")
        began = time.time()
        with open(os.path.join(folder, f"driver-heap-{os.getpid()}.jsonl"), "w", encoding="utf-8") as out:
            while True:
                time.sleep(every)
                line: dict[str, float] = {"t": round(time.time() - began, 1)}
                with open("/proc/self/status", encoding="ascii") as status:
                    for row in status:
                        name, _, value = row.partition(":")
                        if name in ("VmRSS", "RssAnon"):
                            line[f"{name}_mb"] = round(int(value.split()[0]) / 1024, 1)
                line["python_mb"] = round(tracemalloc.get_traced_memory()[0] / 2**20, 1)
                line["gc_objects"] = len(gc.get_objects())
                if "pyarrow" in sys.modules:
                    pool = sys.modules["pyarrow"].default_memory_pool()
                    line["arrow_mb"] = round(pool.bytes_allocated() / 2**20, 1)
                out.write(json.dumps(line) + "\n")
                out.flush()

    threading.Thread(target=_watch, name="driver-heap", daemon=True).start()
