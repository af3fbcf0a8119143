#!/usr/bin/env bash
# The first GPU-trained students (issue 36), in two back-to-back device calls (the second within the
# machine's 30 s warm window: ignored files the first leaves in the repo are still there).
# Prepare here first: bash benchmarks/gpu/prepare.sh train, then through the device tool:
#   call 1: carry [".whl", ".gpu_train/part1"]          command: bash benchmarks/gpu/train.sh 1   timeout_s: 120
#   call 2: carry [".gpu_train/part2", ".gpu_train/shards"]   command: bash benchmarks/gpu/train.sh 2   timeout_s: 600
# Call 1 (~10 s): installs the wheels into .gpu_train_run/site, keeps GGUF part 1 in .gpu_train_run/, records the GPU.
# Call 2 (<= DEADLINE_S, 560 s): joins the GGUF and checks its SHA-256, converts it to an HF teacher,
#   while fla's bf16 gated delta-rule form is checked against the CPU's fp32 form in the background (a
#   failure sends every run to the torch forms); the teacher samples GEN_PROBE tokens on the GPU (its
#   tokens/s recorded; GEN_S seconds more where GEN_S > 0); the training mixture MIX (NAME:WEIGHT; gen
#   = the sampled text, other names carried shard folders); a probe distill of PROBE_STEPS steps per
#   stage measures each stage's tokens/s (a failure with fla retries with torch), from which the
#   budgets are set to fill the seconds left; then for each recipe in RECIPES: attn2ssm distill on
#   1024-token blocks (bf16), then the final KD stage on 4096-token blocks as a second distill
#   continuing that student (student.init_from: the recipe schema has one block length per run); then
#   teacher-vs-student evaluation on the device: held-out perplexity at WINDOWS on the suite's three
#   held-out domains (emails, kjv, pydoc) and sotu / moby-dick's held-out sides, and passkey retrieval
#   at NEEDLE_LENGTHS with 20 trials per length (5 depths x 4). Not the whole --suite: its task pack
#   (52 MiB) and lm-eval's wheels do not fit the two calls' carry beside the teacher (README: "The
#   first GPU run").
# $OUT gets results.json (device, versions, tokens, wall time, tokens/s, MFU, evaluation),
# train.log, and each run's metrics.jsonl (copied every 10 s while it trains). The run directories
# stay in .gpu_train_run/runs/ (resumable: attn2ssm distill --out DIR --resume, while the machine is warm).
# CPU smoke test: DEVICE=cpu TEACHER_DIR=<tiny teacher> ... (README).
set -uo pipefail
CALL=${1:?call 1 or 2}
T0=$(date +%s)
OUT=${OUT:-/tmp/attn2ssm-gpu-train}; mkdir -p "$OUT"
PY=${PY:-python3}
WORK=${WORK:-.gpu_train_run}; mkdir -p "$WORK"
DEVICE=${DEVICE:-cuda}
KERNELS=${KERNELS:-$([ "$DEVICE" = cpu ] && echo torch || echo fla)}  # call 2 falls back to torch if the fla probe fails
PRECISION=${PRECISION:-$([ "$DEVICE" = cpu ] && echo no || echo bf16)}
RECIPES=${RECIPES:-gdn_hybrid25}               # or "gdn_hybrid25 linear_hybrid25" (the time is split; README: why one)
DEADLINE_S=${DEADLINE_S:-560}                   # call 2 ends by then (timeout_s 600)
# sampling: HF generate ran at 2.5-2.9k tokens/s on an H200 (batch 256), so by default only a 2^16-token
# probe (~30 s) is sampled and the mixture gives it a small share (README: "The first GPU run")
# (~50 ms a decode step at batch 256, overhead-bound: batch 1024 should sample ~4x as fast; not yet measured)
GEN_PROBE=${GEN_PROBE:-65536}; GEN_S=${GEN_S:-0}; GEN_BATCH=${GEN_BATCH:-1024}; GEN_LEN=${GEN_LEN:-256}; GEN_MAX=${GEN_MAX:-0}
STEP_TOKENS=${STEP_TOKENS:-32768}; PROBE_STEPS=${PROBE_STEPS:-4}; CHECK_S=${CHECK_S:-150}
EVAL_S=${EVAL_S:-110}; OVERHEAD_S=${OVERHEAD_S:-35}; FINAL_SHARE=${FINAL_SHARE:-0.3}; MAX_TOKENS=${MAX_TOKENS:-0}
# the 4096-token stage's tokens/s as a share of the main run's KD rate (0.18 measured in the third run, with the
# gated delta rule's block loop; its all-blocks-at-once CUDA schedule since should do better)
LONG_FACTOR=${LONG_FACTOR:-0.25}
EVAL_TOKENS=${EVAL_TOKENS:-16384}; NEEDLE_LENGTHS=${NEEDLE_LENGTHS:-1024,2048,4096}; NEEDLE_TRIALS=${NEEDLE_TRIALS:-4}
WINDOWS=${WINDOWS:-1024,2048,4096}
MIX=${MIX:-gen:0.1,sotu:0.45,moby-dick:0.25,recall:0.1,recall-long:0.1}  # NAME:WEIGHT (below)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 ATTN2SSM_CACHE=${ATTN2SSM_CACHE:-$PWD/$WORK/cache}
[ -d "$WORK/site" ] && export PYTHONPATH=$PWD/$WORK/site:$PWD/src || export PYTHONPATH=$PWD/src
LOG=$OUT/train.log
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
left() { echo $(( DEADLINE_S - ($(date +%s) - T0) )); }
gguf_name=SmolLM2-135M-Instruct.Q4_1.gguf

