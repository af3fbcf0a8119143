#!/usr/bin/env bash
# The GPU path on a lent GPU, one command (about 6-8 minutes on an H100/H200); results under $OUT.
# Prepare here first (bash benchmarks/gpu/prepare.sh), then, through the device tool:
#   carry: [".whl", ".gpu"]   command: bash benchmarks/gpu/check.sh   timeout_s: 560
# 1. the kernel group on CUDA: every fla-backed form against the CPU's fp32 PyTorch form, fp32 (TF32
#    off, TRITON_F32_DEFAULT=ieee), fp16 and bf16; and tests/test_cuda.py (every mixer kind on CUDA);
# 2. the forms' speed (forward + backward, one layer's token mixing) against bf16 SDPA (flash), 1k-16k;
# 3. attn2ssm bench train, kernels torch vs fla, bf16, 2k and 8k blocks, on a random-weight teacher of
#    the built-in teacher's shape, with the teacher's own forward+backward beside each point.
set -uo pipefail
OUT=${OUT:-/tmp/attn2ssm-gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_F32_DEFAULT=ieee TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__)" | tee -a "$OUT/gpu.txt"

echo "== 1. kernel forms on CUDA"
ATTN2SSM_KERNEL_TESTS=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider -m "interpret or not slow" tests/kernels tests/test_cuda.py -x 2>&1 | tail -n 30 | tee "$OUT/kernel_tests.txt"

echo "== 2. kernel speed vs SDPA (bf16)"
timeout 150 python3 benchmarks/linear_attention_speed.py --devices cuda --dtype bfloat16 --isolation none --repeats 5 --point-budget 20 \
  --methods sdpa,hedgehog,hedgehog_fla,lolcats_loop,lolcats,ssd,ssd_fla,gdn,gdn_fla --lengths 1024,2048,4096,8192,16384 \
  --out "$OUT/kernel_speed_cuda.json" 2>&1 | tail -n 50

echo "== 3. bench train, kernels torch vs fla"
python3 benchmarks/gpu/random_teacher.py .gpu/smollm2-135m /tmp/teacher /tmp/shards --tokens $((1 << 24)) || exit 1
timeout 200 python3 -m attn2ssm bench train --teacher /tmp/teacher --corpus shards:/tmp/shards --cases attention_transfer,kd_lora,kd_ce_mixers \
  --lengths 2048,8192 --step-tokens 65536 --precisions auto --kernels torch,fla --steps 3 --no-profile --out "$OUT/train_speed_cuda.json" 2>&1 | tail -n 30
ls -la "$OUT"
