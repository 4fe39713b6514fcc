#!/bin/bash
# Builds .gpu/ for the lent H200 with no unpacking or recompression here: the wheels as downloaded, the model
# folders as files, in one plain tar cut into pieces (each call under the device tool's 64 MiB). The device
# unzips the wheels into /tmp/site itself (go.sh, 16 cores), so this machine only downloads and copies.
# build_site.sh makes a smaller, trimmed carry (fewer calls) at the cost of unzipping and gzipping ~1 GB here.
#
#   bash benchmarks/gpu/bundle.sh            (from anywhere; writes <repo>/.gpu, git-ignored)
#
# Output: .gpu/c01..cNN/bundle.tar.partNN (c01 also model/: the 8B-shaped config + SmolLM2's tokenizer files),
# .gpu/scripts/{NPARTS,BUNDLE_PARTS,SHA256SUMS,WHOLE_SHA256SUMS,STAMP,calls.txt,pytest/}. The tar holds
# wheels/*.whl, minilm/ (fp16), smollm2/ (SmolLM2-135M-Instruct, bf16, real weights) and lora/ (its adapter).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
GPU=$REPO/.gpu; CACHE=$GPU/.cache; WHL=$CACHE/wheels
# The project's interpreter (VPY=... for a worktree without its own .venv).
if [ -z "${VPY:-}" ]; then [ -x "$REPO/.venv/bin/python" ] && VPY=$REPO/.venv/bin/python || VPY=python3; fi
LIMIT_BYTES=${GPU_CHUNK_BYTES:-$((56 * 1024 * 1024))}
NICE="nice -n 19 ionice -c3"; command -v ionice >/dev/null || NICE="nice -n 19"
cd "$REPO"
EXCLUDE=$(git rev-parse --git-path info/exclude); touch "$EXCLUDE"
grep -qxF '/.gpu/' "$EXCLUDE" || echo '/.gpu/' >> "$EXCLUDE"

# The same wheels as build_site.sh (its lists, read from it, so the two never drift apart).
eval "$(sed -n '/^VLLM=/p; /^RAY=/p' "$HERE/build_site.sh")"
SMALL=$(sed -n '/^SMALL="/,/"$/p' "$HERE/build_site.sh" | sed 's/^SMALL="//; s/"$//; s/\\//g' | tr '\n' ' ')
OURS=$(sed -n '/^OURS="/,/"$/p' "$HERE/build_site.sh" | sed 's/^OURS="//; s/"$//; s/\\//g' | tr '\n' ' ')
mkdir -p "$WHL"
P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any -d $WHL"
# shellcheck disable=SC2086
[ -n "${SKIP_DOWNLOAD:-}" ] || python3 -m pip download -q $P "$VLLM" "$RAY" $SMALL $OURS 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }
dups=$(ls "$WHL" | sed -E 's/-[0-9][^-]*-.*//' | tr 'A-Z_.' 'a-z--' | sort | uniq -d)
[ -z "$dups" ] || { echo "two versions of: $dups (clear $WHL)"; exit 1; }

SMOL=$("$VPY" -c "from airflow_provider_rayllm.local.models import smollm2_path; print(smollm2_path())")
MINILM=$("$VPY" -c "from airflow_provider_rayllm.local.models import minilm_path; print(minilm_path())")
LORA=$("$VPY" -c "from airflow_provider_rayllm.local.models import lora_adapters_dir; print(lora_adapters_dir())" 2>/dev/null | tail -1)
rm -rf "$GPU"/c[0-9][0-9] "$GPU/scripts" "$GPU/model" "$CACHE/bundle" && mkdir -p "$GPU/scripts" "$GPU/model" "$CACHE/bundle"
B=$CACHE/bundle
# Links, not copies: tar follows them (h), so nothing but MiniLM's half-precision file is written here.
mkdir -p "$B/minilm"
ln -s "$WHL" "$B/wheels"; ln -s "$SMOL" "$B/smollm2"; ln -s "$LORA" "$B/lora"
cp -r "$MINILM"/. "$B/minilm/"; rm -f "$B/minilm/.gitattributes"
# MiniLM in half precision, as build_site.sh carries it (the GPU engine runs it in half precision anyway).
"$VPY" - "$B/minilm/model.safetensors" <<'PYEOF'
import sys
import torch
from safetensors.torch import load_file, save_file
path = sys.argv[1]
tensors = {k: (v.to(torch.float16) if v.is_floating_point() else v) for k, v in load_file(path).items()}
save_file(tensors, path, metadata={"format": "pt"})
PYEOF
cp "$HERE/model_config.json" "$GPU/model/config.json"
for f in tokenizer.json tokenizer_config.json chat_template.jinja; do cp "$SMOL/$f" "$GPU/model/"; done

# One plain tar (no compression: the wheels are zips already, bf16 weights barely shrink), cut into pieces.
# (Streamed straight into the pieces: the tar itself is never written; a first pass only counts its bytes.)
SIZE=$(cd "$B" && tar chf - wheels minilm smollm2 lora | wc -c); MODEL=$(du -sb "$GPU/model" | cut -f1)
N=$(( (SIZE + MODEL + LIMIT_BYTES - 1) / LIMIT_BYTES ))
PIECE=$(( (SIZE + N - 1) / N ))
cd "$GPU"
(cd "$B" && $NICE tar chf - wheels minilm smollm2 lora) | $NICE split -d -a 2 -b "$PIECE" - "$CACHE/bundle.tar.part"
i=0
for f in "$CACHE"/bundle.tar.part*; do
  i=$((i + 1)); d=$(printf 'c%02d' "$i"); mkdir -p "$d"; mv "$f" "$d/"
done
cp -r model c01/model
echo "$i" > scripts/NPARTS; echo "$i" > scripts/BUNDLE_PARTS
sha256sum c[0-9][0-9]/*.part* c01/model/* > scripts/SHA256SUMS
echo "$(cat c[0-9][0-9]/bundle.tar.part* | sha256sum | cut -c1-64)  bundle.tar" > scripts/WHOLE_SHA256SUMS
rm -rf "$B"
date +%s | sha256sum | cut -c1-16 > scripts/STAMP
mkdir -p scripts/pytest
"$VPY" -m pip download -q --only-binary=:all: --python-version 3.12 --no-deps -d scripts/pytest \
  pytest pluggy iniconfig packaging pygments 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }
TREE=$(cd "$REPO" && { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 -r stat -c %s -- 2>/dev/null | awk '{s+=$1} END {print s+0}')
SCRIPTS=$(du -sb scripts | cut -f1)
for d in c[0-9][0-9]; do
  printf "%s  %.2f MiB with scripts and the tree\n" "$d" "$(awk -v t=$(( $(du -sb "$d" | cut -f1) + SCRIPTS + TREE )) 'BEGIN {print t / 1048576}')"
done | tee scripts/calls.txt
echo "== NPARTS=$i, bundle.tar $SIZE bytes in pieces of $PIECE"
