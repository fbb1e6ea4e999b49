#!/usr/bin/env bash
# Sets up the machine and runs the demo: a small byte-level decoder trained with AdamW and with
# Asteria Shampoo (async), then a report (runs/demo/report.md, loss.png, step_time.png, TensorBoard).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh  # without the test packages
ASTERIA_PYTHON_QUIET=1 source scripts/python_env.sh  # PY: the interpreter that setup.sh installed into
"$PY" -m asteria.train.cli demo --out runs/demo --steps 300 --precondition-frequency 20 "$@"
