#!/usr/bin/env bash
# One batch of GPU-machine work (the device tool gives short leases). Stages, chosen by $STAGES
# (default: build cuda memory bench bench-large ladder refresh):
#   build    the package;                  cuda     the CUDA tests;
#   memory   bench/memory.py --compare;    ladder   bench/memory.py --ladder (NVMe column: stage nvme);
#   refresh  the refresh-engine benchmark, on all cores and on one;
#   profile  bench/profile_step.py, where a step's time goes ($PROFILE_CONFIGS, $PROFILE_STEPS, $PROFILE_ARGS);
#   bench    asteria bench on olmo-160m at the issue's small batch (8 x 512);
#   bench-large  the same at a GPU-bound batch (32 x 1024, TF32 matrix products; more options in $LARGE_ARGS);
#   long     issue 7's comparison: $LONG_STEPS (300) steps of olmo-160m at 32 x 1024, AdamW vs the Asteria
#            optimizers (more options in $LONG_ARGS, e.g. --no-deterministic);
#   sweep    tools/sweep.py over S ($SWEEP_S) for each of $SWEEP_OPTIMIZERS (default: soap), Asteria mode, same
#            model and batch, 150 steps ($SWEEP_ARGS);
#   scaling  bench/scaling.py: torchrun on 1 and 2 GPUs, DDP and FSDP2 (needs a 2-GPU machine);
#   opt      bench/opt_step.py: one opt.step() alone, its device time per operator ($OPT_ARGS);
#   extra    the shell line in $EXTRA_CMD (e.g. a second bench with another seed; $OUT is this batch's).
# Logs and JSON land in $OUT (default: runs/gpu-session). Set CUDA_VISIBLE_DEVICES (and taskset) outside
# to run two sessions side by side on a 2-GPU machine. DRY_RUN=1 prints each command instead of running it
# (tests/test_bench_scripts.py checks them against their programs' parsers).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-session}
STAGES=${STAGES:-"build cuda memory bench bench-large ladder refresh"}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
has() { [[ " $STAGES " == *" $1 "* ]]; }
quiet() { tr '\r' '\n' | grep -av "it/s\|s/it\|USDT"; }
dry() { [[ ${DRY_RUN:-0} == 1 ]]; }
run() { if dry; then echo "$*"; else "$@"; fi; }  # a command, or with DRY_RUN=1 its line
if ! dry; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
  lscpu | grep -E "Model name|^CPU\(s\)|Thread" | tee -a "$OUT/device.txt"
fi
has build && run python3 -m pip install -q --no-build-isolation --no-deps . 2>&1 | tail -2
has cuda && run python3 -m pytest -q -p no:warnings tests/test_cuda.py tests/test_cuda_tiers.py tests/test_pager.py \
  2>&1 | tail -25 | tee "$OUT/pytest.txt"
has memory && run python3 bench/memory.py --compare --model olmo-660m --out "$OUT" 2>&1 | tee "$OUT/memory.txt"
CLI="python3 -m asteria.train.cli"
GPU_BOUND="--model olmo-160m --batch-size 32 --seq-len 1024 --matmul-precision high"
has bench && run $CLI bench --model olmo-160m --steps 60 --batch-size 8 --seq-len 512 --precondition-frequency 10 \
  --staleness 5 --eval-every 60 --out "$OUT/bench" 2>&1 | quiet | tee "$OUT/bench.txt"
has bench-large && run $CLI bench $GPU_BOUND --steps 60 --precondition-frequency 10 --staleness 5 --eval-every 60 \
  ${LARGE_ARGS:-} --out "$OUT/bench-large" 2>&1 | quiet | tee "$OUT/bench-large.txt"
has long && run $CLI bench $GPU_BOUND --steps ${LONG_STEPS:-300} --precondition-frequency 10 --staleness 5 --eval-every 100 \
  --configs adamw soap-async shampoo-async kl-shampoo-async ${LONG_ARGS:-} --out "$OUT/long" 2>&1 | quiet \
  | tee "$OUT/long.txt"
if has sweep; then
  for opt in ${SWEEP_OPTIMIZERS:-soap}; do
    run python3 tools/sweep.py $GPU_BOUND --optimizer $opt --mode async --steps 150 --eval-every 150 \
      --staleness ${SWEEP_S:-0 1 3 5} ${SWEEP_ARGS:-} --out "$OUT/sweep-$opt" 2>&1 | quiet | tee "$OUT/sweep-$opt.txt"
  done
fi
has profile && run python3 bench/profile_step.py --model olmo-160m --batch-size 32 --seq-len 1024 \
  --steps ${PROFILE_STEPS:-20} --configs ${PROFILE_CONFIGS:-adamw shampoo-sync shampoo-async soap-async} ${PROFILE_ARGS:-} --out "$OUT/profile" 2>&1 | quiet | tee "$OUT/profile.txt"
has ladder && run python3 bench/memory.py --ladder --cap-gib 24 --out "$OUT/ladder" 2>&1 | tee "$OUT/ladder.txt"
has nvme && run python3 bench/memory.py --ladder --cap-gib 24 --setups asteria_host_nvme --widths 1536 \
  --host-budget-gib 22 --out "$OUT/nvme" 2>&1 | tee "$OUT/nvme.txt"
has refresh && run python3 bench/refresh_engine.py --sizes 1024 2048 --blocks 64 32 --out "$OUT/refresh_engine.json" \
  2>&1 | tee "$OUT/refresh_engine.txt"
# the same on one core, alone: against the figures above, what 16 busy cores cost each configuration
has refresh && run taskset -c 0 python3 bench/refresh_engine.py --sizes 1024 2048 --blocks 4 2 --cores 1 \
  --out "$OUT/refresh_engine_1core.json" 2>&1 | tee "$OUT/refresh_engine_1core.txt"
has scaling && run python3 bench/scaling.py --out "$OUT/scaling" --nprocs 1 2 --parallel ddp fsdp --model olmo-160m \
  --steps ${SCALING_STEPS:-40} --batch-size 8 --seq-len 512 ${SCALING_ARGS:-} 2>&1 | tee "$OUT/scaling.txt"
has opt && run python3 bench/opt_step.py --model olmo-160m --max-preconditioner-dim 1024 --tf32 ${OPT_ARGS:-} \
  --out "$OUT/opt_step.json" 2>&1 | grep -v USDT | tee "$OUT/opt_step.txt"
has extra && if dry; then echo "${EXTRA_CMD:-}"; else eval "${EXTRA_CMD:-}"; fi 2>&1 | quiet | tee "$OUT/extra.txt"
exit 0
