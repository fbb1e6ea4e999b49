#!/usr/bin/env bash
# Native against Asteria on many seeds at once, on one GPU. With torch's deterministic kernels held
# strictly (--deterministic-kernels) and the deterministic install rule (--lag-steps), a run's losses do
# not depend on its timing: neither on the runs beside it on the GPU nor on how fast its workers are
# (checked on the CPU: same bits with 1 worker and with all, run side by side). So seeds can share the
# machine. Each seed runs bench/loss_arms.sh (native, then Asteria at lag $LAG) into $OUT/s<seed>;
# $JOBS seeds run at a time; no seed starts after $DEADLINE_S seconds (a lease's call is short).
# Usage: OUT=DIR OPT=shampoo LAG=2 JOBS=3 DEADLINE_S=400 bash bench/loss_pairs.sh SEEDS...
# NA=0 runs only the Asteria arm (for seeds whose native arm exists in $OUT).
# DRY_RUN=1: each seed's log holds the commands its arms would run.
# At the end the seeds with both arms are pooled into $OUT/report (seeds.md): Asteria against native,
# paired by seed. Seeds of several calls pool the same way: python3 tools/seeds.py gather DIR/s*/d2 --baseline
# DIR/s*/na --out REPORT.
set -uo pipefail
cd "$(dirname "$0")/.."
ECHO=""; [[ ${DRY_RUN:-0} == 1 ]] && ECHO=echo
: "${OUT:?set OUT}"
export OPT=${OPT:-shampoo} LAG=${LAG:-2} START=$(date +%s) DEADLINE_S=${DEADLINE_S:-100000}
export ARGS="--deterministic-kernels ${ARGS:-}"
one_seed() {
  if (( $(date +%s) - START >= DEADLINE_S )); then echo "seed $1: not started (deadline)"; return 0; fi
  mkdir -p "$OUT/s$1"
  OUT="$OUT/s$1" NA_CONFIGS="$OPT-sync" LAGS="$LAG" bash bench/loss_arms.sh "$1" >>"$OUT/s$1/log.txt" 2>&1
  echo "seed $1: exit $? after $(( $(date +%s) - START )) s"
}
export -f one_seed
export OUT
printf '%s\n' "$@" | xargs -P "${JOBS:-3}" -I{} bash -c 'one_seed {}'
shopt -s nullglob
asteria_arms=("$OUT"/s*/d"$LAG") native_arms=("$OUT"/s*/na)
if (( ${#asteria_arms[@]} && ${#native_arms[@]} )); then
  $ECHO python3 tools/seeds.py gather "${asteria_arms[@]}" --baseline "${native_arms[@]}" --out "$OUT/report" | tail -4
fi
