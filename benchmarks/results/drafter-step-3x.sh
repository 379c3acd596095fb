# Runs 2 and 3 (run 1: drafter-step.sh) of the compiled part (bare and through the trainer's workers), commit 9eb6b4c's tree in _clean
export PYTHONUNBUFFERED=1
cd _clean
for i in 2 3; do
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind$i TRITON_CACHE_DIR=/tmp/tri$i timeout -k 10 250 python3 benchmarks/train_throughput.py --device cuda:0 --parts compiled --steps 10 --warmup 3 --child-timeout 150 --out $OUT/drafter-step-run$i.md 2>&1 | grep "^| compiled\|^Matmul"
done
