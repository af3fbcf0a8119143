#!/usr/bin/env bash
# Here (a machine with the registries), before a lent GPU is used: what check.sh carries there.
#   .whl/                 the wheels the GPU image lacks (its image has torch, triton 3.6, tokenizers,
#                         accelerate, safetensors, huggingface_hub, ... but transformers 5.17 and no fla)
#   .gpu/smollm2-135m/    the built-in teacher's config and tokenizer, no weights (check.sh builds a
#                         random-weight teacher of the same shape there: speed does not depend on the values)
#   (.whl also holds gguf, which loads the built-in teacher's GGUF: train.sh needs it.)
# Both folders are git-ignored; name them in the device call's carry. Run from the repo root:
#   bash benchmarks/gpu/prepare.sh
# With the argument train it also writes .gpu_train/, what benchmarks/gpu/train.sh carries (git-ignored):
#   .gpu_train/part1/, .gpu_train/part2/  the built-in teacher's GGUF, xz-compressed (94 MiB -> ~86 MiB) and cut in
#                             two (40 MiB + the rest), each travelling in its own call, with SHA-256 sums
#                             of the parts and of the GGUF itself (checked on the device after joining);
#   .gpu_train/shards/{sotu,moby-dick}/  the built-in training corpora as token ids (attn2ssm data shards):
#                             train side and held-out side kept apart as prepare_corpus splits them
#                             (sotu: addresses before 2000 train, 2000-2021 held out; moby-dick: last
#                             14 chapters held out); the held-out sides are scored on the device.
#   .gpu_train/shards/{recall,recall-long}/  key-value recall passages (training text: the needles' answer format)
#   .gpu_train/shards/{emails,kjv,pydoc}/    the suite's held-out domains, held-out side only (scored, never trained)
#   bash benchmarks/gpu/prepare.sh train
set -euo pipefail
PY=${PY:-.venv/bin/python}
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
du -sh .whl .gpu
echo "carry: .whl .gpu   command: bash benchmarks/gpu/check.sh"
[ "${1:-}" = train ] || exit 0

# ---- train: the teacher's GGUF in two parts, and the training corpora as token shards
PART1_MIB=${PART1_MIB:-40}
gguf=$(PYTHONPATH=src $PY -c "from attn2ssm.teachers.text import builtin_gguf_path; print(builtin_gguf_path('smollm2-135m'))")
rm -rf .gpu_train/part1 .gpu_train/part2 .gpu_train/shards && mkdir -p .gpu_train/part1 .gpu_train/part2 .gpu_train/shards
name=$(basename "$gguf")
if [ ! -f ".gpu_train/$name.xz" ] || ! xz -t ".gpu_train/$name.xz"; then  # kept between runs of this script (delete it to recompress)
  echo "compressing $name (xz -6, a few minutes on 2 cores) ..."
  xz -6 -T2 -c "$gguf" > ".gpu_train/$name.xz.tmp" && mv ".gpu_train/$name.xz.tmp" ".gpu_train/$name.xz"
fi
(cd "$(dirname "$gguf")" && sha256sum "$name") > .gpu_train/gguf.sha256
head -c $((PART1_MIB << 20)) ".gpu_train/$name.xz" > ".gpu_train/part1/$name.xz.part0"
tail -c +$(( (PART1_MIB << 20) + 1 )) ".gpu_train/$name.xz" > ".gpu_train/part2/$name.xz.part1"
(cd .gpu_train/part1 && sha256sum ./*.part0 > parts.sha256) && (cd .gpu_train/part2 && sha256sum ./*.part1 > parts.sha256)
cp .gpu_train/gguf.sha256 .gpu_train/part1/ && mv .gpu_train/gguf.sha256 .gpu_train/part2/
for corpus in sotu moby-dick; do
  PYTHONPATH=src $PY -m attn2ssm data shards "$corpus" --out ".gpu_train/shards/$corpus" --no-progress
done
# key-value recall passages from sotu's training addresses (the needles' answer format; long ones for the
# 4096-token stage), and the suite's three held-out domains as held-out-only shards (scored, never trained)
PYTHONPATH=src $PY -m attn2ssm data shards "recall:1024:sotu" --out .gpu_train/shards/recall --no-progress
PYTHONPATH=src $PY -m attn2ssm data shards "recall:400:sotu?max_words=2800" --out .gpu_train/shards/recall-long --no-progress
for corpus in emails kjv pydoc; do
  PYTHONPATH=src $PY -m attn2ssm data shards "$corpus" --out ".gpu_train/shards/$corpus" --max-tokens 0 --heldout-tokens 40000 --no-progress
done
tree_mib=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
echo "sizes (MiB): tracked tree $((tree_mib >> 20)), .whl $(( $(du -sb .whl | cut -f1) >> 20 )), part1 $(( $(du -sb .gpu_train/part1 | cut -f1) >> 20 )), part2 $(( $(du -sb .gpu_train/part2 | cut -f1) >> 20 )), shards $(( $(du -sb .gpu_train/shards | cut -f1) >> 20 ))"
echo "call 1: carry [\".whl\", \".gpu_train/part1\"]   command: bash benchmarks/gpu/train.sh 1   timeout_s: 120"
echo "call 2: carry [\".gpu_train/part2\", \".gpu_train/shards\"]   command: bash benchmarks/gpu/train.sh 2   timeout_s: 600"