if [ "$CALL" = 1 ]; then
  log "call 1: wheels, GGUF part 1"
  if [ -d .whl ]; then
    timeout 90 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl || { log "pip install failed"; exit 1; }
  fi
  cp .gpu_train/part1/* "$WORK/" && (cd "$WORK" && sha256sum -c parts.sha256) | tee -a "$LOG" || { log "part 1 damaged"; exit 1; }
  mv "$WORK/parts.sha256" "$WORK/part1.sha256"
  PYTHONPATH=$PWD/$WORK/site:$PWD/src $PY -c "import torch, triton, transformers, gguf; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'gguf', __import__('importlib.metadata').metadata.version('gguf'), 'cuda', torch.cuda.is_available())" 2>&1 | tee -a "$LOG"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
  log "call 1 done: run call 2 now (the machine stays warm ~30 s)"
  exit 0
fi

# ------------------------------------------------------------------------------ call 2
copier() { while sleep 10; do for r in "$WORK"/runs/*/; do [ -f "$r/metrics.jsonl" ] && cp "$r/metrics.jsonl" "$OUT/metrics_$(basename "$r").jsonl"; done; done; }
copier & COPIER=$!
CHECK_PID=
if [ "$DEVICE" != cpu ] && [ "$CHECK_S" -gt 0 ]; then
  # beside the teacher's conversion and sampling (the GPU is idle then): fla's gated delta-rule form in
  # bf16 (what training runs) and the mixed-dtype case on this GPU against the CPU's fp32 form; -x prints
  # a failure at once (a check cut off by its timeout keeps what it printed). The first probe waits for
  # it: a failed comparison sends every run to the torch forms (the first GPU run saw bf16 fail here).
  ( ATTN2SSM_KERNEL_TESTS=cuda TRITON_F32_DEFAULT=ieee timeout "$CHECK_S" $PY -m pytest -x -q --tb=short -p no:cacheprovider \
      tests/kernels/test_fla_forms.py -k "(test_gated_delta and dtype2) or mixed" > "$OUT/kernel_check.txt" 2>&1
    echo "exit $?" >> "$OUT/kernel_check.txt" ) &
  CHECK_PID=$!
  # not waited for: the PyTorch forms on CUDA against the CPU (the gated delta rule's all-blocks-at-once
  # schedule, new since the third run, in every student form: logits, cache forms, generation, backward)
  ( ATTN2SSM_KERNELS=torch timeout "$CHECK_S" $PY -m pytest -x -q --tb=short -p no:cacheprovider tests/test_cuda.py -k gated_delta \
      > "$OUT/torch_cuda_check.txt" 2>&1; echo "exit $?" >> "$OUT/torch_cuda_check.txt" ) &
