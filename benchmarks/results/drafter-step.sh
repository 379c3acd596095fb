# The commands that produced drafter-step*.md / e2e-*.md (repository root on the H200; _before = git archive 62126f1 trainer benchmarks)
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
nvidia-smi --query-gpu=name,memory.used --format=csv
timeout -k 10 150 python3 -m pytest -q -p no:cacheprovider tests/trainer/test_workers.py -k cuda 2>&1 | tail -5 | tee $OUT/pytest-workers-cuda.txt
timeout -k 10 260 python3 benchmarks/train_throughput.py --device cuda:0 --parts compiled --steps 10 --warmup 3 --child-timeout 200 --out $OUT/drafter-step-1.md 2>&1 | grep -v "^  " | tail -12
(cd _before && timeout -k 10 170 python3 benchmarks/train_throughput.py --device cuda:0 --parts e2e --steps 10 --warmup 3 --cache-sequences 2 --child-timeout 160 --out $OUT/e2e-before.md 2>&1 | tail -3)
timeout -k 10 170 python3 benchmarks/train_throughput.py --device cuda:0 --parts e2e --steps 10 --warmup 3 --cache-sequences 2 --child-timeout 160 --out $OUT/e2e-after.md 2>&1 | tail -3
grep -h "drafter_step_s\|e2e_step_s" $OUT/e2e-*.json | head; python3 -c "
import json
for f in ('before','after'):
    e=json.load(open('$OUT/e2e-%s.json'%f))['e2e']; print(f, e.get('drafter_step_s'), e.get('e2e_step_s'), e.get('target_forward_s'))"
