#!/bin/bash
# Run on the lent GPU machine in EVERY call, from the repository root:
#     [PHASES="..."] [BUDGET_S=550] [GPU_DIR=<the carried .gpu folder>] bash benchmarks/gpu/go.sh
# It copies the carried pieces ($GPU_DIR/cNN, default .gpu/cNN) to /tmp/gpu/chunks, assembles /tmp/site once all site pieces are
# there and /tmp/gpu/minilm once all MiniLM pieces are there, then runs the phases of $PHASES that are not done
# yet and whose inputs have arrived, within BUDGET_S seconds (state in /tmp/gpu/state, so the next call on the
# same warm machine continues). Between phases it kills processes left on the GPU and prints GPU memory used.
# At the end $OUT gets: results.json (all phases so far), go.log (this call), gpu.csv, logs/<job phase>.log,
# gputests.xml and logs/gputests_jobs.log (the gpu tests' Ray job logs) when the gputests phase ran.
#
# Phases (default order):
#   envcheck        versions, where each module comes from, the imports our driver and the Ray head need
#   offline         vLLM LLM.chat, N prompts x ~200 tokens in, 256 out, ignore_eos, greedy, dummy 8B weights,
#                   max_num_seqs/max_num_batched_tokens given explicitly (MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS)
#   head            `ray start --head` (free ports, dashboard on 127.0.0.1, usage stats off, RAY_AUTH)
#   ourjob_gen      our driver through the Jobs API, same rows, the project's GPU defaults
#   ourjob_embed    our driver, MiniLM, task_type embed, the project's GPU defaults (+ a check against
#                   sentence-transformers)
#   offline_embed   vLLM LLM.embed with MiniLM, EMBED_N rows
#   gputests        every gpu-marked test (tests/gpu, and tests/integration's, which skip here with their reason):
#                   the guide sections on the real SmolLM2, its LoRA adapter and MiniLM, the GPU profile's job;
#                   pytest carried in .gpu/scripts/pytest when the image lacks it
#   ourjob_gen_matched  our driver with max_num_seqs/max_num_batched_tokens as offline, batch 128 x 16
#   prefix          prefix grouping: our driver twice on PREFIX_DOCS documents (~1,000 tokens) x PREFIX_QUESTIONS
#                   questions listed question-major (benchmarks/prefix_bench.py's rows), prefix caching on, a KV cache
#                   of PREFIX_KV_BYTES (smaller than the documents), PREFIX_MAX_TOKENS out; grouped (the default
#                   prefix_window_rows) then prefix_window_rows=0 (PREFIX_ORDER), same engine settings; the ratios in
#                   results.json's phase `prefix`. PREFIX_MODEL=model (8B-shaped, dummy weights) or smollm2 (real)
#   cache_carry     ourjob_gen twice with compile_cache on a folder, the node's caches emptied before each job
#   ourjob_gen_spawn ourjob_gen with RAYLLM_FORK_ENGINE_CORE=0 (vLLM's spawn: a same-machine baseline for the fork)
#   ourjob_gen_fork  ourjob_gen with runtime_env env_vars RAYLLM_FORK_ENGINE_CORE=1 (the engine core forked from
#                   the Ray actor instead of spawned; results.json notes the engine core processes seen and vLLM's lines)
# Optional: offline_generate (LLM.generate, no chat template), ourjob_embed_nochunk (chunked prefill and
#   prefix caching off for MiniLM), stop_head. FORCE="phase ..." runs done phases again.
# A phase that failed twice is not tried again (unless named in FORCE); envcheck counts as done once run.
#
# Rounds (ROUNDS=3): the end-to-end comparison measured several times, cold on both sides every time. The phases
#   offline, ourjob_gen, offline_embed and ourjob_embed named in PHASES become offline_r1 ourjob_gen_r1 offline_r2
#   ourjob_gen_r2 ... (each pair's rounds interleaved, in PHASES' order; the generation pair's rounds before the
#   embeddings pair's when PHASES names it first), each recorded under its own name in results.json (its round in
#   `round`, its phase in `round_of`), its log in logs/<name>.log. Before every round phase the node's vLLM,
#   Inductor and Triton caches are emptied (`caches_emptied_before` says what was there). A later call with the
#   same PHASES and ROUNDS continues with the rounds not done yet; rounds run in order: once one does not fit the
#   budget left, the call stops there (no later round or phase starts out of turn). report.py pairs offline_rN
#   with ourjob_gen_rN (the same round) and gives the median, the spread and every round's figures.
# Phase pyc: byte-compiles /tmp/site once (python -m compileall), so no run pays for writing vLLM's and Ray's
#   .pyc files (the wheels ship none; a pip-installed environment has them): without it the first process to
#   import vLLM on the machine pays for all of them, the rounds after it not.
# Knobs for a tight budget: NEED_<phase>=<s> replaces need_s's estimate for that phase (a round phase takes its
#   phase's: NEED_ourjob_gen=220), JOB_MARGIN_S (below).
START=$(date +%s); BUDGET_S=${BUDGET_S:-550}; DEADLINE=$((START + BUDGET_S))
PHASES=${PHASES:-envcheck offline head ourjob_gen ourjob_embed offline_embed gputests ourjob_gen_matched}
[ "$PHASES" = none ] && PHASES=""   # only collect and unpack the pieces
REPO=$PWD; HERE=$REPO/benchmarks/gpu; GPU_DIR=${GPU_DIR:-$REPO/.gpu}
ROUNDS=${ROUNDS:-}
if [ -n "$ROUNDS" ] && [ -n "$PHASES" ]; then  # offline ourjob_gen -> offline_r1 ourjob_gen_r1 offline_r2 ...
  PHASES=$(python3 "$HERE/common.py" expand-rounds "$ROUNDS" $PHASES) || { echo "== ROUNDS=$ROUNDS: not a number"; exit 2; }
