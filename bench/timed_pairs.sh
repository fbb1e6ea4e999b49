#!/usr/bin/env bash
# Issue 5's Shampoo loss series in the timed configuration, filled into short device calls. Per seed:
# native Shampoo (sync) into $OUT/s<seed>/na, then Asteria Shampoo as the bench times it (the
# newest-finished rule, S = 5, staggered) into $OUT/s<seed>/nf, both through bench/loss_arms.sh with strict
# deterministic kernels and one run at a time: the Asteria arm's versions come when its workers finish,
# so nothing may share the GPU or the host with it. A run starts only when its estimate fits before
# BUDGET_S seconds: native NA_S, Asteria NF_S; a native run starts only when its Asteria arm fits too,
# unless it is the call's last use of the time (then the next call, with the same OUT, runs the Asteria arm).
# Arms whose seeds.json exists are skipped, so a call can pick up where the last one stopped.
# Usage: OUT=DIR BUDGET_S=560 bash bench/timed_pairs.sh SEEDS... (DRY_RUN=1: each seed's log holds the commands)
# Pool: python3 tools/seeds.py gather DIR/s*/nf --baseline DIR/s*/na --out DIR/report
set -uo pipefail
cd "$(dirname "$0")/.."
ECHO=""; [[ ${DRY_RUN:-0} == 1 ]] && ECHO=echo
: "${OUT:?set OUT}"
BUDGET_S=${BUDGET_S:-100000} NA_S=${NA_S:-135} NF_S=${NF_S:-95}
START=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
arm() {  # arm SEED FOLDER CONFIG: one bench run of CONFIG into $OUT/s<SEED>/FOLDER
  local t0; t0=$(date +%s)
  OUT="$OUT/s$1" ARM="$2" NA_CONFIGS="$3" LAGS=" " ARGS="--deterministic-kernels ${ARGS:-}" \
    bash bench/loss_arms.sh "$1" >>"$OUT/s$1/log.txt" 2>&1
  echo "seed $1 $2: exit $? in $(( $(date +%s) - t0 )) s, $(left) s left"
}
for seed in "$@"; do
  mkdir -p "$OUT/s$seed"
  if [[ ! -f "$OUT/s$seed/na/seeds.json" ]]; then
    (( $(left) >= NA_S + NF_S )) || { (( $(left) >= NA_S )) && arm "$seed" na shampoo-sync; break; }
    arm "$seed" na shampoo-sync
    [[ -f "$OUT/s$seed/na/seeds.json" || -n $ECHO ]] || continue
  fi
  if [[ ! -f "$OUT/s$seed/nf/seeds.json" ]]; then
    (( $(left) >= NF_S )) || break
    arm "$seed" nf shampoo-async
  fi
done
shopt -s nullglob
asteria_arms=("$OUT"/s*/nf) native_arms=("$OUT"/s*/na)
if (( ${#asteria_arms[@]} && ${#native_arms[@]} )); then
  $ECHO python3 tools/seeds.py gather "${asteria_arms[@]}" --baseline "${native_arms[@]}" --out "$OUT/report" | tail -4
fi
