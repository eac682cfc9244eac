#!/usr/bin/env bash
# The one prepared script to run when a GPU machine is lent: about 9 minutes on one GPU, every phase bounded so the
# whole stays under DEADLINE_S (default 530) seconds. In order of what matters most:
#   1. the compiled suite on CUDA in bf16 with generate compiling in mode="reduce-overhead" (CUDA graphs), our caches
#      on the default pool as generate(cache_implementation=...) gives them: StaticCache compiled (the baseline),
#      DynamicCache eager, paged_pool, sliding_ring and quantized_values compiled at 4,096 x 8 (the issue's
#      targets), then paged_pool compiled at 1,024 x 1;
#   2. the GPU-marked tests;
#   3. quantized_kv compiled at 1,024 x 1.
# `bash scripts/gpu_check.sh profile` instead prints where the compiled steps' device time goes (mode="default", so
# that every kernel shows) for the rows short of their targets: paged_pool at 1,024 x 1 (StaticCache's profile is in
# benchmarks/gpu/second-run-profile-h200.log), quantized_values at 4,096 x 8.
# Results land in $OUT (or ./gpu_results): one log and a JSON record per benchmark.
#
# On the lent machine of this workplace (no package index, 64 MiB carried), run scripts/gpu_prepare.sh here first:
#   .whl/        transformers and the dependencies the machine's image lacks at the versions it needs
#   .gpu/home/   an HF_KVCACHE_HOME holding the bundled model's config and tokenizer (no weights) and the essays;
#                the benchmarks then run the bundled architecture with random weights (--random-weights)
# and carry both. Elsewhere neither folder exists and the bundled model is used as is.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_results}"
mkdir -p "$out"
log="$out/gpu_check.log"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
deadline=$((SECONDS + ${DEADLINE_S:-530}))
weights=()
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
if [ -d .gpu/home ]; then
    export HF_KVCACHE_HOME="$PWD/.gpu/home"
    weights=(--random-weights)
fi

# phase NAME CAP_S COMMAND...: runs the command for at most CAP_S seconds and never past the deadline.
phase() {
    local name=$1 cap=$2
    shift 2
    local left=$((deadline - SECONDS))
    if [ "$left" -lt 20 ]; then
        echo "== $name: skipped, ${left} s left" | tee -a "$log"
        return
    fi
    local limit=$((cap < left ? cap : left))
    echo "== $name (at most $limit s; $((SECONDS)) s in)" | tee -a "$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS)) s" | tee -a "$log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$log"
python3 -c 'import torch, transformers, hf_kvcache.bench; print("torch", torch.__version__, "transformers",
transformers.__version__, "cuda", torch.cuda.is_available())' 2>&1 | tee -a "$log" || exit 1

bench=(python3 scripts/bench_decode.py "${weights[@]}" --device cuda --dtype bfloat16)
compiled=("${bench[@]}" --suite compiled --mode reduce-overhead --steps 32 --rounds 2)
if [ "${1:-}" = profile ]; then
    profile=("${bench[@]}" --suite compiled --mode default --steps 4 --profile-row)
    phase "profile paged_pool 1,024 x 1" 150 "${profile[@]}" paged_pool:compiled --lengths 1024 --batches 1
    phase "profile quantized_values 4,096 x 8" 180 "${profile[@]}" quantized_values:compiled --lengths 4096 --batches 8
    echo "== done after $SECONDS s" | tee -a "$log"
    exit 0
fi
phase "compiled 4,096 x 8" 300 "${compiled[@]}" --lengths 4096 --batches 8 \
    --rows dynamic paged_pool:compiled sliding_ring:compiled quantized_values:compiled \
    --output "$out/compiled-4096x8.json"
phase "compiled 1,024 x 1" 120 "${compiled[@]}" --lengths 1024 --batches 1 \
    --rows dynamic paged_pool:compiled --output "$out/compiled-1024x1.json"
phase "GPU tests" 60 python3 -m pytest -q -m gpu -rs -p no:cacheprovider
phase "quantized_kv compiled 1,024 x 1" 150 "${compiled[@]}" --lengths 1024 --batches 1 \
    --rows quantized_kv:compiled --output "$out/compiled-quantized-kv-1024x1.json"
echo "== done after $SECONDS s" | tee -a "$log"
