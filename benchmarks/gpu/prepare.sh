#!/usr/bin/env bash
# Here (a machine with the registries), before a lent GPU is used: what check.sh carries there.
#   .whl/                 the wheels the GPU image lacks (its image has torch, triton 3.6, tokenizers,
#                         accelerate, safetensors, huggingface_hub, ... but transformers 5.17 and no fla)
#   .gpu/smollm2-135m/    the built-in teacher's config and tokenizer, no weights (check.sh builds a
#                         random-weight teacher of the same shape there: speed does not depend on the values)
# Both folders are git-ignored; name them in the device call's carry. Run from the repo root:
#   bash benchmarks/gpu/prepare.sh
set -euo pipefail
PY=${PY:-.venv/bin/python}
rm -rf .whl && mkdir -p .whl .gpu
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "transformers==$($PY -c 'import transformers; print(transformers.__version__)')" "fla-core==0.6.0"
src=$($PY -c "from attn2ssm.teachers.text import _builtin_hf_dir; print(_builtin_hf_dir('smollm2-135m'))")
rm -rf .gpu/smollm2-135m && mkdir -p .gpu/smollm2-135m
for f in config.json generation_config.json tokenizer.json tokenizer_config.json special_tokens_map.json; do
  [ -f "$src/$f" ] && cp "$src/$f" .gpu/smollm2-135m/
done
du -sh .whl .gpu
echo "carry: .whl .gpu   command: bash benchmarks/gpu/check.sh"