fi
finish() {
  kill "$COPIER" 2>/dev/null
  for r in "$WORK"/runs/*/; do [ -f "$r/metrics.jsonl" ] && cp "$r/metrics.jsonl" "$OUT/metrics_$(basename "$r").jsonl"; done
  timeout 60 $PY benchmarks/gpu/train_plan.py results "$OUT/results.json" --work "$WORK" --teacher "${TEACHER:-}" --kernels "$KERNELS" --precision "$PRECISION" 2>&1 | tee -a "$LOG"
  log "call 2 ended"
}
trap finish EXIT
mark() { echo "{\"step\": \"$1\", \"at_s\": $(( $(date +%s) - T0 ))}" >> "$WORK/timeline.jsonl"; $PY -c "import json,sys; print(json.dumps([json.loads(l) for l in open('$WORK/timeline.jsonl')]))" > "$WORK/timeline.json"; }
rm -f "$WORK/timeline.jsonl"; mark start

if [ -n "${TEACHER_DIR:-}" ]; then  # smoke tests: a given HF teacher, no GGUF
  TEACHER=$TEACHER_DIR
else
  log "joining the GGUF"
  dest=$ATTN2SSM_CACHE/teachers/smollm2-135m; mkdir -p "$dest"
  cp .gpu_train/part2/*.part1 "$WORK/" || { log "part 2 missing"; exit 1; }
  (cd .gpu_train/part2 && sha256sum -c parts.sha256) || { log "part 2 damaged"; exit 1; }
  [ -f "$WORK/$gguf_name.xz.part0" ] || { log "part 1 missing: call 1 did not run on this machine (or it went back): run call 1 again"; exit 1; }
  cat "$WORK/$gguf_name.xz.part0" "$WORK/$gguf_name.xz.part1" | xz -d > "$dest/$gguf_name" || { log "xz failed"; exit 1; }
  gsum=$PWD/.gpu_train/part2/gguf.sha256
  (cd "$dest" && sha256sum -c "$gsum") | tee -a "$LOG" || { log "GGUF SHA-256 differs"; exit 1; }
  log "converting the GGUF to an HF teacher"
  TEACHER=$(timeout 180 $PY -c "from attn2ssm.teachers.text import _builtin_hf_dir; print(_builtin_hf_dir('smollm2-135m'))" | tail -1) || { log "conversion failed"; exit 1; }
fi
export TEACHER
log "teacher: $TEACHER"; mark teacher
[ "${STOP_AFTER:-}" = teacher ] && exit 0  # smoke tests of the join and conversion alone

# ---- the generated corpus: a probe measures the sampling rate, then GEN_S seconds of it
SH=.gpu_train/shards
rm -rf "$WORK/gen-probe" "$WORK/gen"
timeout 120 $PY -m attn2ssm data shards "generated:$GEN_PROBE?batch=$GEN_BATCH&length=$GEN_LEN" --teacher "$TEACHER" --out "$WORK/gen-probe" \
  --device "$DEVICE" --no-progress 2>&1 | tail -n 8 | tee -a "$LOG"
rate=$($PY -c "import json; m=json.load(open('$WORK/gen-probe/manifest.json'))['meta']; print(int(m.get('tokens_per_second') or 0))" 2>/dev/null || echo 0)
n_gen=$(( rate * GEN_S )); [ "$GEN_MAX" -gt 0 ] && [ "$n_gen" -gt "$GEN_MAX" ] && n_gen=$GEN_MAX
log "sampling: $rate tokens/s in the probe; sampling $n_gen tokens"
GEN_DIR=$WORK/gen-probe
if [ "$n_gen" -gt "$GEN_PROBE" ]; then
  timeout $(( GEN_S * 2 + 60 )) $PY -m attn2ssm data shards "generated:$n_gen?batch=$GEN_BATCH&length=$GEN_LEN" --teacher "$TEACHER" --out "$WORK/gen" \
    --device "$DEVICE" --seed 1 --no-progress 2>&1 | tail -n 8 | tee -a "$LOG" && GEN_DIR=$WORK/gen
fi
$PY -c "import json; d={k: json.load(open(f'$WORK/{k}/manifest.json'))['meta'] for k in ('gen-probe','gen') if __import__('os').path.exists(f'$WORK/{k}/manifest.json')}; json.dump(d, open('$WORK/generate.json','w'), indent=1, default=str)"
mark generated
# the training mixture: NAME:WEIGHT, "gen" the sampled corpus, any other name a carried shard folder
SOURCES=$(for item in ${MIX//,/ }; do name=${item%%:*}; dir=$([ "$name" = gen ] && echo "$GEN_DIR" || echo "$SH/$name")
  [ -d "$dir" ] && printf '%s:%s,' "$dir" "${item#*:}" || log "no $dir: $name left out of the mixture" >&2; done); SOURCES=${SOURCES%,}
log "training mixture: $SOURCES"

# ---- per recipe: probe, main run (1024), final KD (4096), evaluation
# held-out text scored at every window: three domains never trained on (the suite's emails, kjv, pydoc,
# carried as held-out-only shards where prepare.sh wrote them), then the training corpora's held-out sides
EVAL_CORPORA=$(for c in emails kjv pydoc sotu moby-dick; do [ -d "$SH/$c" ] && printf 'shards:%s,' "$SH/$c"; done); EVAL_CORPORA=${EVAL_CORPORA%,}
n_recipes=$(echo $RECIPES | wc -w)
mkdir -p "$WORK/runs" "$WORK/eval"
if [ -n "$CHECK_PID" ]; then
  wait "$CHECK_PID"; check=$(tail -n 1 "$OUT/kernel_check.txt")
  log "fla kernel check: $check"
  [ "$KERNELS" = fla ] && [ "$check" != "exit 0" ] && [ "$check" != "exit 124" ] && { KERNELS=torch; log "the fla check failed: every run uses the torch forms"; }
fi
for base in $RECIPES; do
  probe=$WORK/probe-$base; rm -rf "$probe" "$probe.yaml"
  $PY benchmarks/gpu/train_plan.py recipe "$base" "$probe.yaml" --teacher "$TEACHER" --sources "$SOURCES" --block-len 1024 --step-tokens "$STEP_TOKENS" \
    --tokens $(( PROBE_STEPS * STEP_TOKENS )),$(( PROBE_STEPS * STEP_TOKENS )) --precision "$PRECISION" --eval-tokens 2048 | tee -a "$LOG"
  run_probe() { rm -rf "$probe"; timeout 150 $PY -m attn2ssm distill "$probe.yaml" --out "$probe" --kernels "$KERNELS" --no-progress 2>&1 | tail -n 5 | tee -a "$LOG"; }
  if ! run_probe && [ "$KERNELS" = fla ]; then
    log "$base: the probe failed with kernels fla: every run from here uses the torch forms"
    KERNELS=torch; run_probe
  fi
  $PY benchmarks/gpu/train_plan.py rates "$probe/metrics.jsonl" > "$probe.rates.json" || { log "probe failed"; exit 1; }
  mark "probe $base"
  # seconds for this recipe's training: what is left, less the evaluation and the runs' fixed costs, shared by the recipes still to run
  share=$(( ( $(left) - EVAL_S * n_recipes - 2 * OVERHEAD_S * n_recipes ) / n_recipes ))
  [ "$share" -lt 20 ] && share=20
  main_s=$($PY -c "print(int($share * (1 - $FINAL_SHARE)))"); final_s=$($PY -c "print(int($share * $FINAL_SHARE))")
  read -r t1 t2 t3 < <($PY benchmarks/gpu/train_plan.py plan "$probe.rates.json" --seconds "$main_s" --final-seconds "$final_s" --max-tokens "$MAX_TOKENS" --long-factor "$LONG_FACTOR" --recipe "$base")
  [ -n "${t3:-}" ] || { log "$base: no budgets (the probe measured no stage's rate)"; continue; }
  log "$base: $share s of training: stage 1 $t1, stage 2 $t2 tokens (1024), final $t3 tokens (4096); rates $(tr -d '\n ' < "$probe.rates.json")"
  run=$WORK/runs/$base; final=$WORK/runs/$base-final4096
  $PY benchmarks/gpu/train_plan.py recipe "$base" "$run.yaml" --teacher "$TEACHER" --sources "$SOURCES" --block-len 1024 --step-tokens "$STEP_TOKENS" \
    --tokens "$t1,$t2" --precision "$PRECISION" | tee -a "$LOG"
  timeout $(( main_s + OVERHEAD_S + 60 )) $PY -m attn2ssm distill "$run.yaml" --out "$run" --kernels "$KERNELS" --no-progress 2>&1 | tail -n 12 | tee -a "$LOG"
  mark "main $base"
  [ -d "$run/student" ] || { log "$base: the main run did not finish (resume: attn2ssm distill --out $run --resume)"; continue; }
  # the final stage gets the seconds actually left (the third run's probe under-measured the main run 2.4x,
  # which ended in a quarter of its share), at the main run's own KD rate times LONG_FACTOR
  recipes_after=$(( n_recipes - $(echo $RECIPES | tr ' ' '\n' | grep -n -x "$base" | cut -d: -f1) ))
  final_s=$(( $(left) - EVAL_S * (recipes_after + 1) - OVERHEAD_S - share * recipes_after ))
  [ "$final_s" -lt 10 ] && final_s=10
  $PY benchmarks/gpu/train_plan.py rates "$run/metrics.jsonl" > "$run.rates.json" && \
    read -r _ _ t3 < <($PY benchmarks/gpu/train_plan.py plan "$run.rates.json" --seconds 0 --final-seconds "$final_s" --max-tokens "$MAX_TOKENS" --long-factor "$LONG_FACTOR" --first-share 0.5)
  log "$base: final stage: $final_s s, $t3 tokens (4096)"
  $PY benchmarks/gpu/train_plan.py recipe "$base" "$final.yaml" --teacher "$TEACHER" --sources "$SOURCES" --block-len 4096 --step-tokens "$STEP_TOKENS" \
    --tokens "$t3" --init-from "$run/student" --precision "$PRECISION" | tee -a "$LOG"
  timeout $(( final_s + OVERHEAD_S + 60 )) $PY -m attn2ssm distill "$final.yaml" --out "$final" --kernels "$KERNELS" --no-progress 2>&1 | tail -n 12 | tee -a "$LOG"
  mark "final $base"
  student=$final/student; [ -d "$student" ] || { log "$base: the final stage did not finish; evaluating the 1024-token student"; student=$run/student; }
  # evaluation: held-out perplexity per window (the first window's report also runs the passkey grid)
  needle="--needle-lengths $NEEDLE_LENGTHS --needle-trials $NEEDLE_TRIALS"
  for w in ${WINDOWS//,/ }; do
    [ "$(left)" -lt 15 ] && { log "no time left for eval at window $w"; break; }
    timeout $(( $(left) - 5 )) $PY -m attn2ssm eval "$student" --against "$TEACHER" --report --corpus "$EVAL_CORPORA" \
      --window "$w" --max-tokens "$EVAL_TOKENS" --agreement-prompts 0 $needle --out "$WORK/eval/$base-w$w" 2>&1 | tail -n 14 | tee -a "$LOG"
    needle=""
  done
  mark "eval $base"
done
