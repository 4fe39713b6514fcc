"""Where a test run's CPU goes, by kind of process: what the CI-time work measures before it cuts.

    python scripts/ci_cpu.py record build/ci-cpu.json &     # samples every process until stopped (SIGTERM)
    make test ...; kill %1
    python scripts/ci_cpu.py summary build/ci-cpu.json [--out benchmarks/results/<date>-ci-cpu.json]

`record` reads each process's CPU time (user + system) from /proc five times a second and keeps the last
reading of each (a process that ends between two readings loses at most 0.2 s), with its command lines
(a Ray worker's title changes from ``ray::IDLE`` to the actor or task it runs). Processes that were running
when recording started count only what they spent after. `summary` groups the processes by kind (a Ray
actor or task by its class, a vLLM engine core, a job driver, Ray's own daemons) and prints a table: CPU
seconds, how many processes, seconds per process. Linux only.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

INTERVAL_S = 0.2


def record(out: Path) -> None:
    hz = os.sysconf("SC_CLK_TCK")
    me = os.getpid()
    seen: dict[tuple[str, str], dict[str, Any]] = {}
    stop = False

    def _stop(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    started = time.time()
    first = True
    while not stop:
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == me:
                continue
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            cpu = (int(fields[11]) + int(fields[12])) / hz
            entry = seen.setdefault(
                (pid, fields[19]),  # pid and start time: a reused pid is another process
                {"pid": int(pid), "titles": [], "cpu0": cpu if first else 0.0, "first_s": time.time() - started},
            )
            cmd = cmd.strip()[:200]
            if cmd and (not entry["titles"] or entry["titles"][-1] != cmd):
                entry["titles"].append(cmd)
            entry["cpu"], entry["last_s"] = cpu, time.time() - started
        first = False
        time.sleep(INTERVAL_S)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"seconds": round(time.time() - started, 1), "processes": list(seen.values())}))


# Ray's own processes and our services, by a piece of their command line.
DAEMONS = (
    ("raylet", "Ray: raylet"),
    ("gcs_server", "Ray: GCS server"),
    ("dashboard/agent", "Ray: dashboard agent"),
    ("DashboardAgent", "Ray: dashboard agent"),
    ("dashboard.py", "Ray: dashboard"),
    ("ray-dashboard-", "Ray: dashboard"),
    ("log_monitor", "Ray: log monitor"),
    ("autoscaler", "Ray: monitor"),
    ("runtime_env", "Ray: runtime env agent"),
    ("RuntimeEnvAgent", "Ray: runtime env agent"),
    ("ray.util.client.server", "Ray: client server"),
    ("ray start", "Ray: ray start"),
    ("default_worker.py", "Ray: worker that never ran a task"),
    ("airflow_provider_rayllm.job", "job driver (python -m airflow_provider_rayllm.job)"),
    ("VLLM::", "vLLM engine core / workers"),
    ("vllm.model_executor.models.registry", "vLLM model inspection subprocess"),
    ("vllm.entrypoints", "vLLM OpenAI server (HTTP tests)"),
    ("moto", "moto S3 server"),
    ("gcs_emulator", "GCS emulator"),
    ("pytest", "pytest"),
    ("bin/airflow", "airflow CLI"),
    ("airflow api_server", "airflow API server"),
    ("chrom", "Chromium"),
    ("pip", "set-up (pip / uv)"),
    ("uv ", "set-up (pip / uv)"),
    ("mypy", "lint (ruff, mypy)"),
    ("ruff", "lint (ruff, mypy)"),
)


def kind(titles: list[str]) -> str:
    """A process's kind, from the last title it had that was not Ray's idle one."""
    busy = [t for t in titles if "ray::IDLE" not in t] or titles or ["(no command line)"]
    title = " ".join(busy[-1].split())
    stage = re.match(r"ray::MapWorker\(MapBatches\((\w+)", title)
    if stage:
        return f"Ray Data actor: {stage.group(1)}"
    actor = re.match(r"ray::([\w.]+)", title)
    if actor:
        return f"Ray: {actor.group(1)}"
    for piece, name in DAEMONS:
        if piece in title:
            return name
    return "other: " + title[:60]


def summary(path: Path, top: int) -> dict[str, Any]:
    data = json.loads(path.read_text())
    groups: dict[str, list[float]] = collections.defaultdict(list)
    for proc in data["processes"]:
        spent = proc.get("cpu", 0.0) - proc.get("cpu0", 0.0)
        if spent >= 0.01:
            groups[kind(proc["titles"])].append(spent)
    total = sum(sum(v) for v in groups.values())
    rows = sorted(
        ({"kind": k, "cpu_s": round(sum(v), 1), "processes": len(v)} for k, v in groups.items()),
        key=lambda r: -r["cpu_s"],
    )
    print(f"{total:.0f} CPU-s over {data['seconds']:.0f} s ({total / data['seconds']:.2f} cores busy on average)\n")
    print("| kind of process | CPU-s | share | processes | CPU-s each |")
    print("|---|---:|---:|---:|---:|")
    for row in rows[:top]:
        share = row["cpu_s"] / total
        each = row["cpu_s"] / row["processes"]
        print(f"| {row['kind']} | {row['cpu_s']:.0f} | {share:.1%} | {row['processes']} | {each:.1f} |")
    return {"seconds": data["seconds"], "cpu_s": round(total, 1), "by_kind": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/ci_cpu.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="sample every process until SIGTERM or Ctrl-C")
    rec.add_argument("out", type=Path)
    summ = sub.add_parser("summary", help="CPU by kind of process, as a markdown table")
    summ.add_argument("path", type=Path)
    summ.add_argument("--top", type=int, default=30)
    summ.add_argument("--out", type=Path, help="also write the summary as JSON")
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args.out)
        return 0
    result = summary(args.path, args.top)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
