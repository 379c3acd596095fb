# A change to the static decode loop, before and after: the tree before (_before = `git archive <base> trainer
# benchmarks`) against this tree, decode_cost at the small shape (and Qwen3-8B's in the first round), block 16,
# Triton kernels, alternating, three times each (AB_ROUNDS, AB_SHAPES, AB_STOP_S: fewer) (repository root on the
# GPU machine). Raw JSON in $OUT/decode-ab.tgz.
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
R=/tmp/ab; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader
for i in $(seq ${AB_ROUNDS:-3}); do
  for tree in _before .; do
    name=$( [ $tree = . ] && echo after || echo before )
    [ $SECONDS -gt ${AB_STOP_S:-500} ] && { echo "$name-$i skipped at ${SECONDS}s"; continue; }
    (cd $tree && timeout -k 10 $([ $i = 1 ] && echo 200 || echo 120) python3 benchmarks/decode_cost.py --device cuda:0 --shapes ${AB_SHAPES:-small$([ $i = 1 ] && echo ,8b)} \
      --blocks 16 --kernels triton --iterations 50 --out $R/$name-$i.md > $R/$name-$i.log 2>&1)
    python3 - "$R/$name-$i.json" "$name-$i" <<'PY'
import json, sys
try:
    results = json.load(open(sys.argv[1]))["results"]
except (OSError, ValueError) as e:
    sys.exit(f"{sys.argv[2]}: no results ({e})")
for shape, r in results.items():
    row = r["rows"][0]
    cells = " ".join(f"{k}={row[f'{k}_gpu_ms']:.3f}/{row[f'{k}_loop_ms']:.3f}" for k in ("step", "verify", "draft", "round"))
    print(f"{sys.argv[2]} {shape}: {cells} round/step(loop)={row['round_loop_ms'] / row['step_loop_ms']:.3f} "
          f"tok/s={row['target_only_tok_s']:.0f} spec==target {row['speculative_equals_target_only']}")
PY
    tar -C $R -czf "$OUT/decode-ab.tgz" .
  done
done
