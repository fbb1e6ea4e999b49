#!/usr/bin/env bash
# Installs everything Asteria needs on a fresh Debian machine with Python 3.10+ and builds the
# package. Safe to run again: steps that are already done cost seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
DEBIAN_PACKAGES="libopenblas-dev liblapacke-dev libgtest-dev cmake ninja-build g++"
if ! dpkg -s $DEBIAN_PACKAGES >/dev/null 2>&1; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $DEBIAN_PACKAGES >/dev/null
fi

PY=${PYTHON:-python3}
# torch first and pinned: an unpinned range would pull a CUDA build of several GB.
if ! $PY -c "import torch, sys; sys.exit(tuple(map(int, torch.__version__.split('.')[:2])) < (2, 8))" 2>/dev/null; then
  $PY -m pip install -q torch==2.13.0
fi
$PY -m pip install -q "nanobind>=2.4" "scikit-build-core>=0.10" numpy tqdm matplotlib tensorboard "transformers>=4.48" \
  "pytest>=8" hypothesis
# The fuzz target prefers atheris (libFuzzer); without a wheel for this Python it falls back to hypothesis.
$PY -m pip install -q atheris 2>/dev/null || echo "setup: atheris unavailable, fuzzing uses hypothesis"
# No build isolation: an isolated build environment would download torch again.
$PY -m pip install -q --no-build-isolation --no-deps .
