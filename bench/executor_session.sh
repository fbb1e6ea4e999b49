#!/usr/bin/env bash
# One device call of the refresh executor's measurements (the device tool gives short leases). Stages, chosen by
# $STAGES (default: build cuda small):
#   build   the package, and the wheels in .peers/wheels (heavyball's peer: the device has no network, so
#           `pip download heavyball opt-einsum --no-deps -d .peers/wheels` here first; .peers/ is never committed);
#   cuda    the CUDA tests: tests/test_cuda.py, then the other files with GPU tests (the first
#           failure stops the call; the log, $OUT/cuda.txt, is written as the tests run);
#   small   asteria bench on olmo-160m at 8 x 1024 tokens a step: AdamW, native Shampoo, Asteria's three at their
#           defaults, and Meta's Distributed Shampoo from .peers/ ($SMALL_CONFIGS, $SMALL_STEPS);
#   large   the same at 32 x 1024 ($LARGE_CONFIGS, $LARGE_STEPS);
#   1b      olmo2-1b at 16 x 1024 ($ONEB_CONFIGS, $ONEB_STEPS);
#   profile where a quiet step's time goes (bench/profile_step.py): $PROFILE_MODEL (default: olmo2-1b) at
#           $PROFILE_BATCH (default: 16) x 1024, each config of $PROFILE_CONFIGS (default: adamw shampoo-sync
#           soap-sync kl-shampoo-sync, with TF32 as the benches run) in a process of its own: $PROFILE_STEPS steady
#           steps timed (default: 4; native mode's refresh steps fall outside them), the model's part and the
#           optimizer's, the steady steps' peak allocation and allocator retries, two steps traced (the main
#           stream's idle gaps, the slow CUDA runtime and driver calls: the allocator's among them), then two steps'
#           top operators by GPU time (at 1B the native step alone is 1.7-1.9x AdamW's: docs/results.md,
#           "olmo2-1b at the current code");
#   math    bench/gpu_refresh_math.py: the refresh math's cost on the GPU beside a training-like loop;
#   syev    bench/gpu_syev_batched.py: cuSOLVER's batched eigensolver (XsyevBatched, which torch calls only up to
#           n = 32) against torch's eigh at n = 1024 and 2048, batches of 1, 4 and 16: blocks a second, accuracy, and
#           the cost beside a training-like loop (whether the device lane's rate could grow with its batch);
#   contention  bench/launch_contention.py: what refresh math in a thread of the training process, or in a process
#           of its own, costs the training thread's kernel launches (a launch-bound chain, then a GPU-bound one);
#   dims    olmo-160m at 8 x 1024 once per max_preconditioner_dim in $DIMS (default: 1024 2048), $DIMS_CONFIGS
#           ($DIMS_STEPS): what smaller blocks cost in loss against the work they save (bench/refresh_demand.py);
#   sweep   olmo-160m at $SWEEP_BATCH x 1024 (default: 8) for each beta2 in $BETA2S (default: 0.95 0.999) and lr
#           schedule in $SCHEDULES (default: cosine constant), $SWEEP_CONFIGS ($SWEEP_STEPS): the issue's
#           hyperparameter range (EXTRA_ARGS=--deterministic-kernels pairs async with native as the seeds stage does);
#   first   SOAP's first-basis rule on olmo-160m at 8 x 1024 and f = $FIRST_F (default: 50), per seed in $FIRST_SEEDS
#           (default: 0 1): SOAP at its default (eigh) beside Distributed Shampoo's, then with --first-basis qr
#           (Distributed Shampoo's rule) ($FIRST_STEPS);
#   soapgap what separates Asteria's SOAP from Distributed Shampoo's at f = $FIRST_F (default: 50), seed 0: AdamW
#           (which both SOAPs trailed at f = 50), native mode (no staleness), the async default, Distributed
#           Shampoo's SOAP, then the async default with 1-D factors (--precondition-1d, which Distributed Shampoo
#           gives them) ($FIRST_STEPS);
#   workers olmo-160m at 8 x 1024 with each worker count in $WORKER_COUNTS (default: 6 10 14), $WORKERS_CONFIGS
#           ($WORKERS_STEPS, default 150), then native mode ($WORKERS_NATIVE): whether fewer workers (less memory
#           traffic beside the training thread and the copies) shorten the steps more than they cost in refreshes,
#           and how far each run's quietest position in the interval (the bench's interval profile) lies above
#           native mode's;
#   seeds   the loss target: olmo-160m at $SEEDS_BATCH x 1024 (default: 8), each optimizer async beside native
#           mode with torch's strict deterministic kernels (runs of identical math otherwise scatter by 1-3%), per
#           seed in $SEEDS (default: 0 1 2), $SEEDS_CONFIGS ($SEEDS_STEPS); one seed takes about 8 minutes at
#           8 x 1024 and 300 steps, 6 at 32 x 1024 and 200;
#   phases  bench/eigh_variants.cpp at n = 2048 on each thread count in $PHASES_THREADS (default: 1 16): whether the
#           workers' tridiagonalization (half of a root's time on one core) turns memory-bound when every core
#           reduces its own matrix; once per vector-kernel cap in $PHASES_SIMD (default: widest; e.g. "widest avx2":
#           whether the in-house sweep runs faster with 32-byte vectors on an AVX-512 host, ASTERIA_MAX_SIMD).
#   hb      heavyball's SOAP and KL-Shampoo beside Asteria's and AdamW on olmo-160m at 8 x 1024 ($HB_STEPS,
#           default 150; heavyball compiles its step with max-autotune on a GPU, which may take minutes at first);
#   green   whether the device lane's refreshes can stop lengthening the training steps they overlap, by a share of
#           the GPU's SMs (RuntimeConfig.device_sms, a CUDA green context) or by training on a stream of higher
#           priority than the lane's (--stream-priority -1; the default stream has CUDA's lowest, the lane's): with
#           $GREEN_MATH (default 1), bench/gpu_refresh_math.py's training-like loop beside refresh threads on
#           partitions of $GREEN_SMS (default: 0 16 32; 0 is a plain stream) with $GREEN_THREADS threads (default: 1 2
#           4: one eigh leaves the GPU mostly idle, so concurrent ones may multiply the lane's rate), at training
#           priorities 0 and -1; then olmo-160m at 8 x 1024 for each variant in $GREEN_RUNS (default: plain prio
#           prio-t4; parts joined by "-": smsN is --device-sms N, shareX --device-share X (the lane's cap, a share
#           of the interval), tN --device-threads N, prio --stream-priority -1, nolate --no-late-activation,
#           which drops the wait of step() for the backward pass's end, a bubble where the host queues the
#           optimizer's step more slowly than the GPU ends the backward; nolane --no-device-refresh: the floor
#           with the workers alone, refreshes dropped; inproc --no-device-process: the lane's math in the training
#           process, as before it had a process of its own), $GREEN_CONFIGS ($GREEN_STEPS,
#           default 150; about 1.5 minutes a variant). On the loop, priority -1 with 4 threads cost training the least
#           per block; on olmo-160m no variant did much (results.md, "The lane beside training"): there the interval
#           profile's "host CPU" line against its "host queued" one says whether the training thread sleeps (the GIL,
#           a lock) or computes in the lane-busy positions (CUDA's spinning waits count as CPU: the late-activation
#           line gives step()'s).
# $EXTRA_ARGS go to every bench (e.g. --device-share 0.25); $TAG names this call's run folders. BLAS=own unsets
# OPENBLAS_CORETYPE (the device tool's environment sets Haswell), so that the workers run the kernels asteria names
# from the CPU's flags; device.txt records which ran. DRY_RUN=1 prints each command instead of running it
# (tests/test_session_script.py checks them against the CLI's parsers).
# $DEADLINE_S (seconds from the script's start; set it below the call's limit) ends each bench in time to pack what
# it measured: a bench gets the seconds left less $PACK_S (default 30), is asked to stop after its step in progress
# when they run out (SIGINT; its finished configs keep their metrics.jsonl), and is not started with fewer than
# $MIN_RUN_S (default 90) left. Without it, a call cut off at its limit brings back nothing of the bench it was in.
# Logs and results land in $OUT (the device tool's folder) as one tarball per stage, tables in the log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/executor-session}
STAGES=${STAGES:-"build cuda small"}
START=$(date +%s)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
has() { [[ " $STAGES " == *" $1 "* ]]; }
KNOWN="build cuda small large 1b profile math syev contention dims sweep first soapgap workers seeds phases hb green"
for stage in $STAGES; do
  [[ " $KNOWN " == *" $stage "* ]] || { echo "Invalid STAGES entry '$stage': the stages are $KNOWN" >&2; exit 2; }
