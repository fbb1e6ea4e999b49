#!/usr/bin/env bash
# Where Asteria's loss gap to native mode comes from: one optimizer on olmo-160m (issue 5's settings,
# 250 steps), per seed in three arms side by side, each a separate `asteria bench` over the seeds
# (tools/seeds.py run):
#   na/  native (sync) and Asteria with the newest-finished rule (--no-deterministic, the default bench);
#   d<L>/ Asteria under the deterministic rule with --lag-steps L for each L in $LAGS (default 0: every
#        version computed by the workers and used at its own step, as native mode does).
# Native against d0 isolates where the arithmetic runs (GPU or CPU, float32 in both since native refreshes
# ignore TF32): at lag 0 the schedule is native's, unstaggered (before the nineteenth session d0 was
# staggered too); d0 against the newest-finished rule isolates how late the versions come and the stagger.
# Pool the seeds with `python3 tools/seeds.py gather OUT/na ...`, and compare d0 with native through
# `python3 tools/seeds.py gather OUT/d0 --baseline OUT/na --out DIR`.
# Usage (inside bench/gpu_session.sh's `extra` stage, or alone): OUT=DIR OPT=kl-shampoo bash bench/loss_arms.sh SEEDS...
# LAGS=" " runs no d<L> arm; NA=0 skips the na arm (e.g. to add lag arms to seeds whose na arm exists);
# NA_CONFIGS="$OPT-async" runs the na arm without its native config; ARGS adds bench options to every arm
# (e.g. ARGS="--precondition-frequency 5"); ARM names the na arm's folder (default na).
# DRY_RUN=1 prints each command instead of running it (tests/test_bench_scripts.py parses them).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT}"
OPT=${OPT:-kl-shampoo}
SEEDS="python3 tools/seeds.py run"
[[ ${DRY_RUN:-0} == 1 ]] && SEEDS="echo $SEEDS"
COMMON="--model olmo-160m --batch-size 32 --seq-len 1024 --matmul-precision high --steps 250 --eval-every 250
  --eval-batches 16 --max-bytes 40000000 --max-preconditioner-dim 1024 ${ARGS:-}"
if [[ "${NA:-1}" != 0 ]]; then
  # shellcheck disable=SC2086
  $SEEDS $COMMON --no-deterministic --configs ${NA_CONFIGS:-"$OPT-sync" "$OPT-async"} --seeds "$@" \
    --out "$OUT/${ARM:-na}"
fi
for lag in ${LAGS:-0}; do
  # shellcheck disable=SC2086
  $SEEDS $COMMON --deterministic --lag-steps "$lag" --configs "$OPT-async" --seeds "$@" --out "$OUT/d$lag"
done
