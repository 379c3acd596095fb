# The commands behind loss-kernel.md, one device call (repository root on the H200;
# _before = `git archive fa1f72d trainer benchmarks`, the tree before the Triton loss chunk and the folded clip)
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
nvidia-smi --query-gpu=name,memory.used --format=csv
timeout -k 10 240 python3 -m pytest -q -p no:cacheprovider tests/trainer/test_loss_kernel.py tests/trainer/test_loss.py tests/trainer/test_workers.py 2>&1 | tail -3 | tee $OUT/pytest-loss-kernel.txt
timeout -k 10 150 python3 benchmarks/fused_loss_check.py --device cuda:0 --tiles --out $OUT/fused-loss.md 2>&1 | tail -22
timeout -k 10 330 python3 benchmarks/train_throughput.py --device cuda:0 --parts compiled,loss-kernel --steps 10 --warmup 3 --child-timeout 150 --out $OUT/loss-kernel-after-1.md 2>&1 | grep "^| compiled\|^Matmul\|failed\|Error"