fi
export GPUW=${GPUW:-/tmp/gpu}; W=$GPUW; export SITE=/tmp/site
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$W/chunks" "$W/state" "$W/logs" "$W/bin"
exec > >(tee -a "$W/go.log" "$OUT/go.log") 2>&1
left() { echo $(( DEADLINE - $(date +%s) )); }
echo "== go.sh start $(date -u +%FT%TZ) host=$(hostname) budget=${BUDGET_S}s${ROUNDS:+ rounds=$ROUNDS} phases: $PHASES"

finish() {
  # Everything we want back, at most 8 files: results.json, go.log, gpu.csv, gputests.xml, up to 4 job logs.
  cp -f "$W/results.json" "$OUT/" 2>/dev/null
  [ -f "$W/gpu.csv" ] && tail -c 8000000 "$W/gpu.csv" > "$OUT/gpu.csv"
  mkdir -p "$OUT/logs"
  ls -t "$W"/logs/ourjob*.log "$W"/logs/prefix_*.log 2>/dev/null | grep -v '\.full\.log$' | head -3 | while read -r f; do
    tail -c 4000000 "$f" > "$OUT/logs/$(basename "$f")"; done
  # The gpu tests' Ray job logs of this call (driver + engine lines Ray forwards), head and tail of each: a
  # failed test's pytest message holds only the last 4,000 characters.
  find /tmp/ray/session_latest/logs/ -maxdepth 1 -name 'job-driver-gpu-test-*.log' -newermt "@$START" 2>/dev/null | sort |
    while read -r f; do echo "===== $(basename "$f") ($(stat -c %s "$f") bytes)";
      if [ "$(stat -c %s "$f")" -le 1800000 ]; then cat "$f"; else head -c 300000 "$f"; echo; echo "----- tail";
        tail -c 1500000 "$f"; fi; done > "$OUT/logs/gputests_jobs.log"
  [ -s "$OUT/logs/gputests_jobs.log" ] || rm -f "$OUT/logs/gputests_jobs.log"
  rmdir "$OUT/logs" 2>/dev/null
  echo "== go.sh end $(date -u +%FT%TZ): done: $(ls "$W/state" | grep '^done_' | sed 's/done_//' | tr '\n' ' ')"
  echo "== $(left) s of the budget left; GPU memory used: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"
  sleep 1
}
trap finish EXIT