done
quiet() { tr '\r' '\n' | grep -av "it/s\|s/it\|USDT"; }
dry() { [[ ${DRY_RUN:-0} == 1 ]]; }
run() { if dry; then echo "$*"; else "$@"; fi; }  # a command, or with DRY_RUN=1 its line
[[ ${BLAS:-} == own ]] && unset OPENBLAS_CORETYPE
if ! dry; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
  lscpu | grep -E "Model name|^CPU\(s\)" | tee -a "$OUT/device.txt"
  echo "OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}" | tee -a "$OUT/device.txt"
fi
if has build; then
  run python3 -m pip install -q --no-build-isolation --no-deps . 2>&1 | tail -2
  if compgen -G ".peers/wheels/*.whl" >/dev/null; then
    run python3 -m pip install -q --no-deps .peers/wheels/*.whl 2>&1 | tail -2
  fi
fi
dry || python3 -c "from asteria import _core; print('OpenBLAS kernels:', _core.blas_core())" 2>&1 | tail -1 \
  | tee -a "$OUT/device.txt"
if has cuda; then
  # (written as it runs, so that a call cut off at its limit still brings back how far it got; a test that
  # hangs prints every thread's stack after 120 s)
  run python3 -m pytest -v -x -p no:cacheprovider -o faulthandler_timeout=120 --durations=15 tests/test_cuda.py \
    tests/test_cuda_tiers.py tests/test_meters.py tests/test_pager.py tests/test_lane_segments.py \
    tests/test_lane_seed.py tests/test_step_memory.py tests/distributed/test_cuda_distributed.py \
    > "$OUT/cuda.txt" 2>&1
  tail -25 "$OUT/cuda.txt"
  summary=$(grep -E "^=+ .* in [0-9.]+s" "$OUT/cuda.txt" | tail -1)  # (-v names tests with "error" in them)
  if ! dry && ! [[ $summary == *" passed"* && $summary != *failed* && $summary != *error* ]]; then
    echo "CUDA tests failed"
    exit 1
  fi
fi
CLI="python3 -m asteria.train.cli"
COMMON="--precondition-frequency 10 --matmul-precision high --eval-every 100 --eval-batches 8 --peer-path .peers"
seconds_left() { echo $(( ${DEADLINE_S:-1000000} - ($(date +%s) - START) - ${PACK_S:-30} )); }
bench() {  # name, model, batch, steps, configs
  local name=$1${TAG:-} model=$2 batch=$3 steps=$4 left; shift 4
  left=$(seconds_left)
  if (( left < ${MIN_RUN_S:-90} )); then
    echo "$name: not started ($left s left before DEADLINE_S)" >&2
    return
  fi
  if dry; then
    echo $CLI bench --model "$model" --batch-size "$batch" --seq-len 1024 --steps "$steps" $COMMON ${EXTRA_ARGS:-} \
      ${STAGE_ARGS:-} --configs "$@" --out "runs/$name"
    return
  fi
  timeout -s INT -k 15 "$left" \
    $CLI bench --model "$model" --batch-size "$batch" --seq-len 1024 --steps "$steps" $COMMON ${EXTRA_ARGS:-} \
    ${STAGE_ARGS:-} --configs "$@" --out "runs/$name" 2>&1 | quiet | grep -v "^\s*$" | tail -40 | tee "$OUT/$name.txt"
  tar -czf "$OUT/$name.tgz" -C runs "$name" --exclude="*.pt" --exclude="checkpoints" 2>/dev/null
}
has small && bench small olmo-160m 8 "${SMALL_STEPS:-200}" \
  ${SMALL_CONFIGS:-adamw shampoo-async soap-async kl-shampoo-async shampoo-sync ds-shampoo}
has large && bench large olmo-160m 32 "${LARGE_STEPS:-150}" \
  ${LARGE_CONFIGS:-adamw shampoo-async soap-async kl-shampoo-async ds-shampoo}
# olmo2-1b fills an 80 GB card: its runs take the allocator's expandable segments unless the caller sets the allocator
# (docs/results.md, "olmo2-1b on an 80 GB H100")
has 1b && (export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
           bench 1b olmo2-1b 16 "${ONEB_STEPS:-80}" ${ONEB_CONFIGS:-adamw soap-async shampoo-async kl-shampoo-async})
if has profile; then
  (export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}  # (as the 1b stage)
   for config in ${PROFILE_CONFIGS:-adamw shampoo-sync soap-sync kl-shampoo-sync}; do
     left=$(seconds_left)
     if (( left < ${MIN_RUN_S:-90} )); then
       echo "profile $config: not started ($left s left before DEADLINE_S)" >&2
       continue
     fi
     run timeout -s INT -k 15 "$left" python3 bench/profile_step.py --model "${PROFILE_MODEL:-olmo2-1b}" \
       --batch-size "${PROFILE_BATCH:-16}" --seq-len 1024 --steps "${PROFILE_STEPS:-4}" --trace-steps 2 \
       --profile-steps 2 --top 14 --configs "$config:tf32=1" --out "runs/profile/$config" 2>&1 | quiet \
       | tee -a "$OUT/profile.txt"
   done)
  dry || tar -czf "$OUT/profile.tgz" -C runs profile 2>/dev/null
fi
if has dims; then
  for dim in ${DIMS:-1024 2048}; do
    STAGE_ARGS="--max-preconditioner-dim $dim" bench "dims-$dim" olmo-160m 8 "${DIMS_STEPS:-300}" \
      ${DIMS_CONFIGS:-adamw shampoo-async shampoo-sync soap-async ds-shampoo}
  done
fi
if has sweep; then
  for beta2 in ${BETA2S:-0.95 0.999}; do
    for schedule in ${SCHEDULES:-cosine constant}; do
      STAGE_ARGS="--beta2 $beta2 --lr-schedule $schedule" bench "sweep-$beta2-$schedule" olmo-160m "${SWEEP_BATCH:-8}" \
        "${SWEEP_STEPS:-300}" ${SWEEP_CONFIGS:-adamw shampoo-async shampoo-sync}
    done
  done
fi
if has first; then
  for seed in ${FIRST_SEEDS:-0 1}; do
    STAGE_ARGS="--precondition-frequency ${FIRST_F:-50} --seed $seed" bench "first-eigh-s$seed" olmo-160m 8 \
      "${FIRST_STEPS:-300}" soap-async ds-soap
    STAGE_ARGS="--precondition-frequency ${FIRST_F:-50} --seed $seed --first-basis qr" bench "first-qr-s$seed" \
      olmo-160m 8 "${FIRST_STEPS:-300}" soap-async
  done
fi
if has soapgap; then
  STAGE_ARGS="--precondition-frequency ${FIRST_F:-50}" bench soapgap olmo-160m 8 "${FIRST_STEPS:-300}" \
    adamw soap-sync soap-async ds-soap
  STAGE_ARGS="--precondition-frequency ${FIRST_F:-50} --precondition-1d" bench soapgap-1d olmo-160m 8 \
    "${FIRST_STEPS:-300}" soap-async
fi
if has workers; then
  for count in ${WORKER_COUNTS:-6 10 14}; do
    STAGE_ARGS="--workers $count" bench "workers-$count" olmo-160m 8 "${WORKERS_STEPS:-150}" \
      ${WORKERS_CONFIGS:-adamw shampoo-async soap-async}
  done
  bench workers-native olmo-160m 8 "${WORKERS_STEPS:-150}" ${WORKERS_NATIVE:-adamw shampoo-sync soap-sync}
fi
if has seeds; then
  for seed in ${SEEDS:-0 1 2}; do
    STAGE_ARGS="--seed $seed --deterministic-kernels" bench "seeds-s$seed" olmo-160m "${SEEDS_BATCH:-8}" \
      "${SEEDS_STEPS:-300}" \
      ${SEEDS_CONFIGS:-shampoo-async shampoo-sync soap-async soap-sync kl-shampoo-async kl-shampoo-sync}
  done
fi
if has phases; then
  run g++ -O3 -march=native -std=c++20 bench/eigh_variants.cpp -I cpp cpp/asteria/linalg/lapack.cpp \
    cpp/asteria/linalg/inverse_root.cpp cpp/asteria/common/errors.cpp -lopenblas -lpthread -o /tmp/eigh_variants
  for cap in ${PHASES_SIMD:-widest}; do
    simd=(); [[ $cap == widest ]] || simd=(ASTERIA_MAX_SIMD="$cap")
    for threads in ${PHASES_THREADS:-1 16}; do
      echo "phases: $cap vector kernels, $threads threads" | tee -a "$OUT/phases.txt"
      OPENBLAS_CORETYPE=SkylakeX run env "${simd[@]}" /tmp/eigh_variants $((threads == 1 ? 8 : 48)) "$threads" \
        2048 2>&1 | tee -a "$OUT/phases.txt"
    done
  done
fi
has hb && bench hb olmo-160m 8 "${HB_STEPS:-150}" ${HB_CONFIGS:-adamw hb-soap hb-kl-shampoo soap-async kl-shampoo-async}
if has green; then
  if [[ ${GREEN_MATH:-1} == 1 ]]; then
    for priority in 0 -1; do
      run python3 bench/gpu_refresh_math.py --no-methods-table --green-sms ${GREEN_SMS:-0 16 32} \
        --lane-threads ${GREEN_THREADS:-1 2 4} \
        --interference-methods eigh power_qr --train-priority "$priority" --out "$OUT/green-math$priority.json" \
        2>&1 | tail -24 | tee -a "$OUT/green-math.txt"
    done
  fi
  for variant in ${GREEN_RUNS:-plain prio prio-t4}; do
    args=""
    for part in ${variant//-/ }; do
      case $part in
        prio) args="$args --stream-priority -1" ;;
        sms*) args="$args --device-sms ${part#sms}" ;;
        share*) args="$args --device-share ${part#share}" ;;
        t*) args="$args --device-threads ${part#t}" ;;
        nolate) args="$args --no-late-activation" ;;
        nolane) args="$args --no-device-refresh" ;;
        inproc) args="$args --no-device-process" ;;
      esac
    done
    STAGE_ARGS="$args" bench "green-$variant" olmo-160m 8 "${GREEN_STEPS:-150}" \
      ${GREEN_CONFIGS:-adamw shampoo-async soap-async}
  done
fi
if has contention; then  # launch-bound, then GPU-bound training chains beside each side
  run python3 bench/launch_contention.py 2>&1 | tee "$OUT/contention.txt"
  run python3 bench/launch_contention.py --big 100 --sides none eigh eigh-process qr qr-process newton none 2>&1 \
    | tee -a "$OUT/contention.txt"
fi
has math && run python3 bench/gpu_refresh_math.py --sizes 768 2048 --batches 8 --out "$OUT/gpu_refresh_math.json" 2>&1 \
  | tail -12 | tee "$OUT/math.txt"
has syev && run python3 bench/gpu_syev_batched.py --out "$OUT/syev_batched.json" 2>&1 | tail -30 | tee "$OUT/syev.txt"
exit 0
