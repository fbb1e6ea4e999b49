#!/usr/bin/env bash
# Two batches of bench/gpu_session.sh side by side on a 2-GPU machine: the package is built once, then
# batch A runs on GPU 0 and the first half of this process's CPUs, batch B on GPU 1 and the second half
# (each batch's refresh workers then default to its half). Each batch is a line of shell that sets and
# exports that batch's variables (STAGES, LONG_ARGS, SWEEP_ARGS, ...: see gpu_session.sh).
# Usage: OUT=runs/pair bash bench/gpu_pair.sh 'export STAGES="long"' 'export STAGES="sweep"'
# Logs and results land in $OUT/a and $OUT/b (with PACK=1: in $OUT/results.tgz). BUDGET_S (default 540)
# bounds each batch's seconds, so that the packing still runs inside the device tool's 600 s per call: a
# batch cut short keeps what it finished (its session.log says where it stopped).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-pair}
mkdir -p "$OUT/a" "$OUT/b"
ECHO=""; [[ ${DRY_RUN:-0} == 1 ]] && ECHO=echo  # (DRY_RUN=1: each batch's session.log holds its commands)
$ECHO python3 -m pip install -q --no-build-isolation --no-deps . 2>&1 | tail -2
read -r FIRST SECOND < <(python3 -c "import os; c = sorted(os.sched_getaffinity(0)); h = len(c) // 2
print(','.join(map(str, c[:h])), ','.join(map(str, c[h:])))")
BUDGET_S=${BUDGET_S:-540}
( eval "$1"; export OUT="$OUT/a" CUDA_VISIBLE_DEVICES=0
  exec timeout -k 5 "$BUDGET_S" taskset -c "$FIRST" bash bench/gpu_session.sh ) > "$OUT/a/session.log" 2>&1 &
A=$!
( eval "$2"; export OUT="$OUT/b" CUDA_VISIBLE_DEVICES=1
  exec timeout -k 5 "$BUDGET_S" taskset -c "$SECOND" bash bench/gpu_session.sh ) > "$OUT/b/session.log" 2>&1 &
B=$!
for half in a b; do
  pid=$A; [[ $half == b ]] && pid=$B
  wait "$pid"; rc=$?
  if [[ $rc == 124 || $rc == 137 ]]; then
    echo "batch $half stopped after BUDGET_S=$BUDGET_S s (exit $rc); what it finished is kept" | tee -a "$OUT/$half/session.log"
  fi
done
# PACK=1: one archive instead of many files (the device tool returns a limited number of files); the
# TensorBoard logs stay behind (the per-step metrics.jsonl, a few hundred KB, travel: loss curves), the
# traces travel beside the archive.
if [[ "${PACK:-0}" == 1 ]]; then
  find "$OUT/a" "$OUT/b" -name tensorboard -prune -exec rm -rf {} +
  find "$OUT/a" "$OUT/b" -name 'trace-*.json.gz' -exec mv {} "$OUT/" \;
  tar czf "$OUT/results.tgz" -C "$OUT" a b && rm -rf "$OUT/a" "$OUT/b"
fi
