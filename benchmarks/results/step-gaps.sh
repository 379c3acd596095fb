# The commands behind step-gaps.md (repository root on the GPU machine; _before = `git archive <base> trainer
# benchmarks`, the tree before the change measured). `bash step-gaps.sh profile` profiles a paper-dims drafter
# step, bare and through TrainingWorkers, with where the device waited (benchmarks/gpu_gaps.py);
# `bash step-gaps.sh decode` is the small-shape decode A/B of _before against this tree, one call.
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
R=/tmp/res; mkdir -p $R; pack() { tar -C $R -czf "$OUT/step-gaps.tgz" .; }
for part in "$@"; do
  if [ "$part" = profile ]; then
    timeout -k 10 330 python3 benchmarks/train_throughput.py --device cuda:0 --parts compiled --profile --steps 5 --warmup 3 --child-timeout 160 --out $R/profile.md 2>&1 | grep "^| compiled\|^| trainer\|^Matmul\|failed\|Error\|per step"; pack
  fi
  if [ "$part" = decode ]; then
    for tree in _before .; do
      name=$(basename $(cd $tree && pwd))
      (cd $tree && timeout -k 10 150 python3 benchmarks/decode_cost.py --device cuda:0 --shapes small --blocks 16 --kernels triton --iterations 50 --out $R/decode-$name.md > $R/decode-$name.log 2>&1)
      echo "$name: $(grep -o '"speculative_equals_target_only": [a-z]*' $R/decode-$name.json) $(grep -o '"[a-z]*_gpu_ms": [0-9.]*' $R/decode-$name.json | tr '\n' ' ')"; pack
    done
  fi
done
