# The command that produced decode-cost.md (run from the repository root on the H200; $OUT = results dir).
set -x
export PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
nvidia-smi --query-gpu=name,memory.used --format=csv
R=/tmp/r
timeout -k 10 150 python3 -m trainer --config tiny-cpu --output-dir $R --max-steps 60 --set eval.every=30 --set run.log_every=30 --target-devices cuda:0 --drafter-devices cuda:0 2>&1 | tail -12
timeout -k 10 120 python3 -m trainer eval --checkpoint $R --device cuda:0 --num-prompts 4 --max-new-tokens 32 2>&1 | tail -8
timeout -k 10 400 python3 benchmarks/decode_cost.py --device cuda:0 --shapes small,8b --out $OUT/decode-cost.md 2>&1 | grep -v "^|"
