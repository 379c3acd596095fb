# speculative_equals_target_only on the small shape (graphs + Triton): 62126f1's tree (_before) and this tree, one call
export PYTHONUNBUFFERED=1
for tree in _before .; do
  (cd $tree && TORCHINDUCTOR_CACHE_DIR=/tmp/ab-i TRITON_CACHE_DIR=/tmp/ab-t timeout -k 10 130 python3 benchmarks/decode_cost.py --device cuda:0 --shapes small --blocks 16 --kernels triton --iterations 10 --out /tmp/ab.md > /dev/null 2>&1)
  echo "$tree: $(grep -o '"speculative_equals_target_only": [a-z]*' /tmp/ab.json) $(grep -o '"round_gpu_ms": [0-9.]*' /tmp/ab.json)"
  cp /tmp/ab.json $OUT/decode-small-ab-$(basename $(cd $tree && pwd)).json
done
