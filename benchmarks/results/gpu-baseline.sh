# The commands behind the h100-* results (the device named in each; a plain run may get an H100 or an H200) (repository root on the GPU machine). Parts, in the order given:
#   tests   the trainer tests that take a CUDA path (the rest of each file runs too), and the hybrid target's
#           (they run on the CPU, under the machine's own transformers)
#   decode  decode_cost at the small real-LM shape and Qwen3-8B's shape, Triton kernels, block 16
#   train   a paper-dims drafter step, profiled: bare, one step at a time, steps run ahead (step-gaps.sh)
#   kernels every kernel of the decode loop's step, verify, draft and round at both shapes (decode_profile.py)
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
for part in "$@"; do
  case $part in
  tests)
    timeout -k 10 "${TESTS_S:-330}" python3 -m pytest -q -rs --durations=20 -p no:cacheprovider tests/trainer/test_precision.py \
      tests/trainer/test_model.py tests/trainer/test_activation_checkpoint.py \
      tests/trainer/test_hybrid_target.py tests/trainer/test_hybrid_data.py tests/trainer/test_kv_cache.py \
      tests/trainer/test_gdn_kernels.py tests/trainer/test_spec_generate.py tests/trainer/test_workers.py \
      tests/trainer/test_static_decode.py tests/trainer/test_decode_kernels.py > "$OUT/pytest-gpu.txt" 2>&1
    tail -4 "$OUT/pytest-gpu.txt";;
  decode)
    timeout -k 10 330 python3 benchmarks/decode_cost.py --device cuda:0 --shapes small,8b --blocks 16 --kernels triton \
      --out "$OUT/decode.md" 2>&1 | grep -v "^|" | tail -20;;
  train)
    bash benchmarks/results/step-gaps.sh profile run2;;
  kernels)
    timeout -k 10 "${KERNELS_S:-300}" python3 benchmarks/decode_profile.py --device cuda:0 --shapes small,8b --out "$OUT/decode-profile.md" \
      2>&1 | grep -v "^|\|USDT" | tail -20;;
  esac
done
