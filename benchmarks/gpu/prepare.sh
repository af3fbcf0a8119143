#!/usr/bin/env bash
# Here (a machine with the registries), before a lent GPU is used: what the GPU calls carry, each
# call's carry checked against the device's 64 MiB at the end (a call over it fails here, loudly).
#
#   bash benchmarks/gpu/prepare.sh                      .whl/ and .gpu/ for check.sh (the kernel check)
#   bash benchmarks/gpu/prepare.sh linear_hybrid25 ...  also .gpu_train/ for distill_on_gpu.py
#
#   .whl/               the wheels the GPU image lacks (it has torch 2.11, triton 3.6, tokenizers, accelerate,
#                       safetensors, ... but transformers 5.17 and no fla): transformers (ours), fla-core 0.6.0, gguf
#   .gpu/smollm2-135m/  the built-in teacher's config and tokenizer, no weights (check.sh builds a random-weight
#                       teacher of that shape there)
#   .gpu_train/part1/, part2/   the built-in teacher's GGUF, xz-compressed and cut in two (39 MiB + the rest;
#                       PART_MIB=30,30 cuts three), each travelling in its own call, with SHA-256 sums
#   .gpu_train/shards/<name>/   the recipes' training sources as token ids (attn2ssm data shards), one folder
#                       a source (distill_on_gpu.py sources RECIPE lists them): SOTU, Moby Dick and recall
#                       passages with their held-out sides kept apart; the teacher-sampled ones (generated:,
#                       chat:) sampled HERE once, on the CPU, so the GPU run needs no sampling; and the
#                       evaluation corpora (emails, kjv, pydoc) held-out side only (scored, never trained)
# Then, through the device tool (distill_on_gpu.py's docstring):
#   call 1: carry [".whl", ".gpu_train/part1"]            python3 benchmarks/gpu/distill_on_gpu.py unpack
#   call 2: carry [".gpu_train/part2", ".gpu_train/shards"]  python3 benchmarks/gpu/distill_on_gpu.py run RECIPE --budget-s 560
set -euo pipefail
PY=${PY:-.venv/bin/python}
export PYTHONPATH=$PWD/src
GPU=benchmarks/gpu/distill_on_gpu.py
rm -rf .whl && mkdir -p .whl .gpu
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "transformers==$($PY -c 'import transformers; print(transformers.__version__)')" "fla-core==0.6.0" \
  "gguf==$($PY -c 'from importlib.metadata import version; print(version("gguf"))')"
src=$($PY -c "from attn2ssm.teachers.text import _builtin_hf_dir; print(_builtin_hf_dir('smollm2-135m'))")
rm -rf .gpu/smollm2-135m && mkdir -p .gpu/smollm2-135m
for f in config.json generation_config.json tokenizer.json tokenizer_config.json special_tokens_map.json; do
  [ -f "$src/$f" ] && cp "$src/$f" .gpu/smollm2-135m/
done
if [ $# -eq 0 ]; then
  $PY $GPU carry --call "check=.whl,.gpu"
  echo "carry: .whl .gpu   command: bash benchmarks/gpu/check.sh"
  exit 0
fi

# ---- the teacher's GGUF in two parts
gguf=$($PY -c "from attn2ssm.teachers.text import builtin_gguf_path; print(builtin_gguf_path('smollm2-135m'))")
rm -rf .gpu_train/shards && mkdir -p .gpu_train/shards
# PART_MIB: MiB of each part but the last (39: two parts, 39 MiB + ~47); e.g. 30,30 for three parts
# (three calls) where the carry check below finds a call too big
$PY $GPU split-teacher "$gguf" --out .gpu_train --part-mib "${PART_MIB:-39}"

# ---- the recipes' sources and the evaluation corpora as token ids (a source that cannot be written is
# left out of the GPU run, which says so in its results JSON)
$PY $GPU sources "$@" | while IFS=$'\t' read -r spec folder side; do
  flags=(--no-progress --heldout-tokens 40000)  # the run scores 16,384 held-out tokens a corpus at most
  [ "$side" = heldout ] && flags+=(--max-tokens 0)
  text=$spec
  case "$spec" in
    generated:*) flags+=(--device cpu) ;;  # data shards samples it (the teacher on this CPU)
    chat:*) text=$($PY $GPU chat-corpus "$spec" < /dev/null | tail -n 1) || text=$spec ;;  # answers sampled first
  esac
  $PY -m attn2ssm data shards "$text" --out ".gpu_train/shards/$folder" "${flags[@]}" < /dev/null \
    || echo "WARNING: $spec not written: the GPU run leaves it out (or samples it there with --sample)" >&2
done

# one call per GGUF part: the first also carries the wheels, the last the token ids (and runs)
n=$(ls -d .gpu_train/part* | wc -l)
calls=()
for i in $(seq 1 "$n"); do
  paths=".gpu_train/part$i"; [ "$i" = 1 ] && paths=".whl,$paths"; [ "$i" = "$n" ] && paths="$paths,.gpu_train/shards"
  calls+=(--call "$i=$paths")
done
$PY $GPU carry "${calls[@]}"
for i in $(seq 1 "$n"); do
  carry=$(echo "${calls[$((2 * i - 1))]#*=}" | sed 's/\([^,]*\)/"\1"/g; s/,/, /g')
  if [ "$i" -lt "$n" ]; then
    echo "call $i: carry [$carry]   command: python3 $GPU unpack   timeout_s: 120"
  else
    for r in "$@"; do echo "call $i: carry [$carry]   command: python3 $GPU run $r --budget-s 560   timeout_s: 600"; done
  fi
done
