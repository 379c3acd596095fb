#!/usr/bin/env bash
# Everything the GPU proof needs, in one command on a GPU machine; results under $OUT (or ./gpu-out).
#   bash benchmarks/gpu_session.sh smoke|race|race-hang|perf|ckpt-perf|compile-modes|ops|precision|torchrun|features|unattended|tau
# smoke: versions, the CUDA-only trainer tests, one short training run with compiled flex.
# race:  the real trainer at the 5-layer size where the unprotected start fails: none x8 and
#        lock x20, each with activation checkpointing off and on (~8 min; trials 8 at a time).
# race-hang: unprotected 5-layer starts only (16 trials, 8 at a time, ~4 min): the hangs they produce get
#        SIGTERM at 150 s; each must end by itself or by its stop watchdog, none by `timeout`'s SIGKILL.
# perf:  throughput at paper dims.   ckpt-perf: paper dims, checkpointing off vs on (~2-3 min).
# compile-modes: lock trials with run.compile_mode max-autotune-no-cudagraphs (~5 min, optional).
# ops:   dflash-ops relaunch/status/health/tail-log/stop on this machine's `local` target.
# precision: tiny run on CUDA (compiled flex) in bf16-mixed and in fp32: norm weights moved off 1.0,
#        final losses; paper-dims throughput in bf16-mixed and the old bf16-weights baseline (~4 min).
# torchrun: the torchrun launcher (nproc 1, compiled flex, NCCL) vs the threaded single replica.
# features: paper-dims step time with features from an on-disk cache (random features, ~2.9 GiB written
#        under $CACHE_TMP, default ./.feature-cache-tmp, removed after) vs the drafter-only step; MiB per 1k tokens.
# unattended: relaunch/status/health/stop with a foreign CUDA process on the job's GPU (~3 min).
# tau:   tiny-cpu on CUDA (compiled flex) with the tau evaluation on vs off (overhead), then
#        `dflash-train eval` on CUDA: tau, acceptance per position, speedup, lossless check.
set -u
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
setup_ops() {  # the local target's inventory and an `ops` helper that prints each command and its exit
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
  cat > /tmp/gpu-inventory.yaml <<'INV'
targets:
  local:
    transport: local
    job:
      workdir: /tmp/dflash-gpu
      config: tiny-cpu
      target_gpus: [0]
      train_args: [--drafter-devices, "cuda:0,cuda:0,cuda:0", --attention, flex, --max-steps, "3000"]
      health: {min_tokens_per_s: 1000, stall_seconds: 120, min_drafter_util_pct: 0}
INV
  ops() { echo "\$ dflash-ops $*"; timeout -k 10 600 python3 -m dflash_ops --inventory /tmp/gpu-inventory.yaml "$@"; echo "[exit $?]"; }
}
for part in "$@"; do
case $part in
smoke)
  { nvidia-smi; python3 -c 'import torch, sys; print(sys.version); print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'; } 2>&1 | tee "$OUT/versions.txt"
  python3 -m pytest -q -p no:cacheprovider tests/trainer -k "cuda or gpu" 2>&1 | tail -15 | tee "$OUT/pytest-gpu.txt"
  d=$(mktemp -d); TORCHINDUCTOR_CACHE_DIR=$d/i TRITON_CACHE_DIR=$d/t timeout 300 python3 -m trainer --config tiny-cpu \
     --output-dir $d/out --max-steps 30 --attention flex --target-devices cuda:0 --drafter-devices cuda:0,cuda:0,cuda:0 \
     --metrics-file $d/m.jsonl > "$OUT/smoke-train.log" 2>&1; echo "smoke train exit $?" | tee -a "$OUT/smoke-train.log"
  tail -5 "$OUT/smoke-train.log"
  ;;
race)
  # Trials start for 380 s; a hung one gets SIGTERM at 150 s, its stop watchdog ends it by ~169 s (stop grace
  # 10 s + 8 s + 0.5 s) when its Python code cannot run, SIGKILL 20 s later at the latest: done by ~550 s.
  timeout -k 10 575 python3 benchmarks/gpu_race.py --modes none,lock --checkpointing none,layers --trials-none 8 \
    --trials 20 --parallel 8 --timeout 150 --kill-after 20 --budget 380 \
    --label "5-layer drafter, 3 drafter threads, one GPU, fresh cache" --out "$OUT/race-checkpointing.md"
  ;;
race-hang)
  # Trials start for 80 s; a hang gets SIGTERM at 150 s, its stop watchdog ends it by ~169 s: done by ~250 s.
  timeout -k 10 280 python3 benchmarks/gpu_race.py --modes none --checkpointing none --trials-none 16 \
    --parallel 8 --timeout 150 --kill-after 20 --budget 80 \
    --label "unprotected starts: how hangs end (5-layer drafter, 3 drafter threads, one GPU)" \
    --out "$OUT/race-sigterm.md"
  ;;