# --- 0. SEED=<a results folder, e.g. benchmarks/results/<date>-gpu>: a fresh machine continues that run ---------
# Its results.json and gpu.csv become this machine's starting state, and its gputests answers the answers file,
# so what comes back holds the earlier holds' phases too (a phase run again here replaces its entry).
if [ -n "${SEED:-}" ] && [ ! -e "$W/results.json" ] && [ -f "$REPO/$SEED/results.json" ]; then
  cp "$REPO/$SEED/results.json" "$W/results.json"
  [ -f "$REPO/$SEED/gpu.csv" ] && cp "$REPO/$SEED/gpu.csv" "$W/gpu.csv"
  python3 -c "import json, sys; g = json.load(open(sys.argv[1]))['phases'].get('gputests') or {}
json.dump(g.get('guide_answers') or {}, open(sys.argv[2], 'w'), indent=1)" "$W/results.json" "$W/guide_answers.json"
  echo "== seeded from $SEED: phases $(python3 -c "import json; print(' '.join(json.load(open('$W/results.json'))['phases']))")"
fi

# --- 1. the carried pieces ------------------------------------------------------------------------------------
if [ -f "$GPU_DIR/scripts/STAMP" ]; then
  if [ -f "$W/STAMP" ] && ! cmp -s "$GPU_DIR/scripts/STAMP" "$W/STAMP"; then
    echo "== a new build (.gpu/scripts/STAMP changed): dropping the old pieces and unpacked folders"
    rm -rf "$W/chunks"/* "$W"/state/extracted_* /tmp/site "$W/minilm" "$W/smollm2" "$W/lora" "$W/model"
  fi
  cp -f "$GPU_DIR"/scripts/{STAMP,NPARTS,SITE_PARTS,MINILM_PARTS,SMOL_PARTS,BUNDLE_PARTS,SHA256SUMS,WHOLE_SHA256SUMS} "$W/" 2>/dev/null
fi
[ -f "$W/SITE_PARTS" ] || [ -f "$W/BUNDLE_PARTS" ] || { echo "== no .gpu/scripts carried yet (carry .gpu/scripts with every call)"; exit 1; }
for d in "$GPU_DIR"/c[0-9][0-9]; do
  [ -d "$d" ] || continue
  for f in "$d"/*.part*; do
    [ -f "$f" ] || continue
    want=$(awk -v n="$(basename "$d")/$(basename "$f")" '$2 == n {print $1}' "$W/SHA256SUMS")
    got=$(sha256sum "$f" | cut -c1-64)
    if [ "$got" = "$want" ]; then cp -f "$f" "$W/chunks/"; echo "== piece $d/$(basename "$f") ok ($(stat -c %s "$f") bytes)";
    else echo "== piece $d/$(basename "$f") BAD checksum ($got, want $want): send that call again"; fi
  done
  if [ -d "$d/model" ]; then rm -rf "$W/model" && cp -r "$d/model" "$W/model" && echo "== model folder from $d"; fi
done
# bundle.sh's carry: one plain tar of the wheels and model folders; the wheels are unzipped here.
if [ -f "$GPU_DIR/scripts/BUNDLE_PARTS" ] || [ -f "$W/BUNDLE_PARTS" ]; then
  cp -f "$GPU_DIR/scripts/BUNDLE_PARTS" "$W/" 2>/dev/null
  NB=$(cat "$W/BUNDLE_PARTS"); HB=$(ls "$W"/chunks/bundle.tar.part* 2>/dev/null | wc -l)
  echo "== bundle pieces here: $HB/$NB; $(df -h /tmp | tail -1 | awk '{print $4}') free in /tmp"
  if [ ! -e "$W/state/extracted_site" ] && [ "$HB" -ge "$NB" ]; then
    t=$(date +%s)
    want=$(awk '$2 == "bundle.tar" {print $1}' "$W/WHOLE_SHA256SUMS")
    got=$(cat "$W"/chunks/bundle.tar.part* | sha256sum | cut -c1-64)
    if [ "$got" != "$want" ]; then echo "== bundle.tar does not reassemble ($got != $want)"; exit 1; fi
    rm -rf "$W/bundle" /tmp/site && mkdir -p "$W/bundle" /tmp/site
    cat "$W"/chunks/bundle.tar.part* | tar xf - -C "$W/bundle" && rm -f "$W"/chunks/bundle.tar.part*
    # Unzip every wheel into one site folder, keeping each file's mode (Ray's gcs_server and raylet must stay
    # executable; the image may have no `unzip`).
    python3 - "$W/bundle/wheels" /tmp/site <<'PYEOF'
import os, sys, zipfile
from concurrent.futures import ProcessPoolExecutor
def unpack(path, dest=sys.argv[2]):
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            # Wheels share folders (opentelemetry/ of five wheels): zipfile's own makedirs races between the
            # workers ("FileExistsError: /tmp/site/opentelemetry" on 2026-12-04, one wheel left half unpacked).
            os.makedirs(os.path.join(dest, os.path.dirname(info.filename)), exist_ok=True)
            out = z.extract(info, dest)
            mode = (info.external_attr >> 16) & 0o777
            if mode and not info.is_dir():
                os.chmod(out, mode)
    return os.path.basename(path)
wheels = sorted(os.path.join(sys.argv[1], w) for w in os.listdir(sys.argv[1]) if w.endswith(".whl"))
with ProcessPoolExecutor(16) as pool:
    done = list(pool.map(unpack, wheels))
print(f"== {len(done)} wheels unpacked")
PYEOF
    [ $? -eq 0 ] || { echo "== unpacking the wheels FAILED: send the calls again from call 1"; rm -rf /tmp/site; exit 1; }
    rm -rf /tmp/site/*.data
    for m in minilm smollm2 lora; do rm -rf "${W:?}/$m"; mv "$W/bundle/$m" "$W/$m"; done
    rm -rf "$W/bundle"
    touch "$W/state/extracted_site" "$W/state/extracted_minilm" "$W/state/extracted_smol"
    echo "== bundle unpacked in $(( $(date +%s) - t )) s: $(du -sh /tmp/site | cut -f1) site, $(du -sh "$W/smollm2" | cut -f1) SmolLM2"
  fi
fi
NSITE=$(cat "$W/SITE_PARTS" 2>/dev/null || echo 0); NMINI=$(cat "$W/MINILM_PARTS" 2>/dev/null || echo 0)
NSMOL=$(cat "$W/SMOL_PARTS" 2>/dev/null || echo 0)
HAVE_SITE=$(ls "$W"/chunks/site.tgz.part* 2>/dev/null | wc -l); HAVE_MINI=$(ls "$W"/chunks/minilm.tgz.part* 2>/dev/null | wc -l)
HAVE_SMOL=$(ls "$W"/chunks/smol.tgz.part* 2>/dev/null | wc -l)
echo "== pieces here: site $HAVE_SITE/$NSITE, minilm $HAVE_MINI/$NMINI, smol $HAVE_SMOL/$NSMOL; model folder: $([ -d "$W/model" ] && echo yes || echo no); $(df -h /tmp | tail -1 | awk '{print $4}') free in /tmp"

assemble() {  # name target_dir
  local name=$1 t
  t=$(date +%s)
  want=$(awk -v n="$name.tgz" '$2 == n {print $1}' "$W/WHOLE_SHA256SUMS")
  got=$(cat "$W"/chunks/"$name".tgz.part* | sha256sum | cut -c1-64)
  [ "$got" = "$want" ] || { echo "== $name.tgz does not reassemble ($got != $want)"; return 1; }
  cat "$W"/chunks/"$name".tgz.part* | tar xzf - -C "$2" || { echo "== EXTRACT $name FAILED"; return 1; }
  touch "$W/state/extracted_$name"
  echo "== $name unpacked in $(( $(date +%s) - t )) s"
}
if [ ! -e "$W/state/extracted_site" ] && [ "$NSITE" -gt 0 ] && [ "$HAVE_SITE" -ge "$NSITE" ]; then
  rm -rf /tmp/site; assemble site /tmp && du -sh /tmp/site
fi
if [ ! -e "$W/state/extracted_minilm" ] && [ "$NMINI" -gt 0 ] && [ "$HAVE_MINI" -ge "$NMINI" ]; then
  rm -rf "$W/minilm"; assemble minilm "$W" && du -sh "$W/minilm"
fi
if [ ! -e "$W/state/extracted_smol" ] && [ "$NSMOL" -gt 0 ] && [ "$HAVE_SMOL" -ge "$NSMOL" ]; then
  rm -rf "$W/smollm2" "$W/lora"; assemble smol "$W" && du -sh "$W/smollm2" "$W/lora"   # real SmolLM2 + LoRA
fi
if [ ! -e "$W/state/extracted_site" ]; then echo "== waiting for more pieces (send the next call)"; exit 0; fi

# vLLM 0.26 evaluates dataclass annotations that name llguidance / xgrammar / lmformatenforcer (LazyLoader
# modules) at import time; those optional packages are not carried, so make the annotations lazy instead.
for f in backend_guidance backend_xgrammar backend_lm_format_enforcer; do
  p=/tmp/site/vllm/v1/structured_output/$f.py
  [ -f "$p" ] && { grep -q "^from __future__ import annotations" "$p" || sed -i '3i from __future__ import annotations' "$p"; }
done

# --- 2. environment -----------------------------------------------------------------------------------------
# The operator's entrypoint says `python`: make sure that is the image's python3 (the one with torch). A wrapper,
# not a symlink: a venv's interpreter reached through a symlink elsewhere loses the venv's site-packages.
PY3=$(python3 -c 'import sys; print(sys.executable)')   # the interpreter itself, not a shim in front of it
rm -f "$W/bin/python"   # never write through an old symlink
printf '#!/bin/sh\nexec %s "$@"\n' "$PY3" > "$W/bin/python"; chmod +x "$W/bin/python"
export PATH=$W/bin:$PATH
export PYTHONPATH=/tmp/site:$REPO PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false \
  VLLM_USE_FLASHINFER_SAMPLER=0 OUT BENCH_MODEL=$W/model
N=${N:-2048}; EMBED_N=${EMBED_N:-8192}; EMBED_IN_TOKENS=${EMBED_IN_TOKENS:-100}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-1024}; MAX_NUM_BATCHED_TOKENS=${MAX_NUM_BATCHED_TOKENS:-16384}
python3 - <<EOF
import json, os, sys, time
sys.path.insert(0, "$HERE")
import common
d = common.load_results()
d.setdefault("calls", []).append({"start": $START, "budget_s": $BUDGET_S, "phases": "$PHASES",
    "host": os.uname().nodename, "git": os.popen("git -C $REPO rev-parse --short HEAD 2>/dev/null").read().strip(),
    "workload": {"N": $N, "EMBED_N": $EMBED_N, "MAX_NUM_SEQS": $MAX_NUM_SEQS, "MAX_NUM_BATCHED_TOKENS": $MAX_NUM_BATCHED_TOKENS}})
common.save_results(d)
EOF

# --- 3. phases ----------------------------------------------------------------------------------------------
base_of() {  # a round phase's own phase (offline_r2 -> offline); any other phase's name as it is
  if [[ $1 =~ ^(offline|ourjob_gen|offline_embed|ourjob_embed)_r([0-9]+)$ ]]; then echo "${BASH_REMATCH[1]}"; else echo "$1"; fi
}
round_of() { [[ $1 =~ ^(offline|ourjob_gen|offline_embed|ourjob_embed)_r([0-9]+)$ ]] && echo "${BASH_REMATCH[2]}"; }
empty_caches() {  # the node's vLLM, Inductor and Triton caches, so the next engine compiles cold; prints what was there
  local d s
  CACHES_EMPTIED=""
  for d in "$HOME/.cache/vllm" "/tmp/torchinductor_$(id -un)" "$HOME/.triton/cache"; do
    if [ -e "$d" ]; then s=$(du -sh "$d" 2>/dev/null | cut -f1); else s=absent; fi
    rm -rf "$d"
    CACHES_EMPTIED="$CACHES_EMPTIED${CACHES_EMPTIED:+, }\"$d\": \"$s\""
  done
  echo "== caches emptied: {$CACHES_EMPTIED}"
}
need_s() {  # rough seconds a phase needs (it is not started with less left); NEED_<phase> replaces it
  local v="NEED_$1"
  [ -n "${!v:-}" ] && { echo "${!v}"; return; }
  case $1 in envcheck) echo 80 ;; offline|offline_generate) echo 200 ;; head|stop_head) echo 45 ;;
    ourjob_gen|ourjob_gen_matched|ourjob_gen_fork|ourjob_gen_spawn) echo 260 ;; offline_embed) echo 110 ;; ourjob_embed*) echo 200 ;;
    gputests) echo 420 ;; prefix) echo 400 ;; cache_carry) echo 330 ;; pyc) echo 90 ;; *) echo 60 ;; esac
}
needs_minilm() { case $1 in *embed*|gputests) return 0 ;; *) return 1 ;; esac; }
needs_smol() { case $1 in gputests) return 0 ;; prefix) [ "${PREFIX_MODEL:-model}" = smollm2 ] ;; *) return 1 ;; esac; }
run_phase() {  # phase timeout_s
  local p=$1 T=$2
  case $(base_of "$p") in
    pyc)  # .pyc for the whole site, once (as pip install writes them)
      timeout -k 20 "$T" python3 -m compileall -q -j 0 /tmp/site >/dev/null; local rc=$?
      echo "== /tmp/site byte-compiled (rc $rc): $(find /tmp/site -name '*.pyc' | wc -l) .pyc files"; return $rc ;;
    envcheck) timeout -k 20 "$T" python3 "$HERE/envcheck.py" ;;
    offline) timeout -s INT -k 30 "$T" python3 "$HERE/bench_offline.py" --phase "$p" --mode chat --n "$N" \
        --max-num-seqs "$MAX_NUM_SEQS" --max-num-batched-tokens "$MAX_NUM_BATCHED_TOKENS" --model "$W/model" ;;
    offline_generate) timeout -s INT -k 30 "$T" python3 "$HERE/bench_offline.py" --phase offline_generate --mode generate \
        --n "$N" --max-num-seqs "$MAX_NUM_SEQS" --max-num-batched-tokens "$MAX_NUM_BATCHED_TOKENS" --model "$W/model" ;;
    offline_embed) timeout -s INT -k 30 "$T" python3 "$HERE/bench_offline.py" --phase "$p" --mode embed \
        --n "$EMBED_N" --in-tokens "$EMBED_IN_TOKENS" --model "$W/minilm" ;;
    head) timeout -k 20 "$T" python3 "$HERE/ray_head.py" start ;;
    stop_head) timeout -k 20 "$T" python3 "$HERE/ray_head.py" stop ;;
    ourjob_gen|ourjob_gen_spawn|ourjob_gen_fork)
      # ourjob_gen runs the product's default (since 2026-12-05 a one-worker engine's core is forked); the
      # other two name the start method, for a same-machine comparison.
      env=()
      case $p in ourjob_gen_spawn) env=(--runtime-env '{"env_vars": {"RAYLLM_FORK_ENGINE_CORE": "0"}}') ;;
        ourjob_gen_fork) env=(--runtime-env '{"env_vars": {"RAYLLM_FORK_ENGINE_CORE": "1"}}') ;; esac
      timeout -k 30 "$T" python3 "$HERE/ourjob.py" --phase $p --task generate --n "$N" --model "$W/model" "${env[@]}" \
        --deadline $(( $(date +%s) + T - ${JOB_MARGIN_S:-60} )) ;;
    ourjob_gen_matched) timeout -k 30 "$T" python3 "$HERE/ourjob.py" --phase ourjob_gen_matched --task generate --n "$N" \
        --model "$W/model" --engine-kwargs "{\"max_num_seqs\": $MAX_NUM_SEQS, \"max_num_batched_tokens\": $MAX_NUM_BATCHED_TOKENS}" \
        --batch-size 128 --max-concurrent-batches 16 --deadline $(( $(date +%s) + T - ${JOB_MARGIN_S:-60} )) ;;
    ourjob_embed) timeout -k 30 "$T" python3 "$HERE/ourjob.py" --phase "$p" --task embed --n "$EMBED_N" \
        --in-tokens "$EMBED_IN_TOKENS" --model "$W/minilm" --deadline $(( $(date +%s) + T - ${JOB_MARGIN_S:-60} )) ;;
    ourjob_embed_nochunk) timeout -k 30 "$T" python3 "$HERE/ourjob.py" --phase ourjob_embed_nochunk --task embed \
        --n "$EMBED_N" --in-tokens "$EMBED_IN_TOKENS" --model "$W/minilm" \
        --engine-kwargs '{"enable_chunked_prefill": false, "enable_prefix_caching": false}' --deadline $(( $(date +%s) + T - ${JOB_MARGIN_S:-60} )) ;;
    prefix)  # the first job may take half the phase (it pays the cold compile), the second the rest
      local pm=${PREFIX_MODEL:-model} end=$(( $(date +%s) + T - ${JOB_MARGIN_S:-60} )) side rc=0 dl first=1
      local ek="{\"enable_prefix_caching\": true, \"kv_cache_memory_bytes\": ${PREFIX_KV_BYTES:-2147483648}, \"max_model_len\": 2048$([ "$pm" = smollm2 ] && echo ', "load_format": "auto"')}"
      for side in ${PREFIX_ORDER:-grouped window0}; do
        dl=$end; [ $first = 1 ] && dl=$(( (end + $(date +%s)) / 2 )); first=0
        timeout -k 30 $(( end + 60 - $(date +%s) )) python3 "$HERE/ourjob.py" --phase "prefix_$side" --task generate --model "$W/$pm" \
          --prefix-docs "${PREFIX_DOCS:-32}" --prefix-questions "${PREFIX_QUESTIONS:-64}" \
          --max-tokens "${PREFIX_MAX_TOKENS:-8}" --engine-kwargs "$ek" --deadline "$dl" \
          $([ "$side" = window0 ] && echo --prefix-window 0) || rc=$?
        python3 "$HERE/common.py" gpu-clean "prefix_$side"
      done
      python3 "$HERE/common.py" prefix-summary
      return $rc ;;
    cache_carry)  # our job twice with compile_cache on a folder, the node's own caches emptied before each job:
      # the second job's engine finds only what the first left in that folder (a fresh node given the cache)
      local dir=$W/carried-vllm-cache end=$(( $(date +%s) + T - ${JOB_MARGIN_S:-60} )) side rc=0 first=1 dl
      rm -rf "$dir"
      for side in cold warm; do
        empty_caches
        dl=$end; [ $first = 1 ] && dl=$(( $(date +%s) + 200 < end ? $(date +%s) + 200 : end )); first=0
        timeout -k 30 $(( end + 60 - $(date +%s) )) python3 "$HERE/ourjob.py" --phase "ourjob_gen_cache_$side" --task generate \
          --n "$N" --model "$W/model" --compile-cache "$dir" --deadline "$dl" || rc=$?
        python3 "$HERE/common.py" gpu-clean "ourjob_gen_cache_$side"
        echo "== cache folder after $side: $(du -sh "$dir" 2>/dev/null | cut -f1), $(find "$dir" -type f 2>/dev/null | wc -l) files"
      done
      return $rc ;;
    gputests)  # the project's gpu-marked tests that need no Airflow (tests/gpu), on the same Ray head
      if ! python3 -c "import pytest" 2>/dev/null; then  # the image has none: the wheels carried in scripts/
        mkdir -p "$W/pytest"
        for w in "$GPU_DIR"/scripts/pytest/*.whl; do python3 -m zipfile -e "$w" "$W/pytest"; done
      fi
      python3 "$HERE/ray_head.py" start >/dev/null || return 3
      DASH=$(python3 -c "import json; print(json.load(open('$W/ray_head.json'))['dashboard'])")
      AUTH=$(python3 -c "import json; print(json.load(open('$W/ray_head.json')).get('auth_mode', 'disabled'))")
      # The guide sections' answers (a few rows each) land in $W/guide_answers.json, merged into results.json.
      PYTHONPATH=$W/pytest:$PYTHONPATH RAY_AUTH_MODE=$AUTH RAYLLM_GPU_DASHBOARD=$DASH RAYLLM_GPU_MODEL=$W/model \
        RAYLLM_GPU_CHAT_MODEL=$W/smollm2 RAYLLM_GPU_LORA_DIR=$W/lora RAYLLM_GPU_EMBED_MODEL=$W/minilm \
        RAYLLM_GPU_ANSWERS=$W/guide_answers.json \
        timeout -k 20 "$T" python3 -m pytest ${GPUTESTS_PATH:-tests/gpu tests/integration/test_guide_sections.py} \
        -m gpu -p no:cacheprovider -rA -v --durations=0 --junitxml="$OUT/gputests.xml"
      rc=$?
      python3 "$HERE/common.py" merge-file gputests guide_answers "$W/guide_answers.json"
      return $rc ;;
    *) echo "unknown phase $p"; return 2 ;;
  esac
}
for phase in $PHASES; do
  forced=0; [[ " ${FORCE:-} " == *" $phase "* ]] && forced=1
  if [ -e "$W/state/done_$phase" ] && [ $forced = 0 ]; then continue; fi
  tries=$(cat "$W/state/tries_$phase" 2>/dev/null || echo 0)
  if [ "$tries" -ge 2 ] && [ $forced = 0 ]; then echo "== $phase failed twice: not tried again (FORCE=$phase to retry)"; continue; fi
  if needs_minilm "$phase" && [ ! -e "$W/state/extracted_minilm" ]; then echo "== $phase waits for the MiniLM pieces"; continue; fi
  if needs_smol "$phase" && [ ! -e "$W/state/extracted_smol" ]; then echo "== $phase waits for the SmolLM2 pieces"; continue; fi
  L=$(left); NEED=$(need_s "$(base_of "$phase")")
  if [ "$L" -lt "$NEED" ]; then
    echo "== $phase needs ~$NEED s, $L s left: next call"
    if [ -n "$(round_of "$phase")" ]; then echo "== rounds run in order: no later phase starts in this call"; break; fi
    continue
  fi
  echo "== phase $phase ($L s left) $(date -u +%T)"
  echo $((tries + 1)) > "$W/state/tries_$phase"
  if [ -n "$(round_of "$phase")" ]; then  # every round cold on both sides: the node's compile caches emptied
    empty_caches
    python3 "$HERE/common.py" merge-obj "$phase" "{\"round\": $(round_of "$phase"), \"round_of\": \"$(base_of "$phase")\", \"caches_emptied_before\": {$CACHES_EMPTIED}}"
  fi
  t=$(date +%s)
  # The phase's whole process, to the nanosecond (the offline script's window for the end-to-end comparison).
  PHASE_T0=$(date +%s.%N); export PHASE_T0
  set -o pipefail
  run_phase "$phase" $((L - 15)) 2>&1 | tee "$W/logs/$phase.out"
  rc=$?
  set +o pipefail
  python3 "$HERE/common.py" phase-process "$phase" "$PHASE_T0" "$(date +%s.%N)"
  dt=$(( $(date +%s) - t ))
  if [ $rc -eq 0 ]; then st=ok; else st="failed rc=$rc"; fi
  if [ $rc -eq 0 ] || [ "$phase" = envcheck ]; then touch "$W/state/done_$phase"; fi
  echo "== phase $phase: $st in $dt s"
  python3 "$HERE/common.py" phase-status "$phase" "$st" "$dt"
  case $phase in offline*) python3 "$HERE/common.py" vllm-log "$phase" "$W/logs/$phase.out" ;; esac
  # Nothing may stay on the GPU between phases (the Ray head itself holds none).
  python3 "$HERE/common.py" gpu-clean "$phase"
done
