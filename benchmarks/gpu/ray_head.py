"""A local Ray head on the device with the Jobs API, as a production cluster would offer it.

    python3 ray_head.py start | status | stop

`start` is idempotent: a head that answers is reused (it was started in its own process session, so it
outlives the call that started it while the machine stays warm). Free ports for the GCS and the dashboard
(127.0.0.1 only), usage statistics off. The head's workers see PYTHONPATH=/tmp/site only, not the working
tree, so our package reaches the job through the runtime_env's py_modules, as the operator ships it.

Authentication: Ray 2.60 enables token auth for `ray start` when a token exists (~/.ray/auth_token) or
RAY_AUTH_MODE=token. RAY_AUTH=disabled (default) starts the head with RAY_AUTH_MODE=disabled, Ray's own
opt-out; RAY_AUTH=token generates a token (`ray get-auth-token --generate`) and runs head and client with
RAY_AUTH_MODE=token, the way a secured cluster runs. The choice is written to ray_head.json so the
client (ourjob.py) uses the same.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

INFO = os.path.join(common.W, "ray_head.json")
SITE = os.environ.get("SITE", "/tmp/site")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_info() -> dict | None:
    try:
        with open(INFO) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def answers(info: dict | None, timeout: float = 3) -> bool:
    if not info:
        return False
    try:
        with urllib.request.urlopen(info["dashboard"] + "/api/version", timeout=timeout) as r:
            return r.status == 200
    except Exception:
        return False


def apply_auth_env(info: dict) -> None:
    """The client side of the head's auth choice (call before importing ray)."""
    os.environ["RAY_AUTH_MODE"] = info.get("auth_mode", "disabled")


def head_env(auth_mode: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = SITE  # not the working tree: our package travels as py_modules
    env["RAY_AUTH_MODE"] = auth_mode
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


def ray_cli(
    args: list[str], env: dict, timeout: float = 120, session: bool = False, log: str | None = None
) -> tuple[int, str, int]:
    """Ray's CLI; output to a file, not a pipe (daemons that `ray start` leaves behind would hold a pipe open).
    Returns (exit code, output, pid: with session=True also the id of the new process session)."""
    os.makedirs(common.LOGS, exist_ok=True)
    log = log or os.path.join(common.LOGS, f"ray_{args[0]}.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ray.scripts.scripts", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=session,
            stdin=subprocess.DEVNULL,
            # Not the repository: the device tool replaces the working tree at every call, and a head whose
            # working directory is gone refuses every job (its job agent's ray.init reads the directory).
            cwd=common.W,
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = -9
    with open(log, errors="replace") as f:
        return rc, f.read(), proc.pid


def session_pids(sid: int) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.getsid(int(d)) == sid:
                    pids.append(int(d))
            except OSError:
                pass
    return pids


def start() -> dict:
    info = read_info()
    if answers(info):
        print(f"== Ray head already up: {info}", flush=True)
        return {**info, "reused": True}
    auth_mode = "token" if os.environ.get("RAY_AUTH", "disabled") == "token" else "disabled"
    env = head_env(auth_mode)
    if auth_mode == "token":
        rc, text, _ = ray_cli(["get-auth-token", "--generate"], env, timeout=60)
        if rc != 0:
            raise SystemExit(f"ray get-auth-token --generate failed: {text[-2000:]}")
    gcs, dash = free_port(), free_port()
    try:
        ngpu = len([line for line in common.nvsmi("-L").splitlines() if line.startswith("GPU ")]) or None
    except OSError:
        ngpu = None
    args = [
        "start",
        "--head",
        f"--port={gcs}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dash}",
        "--include-dashboard=true",
        "--disable-usage-stats",
        f"--object-store-memory={int(os.environ.get('RAY_OBJECT_STORE_BYTES', 8 * 10**9))}",
    ]
    if ngpu:
        args.append(f"--num-gpus={ngpu}")
    if os.environ.get("RAY_NUM_CPUS"):  # logical CPUs (a dry run on a 2-core machine needs more than 2)
        args.append(f"--num-cpus={os.environ['RAY_NUM_CPUS']}")
    if os.environ.get("RAY_TEMP_DIR"):  # a separate temp dir (a dry run on a shared machine)
        args.append(f"--temp-dir={os.environ['RAY_TEMP_DIR']}")
    t0 = time.time()
    # Its own session: the head outlives this call while the machine stays warm (the next call reuses it).
    rc, text, session = ray_cli(args, env, timeout=180, session=True)
    info = {
        "gcs": f"127.0.0.1:{gcs}",
        "dashboard": f"http://127.0.0.1:{dash}",
        "auth_mode": auth_mode,
        "num_gpus": ngpu,
        "args": args,
        "ray_start_rc": rc,
        "session": session,
    }
    if rc != 0:
        print(text[-4000:], flush=True)
        raise SystemExit(f"ray start failed (rc {rc})")
    deadline = time.time() + 90
    while time.time() < deadline and not answers(info):
        time.sleep(1)
    info["up_s"] = round(time.time() - t0, 1)
    info["answers"] = answers(info)
    with open(INFO, "w") as f:
        json.dump(info, f)
    if not info["answers"]:
        print(text[-3000:], flush=True)
        raise SystemExit(f"the dashboard at {info['dashboard']} did not answer within 90 s")
    apply_auth_env(info)
    try:
        import ray

        ray.init(address=info["gcs"], log_to_driver=False)
        info["cluster_resources"] = {k: v for k, v in ray.cluster_resources().items() if "node:" not in k}
        ray.shutdown()
    except Exception as exc:
        info["cluster_resources_error"] = repr(exc)
    with open(INFO, "w") as f:
        json.dump(info, f)
    print(f"== Ray head up in {info['up_s']} s: {info}", flush=True)
    return info


def stop() -> None:
    """Ends the head's process session (only ours, also on a shared machine); RAY_STOP_ALL=1 adds `ray stop
    --force`, which ends every Ray process of the machine."""
    info = read_info() or {}
    sid = info.get("session")
    if sid:
        pids = session_pids(int(sid))
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            time.sleep(3)
            pids = session_pids(int(sid))
            if not pids:
                break
        print(f"== Ray head's session {sid} ended; {len(pids)} process(es) left", flush=True)
    if os.environ.get("RAY_STOP_ALL") == "1":
        rc, text, _ = ray_cli(["stop", "--force"], head_env(info.get("auth_mode", "disabled")), timeout=120)
        print(text[-2000:], flush=True)
    try:
        os.remove(INFO)
    except OSError:
        pass


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "status"
    if cmd == "start":
        info = start()
        common.merge_phase("head", {"ok": True, **info})
        return 0
    if cmd == "stop":
        stop()
        return 0
    info = read_info()
    print(json.dumps({"info": info, "answers": answers(info)}))
    return 0 if answers(info) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