ckpt-perf)
  timeout -k 10 300 python3 benchmarks/train_throughput.py --parts checkpointing --steps 6 --warmup 2 \
    --child-timeout 240 --out "$OUT/throughput-checkpointing.md"
  ;;
compile-modes)
  timeout -k 10 330 python3 benchmarks/gpu_race.py --modes lock --checkpointing none,layers --trials 2 \
    --parallel 4 --timeout 300 --kill-after 20 --budget 30 --label "run.compile_mode max-autotune-no-cudagraphs" \
    --out "$OUT/race-compile-modes.md" -- --set run.compile_mode=max-autotune-no-cudagraphs
  ;;
perf)
  python3 benchmarks/train_throughput.py --parts compiled,eager --steps 8 --out "$OUT/throughput.md" 2>&1 | tail -20
  python3 benchmarks/train_throughput.py --parts first-step --out "$OUT/first-step.md" 2>&1 | tail -8
  ;;
torchrun)
  python3 -c 'import transformers' 2>/dev/null || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=$PYTHONPATH:/tmp/site; }
  timeout -k 10 300 python3 benchmarks/torchrun_step_time.py --repeats 1 --timeout 140 --out "$OUT/torchrun.md" 2>&1 | tail -30
  ;;
ops)
  setup_ops
  { ops relaunch; sleep 20; ops status; ops status --json; ops health; ops tail-log -n 20; ops stop; ops health; } 2>&1 | tee "$OUT/ops.txt"
  nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu --format=csv,noheader,nounits > "$OUT/nvsmi-gpu.csv" 2>&1
  nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader,nounits > "$OUT/nvsmi-apps.csv" 2>&1
  nvidia-smi --query-gpu=index,name,memory.used,utilization.gpu --format=csv > "$OUT/nvsmi-units.csv" 2>&1
  ;;
precision)
  d=$(mktemp -d)
  for p in bf16-mixed fp32; do
    TORCHINDUCTOR_CACHE_DIR=$d/i TRITON_CACHE_DIR=$d/t timeout -k 10 240 python3 -m trainer --config tiny-cpu \
       --output-dir "$d/$p" --max-steps 60 --attention flex --target-devices cuda:0 --drafter-devices cuda:0 \
       --set train.lr=6e-4 --set train.precision=$p > "$OUT/precision-train-$p.log" 2>&1
    echo "precision $p: train exit $?" | tee -a "$OUT/precision-train-$p.log"; tail -3 "$OUT/precision-train-$p.log"
  done
  timeout -k 10 60 python3 benchmarks/precision_check.py --run "bf16-mixed=$d/bf16-mixed" --run "fp32=$d/fp32" \
     --label "tiny-cpu on one H200, compiled flex, 60 steps, lr 6e-4" --out "$OUT/precision-norms.md"
  echo "precision_check exit $?"
  for p in bf16-mixed bf16-pure; do  # bf16-pure: the old bf16-weights path, the same-machine baseline
    timeout -k 10 420 python3 benchmarks/train_throughput.py --parts compiled --steps 8 --precision $p \
       --out "$OUT/throughput-$p.md" 2>&1 | tail -16
  done
  ;;
features)
  cache_tmp=${CACHE_TMP:-$PWD/.feature-cache-tmp}; mkdir -p "$cache_tmp"   # on disk, not in $OUT
  { df -hT "$cache_tmp"; } 2>&1 | tee "$OUT/features-disk.txt"
  timeout -k 10 240 python3 benchmarks/train_throughput.py --parts compiled,cache --steps 20 --warmup 3 \
     --cache-dir "$cache_tmp" --child-timeout 150 --out "$OUT/features.md" 2>&1 | tail -25
  rm -rf "$cache_tmp"
  ;;
unattended)
  # A foreign CUDA process on the job's GPU: relaunch must refuse before stopping anything, name it
  # (pid, name, MiB), and run with --allow-shared-gpus; status marks it foreign; stop does not wait
  # for it; health after stop is OK (stopped); a second relaunch resumes; runs/ keeps each run.
  setup_ops
  timeout -k 5 240 python3 -c 'import time, torch; x = torch.ones(256, 1024, 1024, device="cuda:0"); print("foreign ready", flush=True); time.sleep(200)' &
  squat=$!; sleep 25
  { echo "foreign pid $squat"; ops relaunch; ops health; ops relaunch --allow-shared-gpus; ops status; ops status --json; ops health;
    ops stop; ops health; ops relaunch --allow-shared-gpus --no-deploy; ops stop; ops health; ls -R /tmp/dflash-gpu/runs | head -30;
    cat /tmp/dflash-gpu/job-state.json; } 2>&1 | tee "$OUT/unattended.txt"
  kill $squat 2>/dev/null; wait $squat 2>/dev/null
  ;;
tau)
  timeout -k 10 420 python3 benchmarks/tau_session.py --device cuda:0 --timeout 180 --out "$OUT/tau.md" 2>&1 | tail -40
  ;;
esac
done
