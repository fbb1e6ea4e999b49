#!/usr/bin/env bash
# Whether CUDA MPS (the Multi-Process Service) lets the device lane's process share the GPU with training instead of
# taking turns with it (without MPS two processes' contexts time-slice the GPU: asteria.pipeline.lane_process). One
# device call: asteria bench on olmo-160m at 8 x 1024 ($CFG, $N steps) as the executor session's `small` stage runs
# it, then the same under a private MPS daemon (its pipe and log directories under /tmp, so that only this call's
# processes are its clients), which is stopped at the end. docs/results.md, "The lane in a process of its own", has
# what it measured. $D1 / $D2: the seconds from the start by which each bench must end (DEADLINE_S).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/mps}
mkdir -p "$OUT"
S=$(date +%s)
which nvidia-cuda-mps-control nvidia-cuda-mps-server 2>&1 | tee "$OUT/mps-bin.txt"
nvidia-smi --query-gpu=name,compute_mode,memory.total --format=csv,noheader | tee -a "$OUT/mps-bin.txt"
CFG=${CFG:-"adamw shampoo-async soap-async"}
N=${N:-80}
session() {  # the executor session's log, less its per-step lines
  bash bench/executor_session.sh 2>&1 | grep -v "^\s*\(host\|in step\|core wait\|sleeps\)" | tail -45
}
BLAS=own STAGES="build small" SMALL_CONFIGS="$CFG" SMALL_STEPS=$N DEADLINE_S=${D1:-250} PACK_S=10 MIN_RUN_S=60 session
echo "== elapsed $(( $(date +%s) - S )) s; starting MPS"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
if nvidia-cuda-mps-control -d; then
  trap 'echo quit | nvidia-cuda-mps-control; sleep 1' EXIT
  python3 -c "import torch; torch.ones(1, device='cuda'); print('client ok')"
  echo get_server_list | nvidia-cuda-mps-control
  BLAS=own STAGES=small TAG=-mps SMALL_CONFIGS="$CFG" SMALL_STEPS=$N DEADLINE_S=$(( ${D2:-470} - ($(date +%s) - S) )) \
    PACK_S=10 MIN_RUN_S=60 session
  echo get_server_list | nvidia-cuda-mps-control
  tail -n 12 "$CUDA_MPS_LOG_DIRECTORY/control.log" "$CUDA_MPS_LOG_DIRECTORY/server.log" 2>/dev/null
  cp -r "$CUDA_MPS_LOG_DIRECTORY" "$OUT/mps-log" 2>/dev/null
else
  echo "MPS daemon did not start"
fi
echo "== elapsed $(( $(date +%s) - S )) s"
