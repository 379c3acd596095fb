# The commands behind loss-kernel.md (repository root on the H200; _before = `git archive fa1f72d trainer
# benchmarks`, the tree before the Triton loss chunk and the folded clip). `bash loss-kernel.sh checks 1` (call 1:
# the CUDA tests, the loss check with its tile sweep, pair 1), then `bash loss-kernel.sh 2 3` (call 2: pairs 2-3).
# Results go to /tmp/res, packed into $OUT/loss-kernel.tgz after each step (8 files come back at most).
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
R=/tmp/res; mkdir -p $R; pack() { tar -C $R -czf "$OUT/loss-kernel.tgz" .; }
{ nvidia-smi --query-gpu=name,memory.used --format=csv; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } | tee $R/versions.txt
for step in "$@"; do
  if [ "$step" = checks ]; then
    timeout -k 10 200 python3 -m pytest -q -p no:cacheprovider --tb=short tests/trainer/test_loss_kernel.py tests/trainer/test_loss.py tests/trainer/test_workers.py > $R/pytest-loss-kernel.txt 2>&1
    grep -E "passed|failed|Error" $R/pytest-loss-kernel.txt | tail -8; pack
    timeout -k 10 120 python3 benchmarks/fused_loss_check.py --device cuda:0 --tiles --out $R/fused-loss.md 2>&1 | tail -14; pack
    continue
  fi
  (cd _before && timeout -k 10 150 python3 benchmarks/train_throughput.py --device cuda:0 --parts compiled --steps 10 --warmup 3 --child-timeout 120 --out $R/before-$step.md 2>&1 | grep "^| compiled\|^Matmul\|failed\|Error"); pack
  timeout -k 10 200 python3 benchmarks/train_throughput.py --device cuda:0 --parts compiled,loss-kernel --steps 10 --warmup 3 --child-timeout 120 --out $R/after-$step.md 2>&1 | grep "^| compiled\|^Matmul\|failed\|Error"; pack
done
