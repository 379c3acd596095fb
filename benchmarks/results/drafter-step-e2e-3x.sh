# Before/after pairs 2 and 3 (pair 1: drafter-step.sh): the drafter step through TrainingWorkers, --parts e2e,
# _before = git archive 62126f1 trainer benchmarks, _clean = git archive 9eb6b4c trainer benchmarks
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
for i in 2 3; do
  for tree in _before _clean; do
    (cd $tree && timeout -k 10 130 python3 benchmarks/train_throughput.py --device cuda:0 --parts e2e --steps 10 --warmup 3 --cache-sequences 2 --child-timeout 120 --out $OUT/e2e-$tree-$i.md > /dev/null 2>&1)
    python3 -c "import json,sys; e=json.load(open(sys.argv[1]))['e2e']; print(sys.argv[1], e.get('drafter_step_s'), e.get('e2e_step_s'))" $OUT/e2e-$tree-$i.json
  done
done
