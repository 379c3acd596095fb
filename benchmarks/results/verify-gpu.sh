# The tree after this session's trims, on the H200: the CUDA-only trainer tests, a 30-step compiled-flex run with three
# drafter threads (blocks drawn on the target thread), and the static decode loop on the small shape (graphs + Triton).
export PYTHONUNBUFFERED=1
timeout -k 10 330 bash benchmarks/gpu_session.sh smoke
TORCHINDUCTOR_CACHE_DIR=/tmp/dc-i TRITON_CACHE_DIR=/tmp/dc-t timeout -k 10 200 python3 benchmarks/decode_cost.py --device cuda:0 --shapes small --blocks 16 --kernels triton --iterations 20 --out $OUT/decode-small-check.md 2>&1 | tail -4
grep -h "equal" $OUT/decode-small-check.json | head -6
