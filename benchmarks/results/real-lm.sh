# The command that produced real-lm.md (run from the repository root on the H200; $OUT = results dir).
export PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
W=/tmp/real-lm
timeout -k 10 520 python3 benchmarks/real_lm.py --device cuda:0 --work $W --out $OUT/real-lm.md --budget-s 470
for f in train-b8.log train-b16.log regen.log eval-b8-0.log; do tail -c 200000 $W/$f > $OUT/$f 2>/dev/null; done
