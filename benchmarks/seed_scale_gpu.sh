#!/usr/bin/env bash
# benchmarks/seed_scale.py on ONE H200 in one call (~8 minutes): the Qwen3.6-27B-shaped hybrid target with
# flash-linear-attention's kernels, the Qwen3-32B-shaped dense target, then the hybrid again on transformers'
# PyTorch fallback (build + feature forward + regenerate: the target's share of a step and generation).
# Reports: $OUT/seed-scale.md (+ .json) and $OUT/seed-scale-no-fla.md (+ .json).
#
# The GPU box has no network: carry the kernel wheels in .whl/ (an ignored path: pass it in `carry`).
# Download them once on a machine with the index (all pure-Python wheels):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl flash-linear-attention==0.6.0 fla-core==0.6.0 einops
# transformers: the box's 5.17 already has Qwen3_5 (checked in its wheel). To run the exact 5.24 the CPU tests
# ran, add to the same command: transformers==5.24.0 'huggingface-hub>=1.31,<2' (5.24 needs hub >= 1.31).
# fla wheels go to /tmp/site-fla, anything else to /tmp/site; the no-fla run leaves /tmp/site-fla out.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-./seed-scale-out}
PY=${PYTHON:-python3}
mkdir -p "$OUT" /tmp/site /tmp/site-fla
export PYTHONUNBUFFERED=1
fla=$(ls .whl/flash_linear_attention-*.whl .whl/fla_core-*.whl .whl/einops-*.whl 2>/dev/null)
rest=$(ls .whl/*.whl 2>/dev/null | grep -v -e flash_linear_attention- -e fla_core- -e einops-)
[ -n "$fla" ] && "$PY" -m pip install -q --no-index --no-deps --target /tmp/site-fla $fla
[ -n "$rest" ] && "$PY" -m pip install -q --no-index --no-deps --target /tmp/site $rest
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

# One device call holds at most ~9 minutes: SHAPES picks the shapes of this call, NO_FLA=1 adds the fallback run.
PYTHONPATH=/tmp/site-fla:/tmp/site:$PWD timeout -k 10 "${SECONDS_MAIN:-540}" "$PY" benchmarks/seed_scale.py \
    --device cuda:0 --shapes "${SHAPES:-qwen3.6-27b,qwen3-32b}" --parts "${PARTS:-build,cache,decode,regenerate,train}" --out "$OUT/seed-scale.md" --work "${WORK:-/tmp}"
if [ "${NO_FLA:-0}" = 1 ]; then
    PYTHONPATH=/tmp/site:$PWD timeout -k 10 150 "$PY" benchmarks/seed_scale.py --device cuda:0 --shapes qwen3.6-27b \
        --parts build,regenerate --label no-fla --out "$OUT/seed-scale-no-fla.md" --work "${WORK:-/tmp}"
fi
