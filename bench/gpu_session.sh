#!/usr/bin/env bash
# One batch of GPU-machine work (the device tool gives short leases): build, the whole pytest suite
# (its CUDA tests run there), the refresh-engine benchmark and the eigh-variant micro-benchmark.
# Logs and JSON land in $OUT (default: runs/gpu-session).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a "$OUT/device.txt"
python3 -m pip install -q --no-build-isolation --no-deps . 2>&1 | tail -2
python3 -m pytest -q -p no:warnings tests 2>&1 | tail -15 | tee "$OUT/pytest.txt"
g++ -O3 -march=native -std=c++20 bench/eigh_variants.cpp -I cpp cpp/asteria/linalg/lapack.cpp \
    cpp/asteria/linalg/inverse_root.cpp cpp/asteria/common/errors.cpp -lopenblas -lpthread -o /tmp/eigh_variants \
  && /tmp/eigh_variants 64 16 1024 2>&1 | tee "$OUT/eigh_variants.txt" \
  && /tmp/eigh_variants 32 16 2048 2>&1 | tee -a "$OUT/eigh_variants.txt"
python3 bench/refresh_engine.py --sizes 1024 2048 --blocks 64 32 --out "$OUT/refresh_engine.json" 2>&1 \
  | tee "$OUT/refresh_engine.txt"
python3 -m asteria.train.cli bench --model olmo-160m --steps 60 --batch-size 8 --seq-len 512 \
  --precondition-frequency 10 --staleness 5 --eval-every 60 --out "$OUT/bench" 2>&1 | grep -v "it/s" \
  | tee "$OUT/bench.txt"
