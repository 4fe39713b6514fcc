"""Ray's log monitor on the embedded head: CPU while idle, with Ray's default folder scan and with it throttled.

Below ``RAY_LOG_MONITOR_MANY_FILES_THRESHOLD`` files (1,000) Ray's log monitor scans its log folder on every
0.1 s loop, six globs over every entry; at or above it, every 0.5 s. The folder keeps a core-worker log for every
worker process a session started, so a long-lived head (the tests' session, a day of demos) scans hundreds of
entries ten times a second.

Each round starts a fresh embedded head, adds ``--files`` such core-worker logs (what a CI session leaves), and
reads the log monitor's CPU time from /proc over ``--seconds`` of idle. The two settings alternate, round by
round. Writes benchmarks/results/<date>-log-monitor.json. Not part of `make bench`: it measures Ray, not the job,
to decide a setting of the embedded stack.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from airflow_provider_rayllm.local.cluster import LocalRayCluster  # noqa: E402
from benchmarks.common import bench_home  # noqa: E402

SETTING = "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"
# label in the results: the value given to Ray, set either way (the embedded head sets 0 unless told otherwise)
SETTINGS = {"ray default (1000)": "1000", "0": "0"}


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_round(label: str, files: int, seconds: float) -> dict:
    os.environ[SETTING] = SETTINGS[label]
    cluster = LocalRayCluster(state_dir=bench_home("log-monitor") / "ray", num_cpus=2)
    try:
        info = cluster.start()
        session = Path(info.temp_dir) / "session_latest" / "logs"
        for i in range(files):
            (session / f"python-core-worker-{i:040x}_{100000 + i}.log").write_text("-\n")
        pid = int(subprocess.check_output(["pgrep", "-f", f"log_monitor.py.*{info.temp_dir}"]).split()[0])
        time.sleep(5)  # past the head's own start-up
        before = _cpu_s(pid)
        time.sleep(seconds)
        return {
            "threshold": label,
            "log_entries": len(os.listdir(session)),
            "cpu_s": round(_cpu_s(pid) - before, 3),
            "seconds": seconds,
        }
    finally:
        cluster.stop()
        os.environ.pop(SETTING, None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds per setting, alternating")
    parser.add_argument("--files", type=int, default=400, help="core-worker logs added to the folder")
    parser.add_argument("--seconds", type=float, default=60.0, help="idle seconds measured per round")
    args = parser.parse_args()
    runs = []
    for n in range(args.rounds):
        for label in SETTINGS:
            runs.append(one_round(label, args.files, args.seconds))
            print(f"round {n + 1}: {runs[-1]}", flush=True)
    median = {label: statistics.median(r["cpu_s"] for r in runs if r["threshold"] == label) for label in SETTINGS}
    default, throttled = median.values()
    result = {
        "date": date.today().isoformat(),
        "description": __doc__,
        "settings": vars(args),
        "runs": runs,
        "median_cpu_s": median,
        "share_of_a_core": {k: round(v / args.seconds, 4) for k, v in median.items()},
        "reduction": round(1 - throttled / default, 3) if default else None,
    }
    out = REPO / "benchmarks" / "results" / f"{date.today().isoformat()}-log-monitor.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}: median CPU-s {median}, reduction {result['reduction']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
