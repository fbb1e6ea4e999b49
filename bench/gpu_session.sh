#!/usr/bin/env bash
# One batch of GPU-machine work (the device tool gives short leases). Stages, chosen by $STAGES
# (default: all but scaling): build, cuda (the CUDA tests), memory (bench/memory.py --compare), bench
# (asteria bench on olmo-160m), ladder (bench/memory.py --ladder), refresh (refresh-engine benchmark);
# scaling (bench/scaling.py: torchrun on 1 and 2 GPUs, DDP and FSDP2; needs a 2-GPU machine) only when named.
# Logs and JSON land in $OUT (default: runs/gpu-session).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-session}
STAGES=${STAGES:-"build cuda memory bench ladder refresh"}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
has() { [[ " $STAGES " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a "$OUT/device.txt"
has build && python3 -m pip install -q --no-build-isolation --no-deps . 2>&1 | tail -2
has cuda && python3 -m pytest -q -p no:warnings tests/test_cuda.py tests/test_cuda_tiers.py tests/test_pager.py \
  2>&1 | tail -25 | tee "$OUT/pytest.txt"
has memory && python3 bench/memory.py --compare --model olmo-660m --out "$OUT" 2>&1 | tee "$OUT/memory.txt"
has bench && python3 -m asteria.train.cli bench --model olmo-160m --steps 60 --batch-size 8 --seq-len 512 \
  --precondition-frequency 10 --staleness 5 --eval-every 60 --out "$OUT/bench" 2>&1 | grep -v "it/s" \
  | tee "$OUT/bench.txt"
has ladder && python3 bench/memory.py --ladder --cap-gib 24 --out "$OUT/ladder" 2>&1 | tee "$OUT/ladder.txt"
has scaling && python3 bench/scaling.py --out "$OUT/scaling" --nprocs 1 2 --parallel ddp fsdp --model olmo-160m \
  --steps 60 --batch-size 8 --seq-len 512 2>&1 | tee "$OUT/scaling.txt"
has refresh && python3 bench/refresh_engine.py --sizes 1024 2048 --blocks 64 32 --out "$OUT/refresh_engine.json" \
  2>&1 | tee "$OUT/refresh_engine.txt"
exit 0
