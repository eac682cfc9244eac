#!/usr/bin/env bash
# The one prepared script to run when a GPU machine is lent (about 10 minutes on one GPU):
# the GPU-marked tests, then the paged decode suite on CUDA in bf16 (paged_pool in place under hf_kvcache and
# gathered under sdpa, default/fixed/fragmented pools, next to StaticCache and DynamicCache), then a profile of one
# 4,096 x 8 step in place on a fixed pool, then the compiled suite on CUDA (generate compiling with
# mode="reduce-overhead", i.e. CUDA graphs; StaticCache compiled is the baseline). Results land in $OUT (or
# ./gpu_results).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_results}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python -m pytest -q -m gpu -rs 2>&1 | tee "$out/gpu_tests.txt"
python scripts/bench_decode.py --suite paged --device cuda --dtype bfloat16 --lengths 1024 4096 --batches 1 8 \
    --output "$out/decode-cuda.json" 2>&1 | tee "$out/bench.txt"
python scripts/bench_decode.py --device cuda --dtype bfloat16 --profile paged_pool_fixed --lengths 4096 \
    --batches 8 2>&1 | tee "$out/profile.txt"
python scripts/bench_decode.py --suite compiled --device cuda --dtype bfloat16 --mode reduce-overhead \
    --lengths 1024 4096 --batches 1 8 --steps 32 --output "$out/decode-compiled-cuda.json" 2>&1 | tee "$out/compiled.txt"
