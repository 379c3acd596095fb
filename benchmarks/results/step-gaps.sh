# The commands behind step-gaps.md (repository root on the GPU machine; _before = `git archive <base> trainer
# benchmarks`, the tree before the change measured). Parts, in the order given:
#   profile  a paper-dims drafter step: bare, through TrainingWorkers one step at a time, and with steps run
#            ahead (the trainer's loop), profiled, with where the device waited (benchmarks/gpu_gaps.py)
#   decode   the small-shape decode loop of _before against this tree
#   runN     the three step timings again, unprofiled (skipped once the call has run 400 s)
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
R=/tmp/res; mkdir -p $R; pack() { tar -C $R -czf "$OUT/step-gaps.tgz" .; }
for part in "$@"; do
  case $part in
  profile|run*)
    [ $part != profile ] && [ $SECONDS -gt 400 ] && { echo "$part skipped at ${SECONDS}s"; continue; }
    timeout -k 10 330 python3 benchmarks/train_throughput.py --device cuda:0 --parts compiled $([ $part = profile ] && echo --profile) --steps 10 --warmup 3 --child-timeout 160 --out $R/$part.md 2>&1 | grep "^| compiled\|^Matmul\|failed\|Error\|per step"; pack;;
  decode)
    for tree in _before .; do
      name=$(basename $(cd $tree && pwd))
      (cd $tree && timeout -k 10 150 python3 benchmarks/decode_cost.py --device cuda:0 --shapes small --blocks 16 --kernels triton --iterations 50 --out $R/decode-$name.md > $R/decode-$name.log 2>&1)
      echo "$name: $(grep -o '"speculative_equals_target_only": [a-z]*' $R/decode-$name.json) $(grep -o '"[a-z]*_gpu_ms": [0-9.]*' $R/decode-$name.json | tr '\n' ' ')"; pack
    done;;
  esac
done
