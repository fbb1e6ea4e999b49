#!/usr/bin/env bash
# Installs everything Asteria needs on a fresh Debian machine and builds the package. Safe to run
# again: steps that are already done cost seconds.
#   bash scripts/setup.sh          what `import asteria` and the asteria command need (the demo)
#   bash scripts/setup.sh --test   also the test and fuzzing packages (scripts/test.sh)
# The interpreter comes from scripts/python_env.sh ($PYTHON, .venv or python3; a .venv where PEP 668
# forbids pip). One line per stage with its duration: a fresh machine takes minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  "") with_test=0 ;;
  --test) with_test=1 ;;
  *) echo "usage: bash scripts/setup.sh [--test]" >&2; exit 2 ;;
esac
started=$SECONDS
stage() { t0=$SECONDS; printf 'setup: %s ... ' "$1"; }
stage_done() { echo "${1:-ok} ($((SECONDS - t0)) s)"; }

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
DEBIAN_PACKAGES="libopenblas-dev liblapacke-dev libgtest-dev cmake ninja-build g++"
stage "Debian packages"
if dpkg -s $DEBIAN_PACKAGES >/dev/null 2>&1; then
  echo "already installed"
else
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $DEBIAN_PACKAGES >/dev/null
  stage_done
fi

source scripts/python_env.sh  # sets PY
pip() { "$PY" -m pip "$@"; }

# torch first and pinned: an unpinned range would pull a CUDA build of several GB. An installed
# torch >= 2.8 is kept (a GPU machine's own build, say). Without a GPU the CPU build (~200 MB) from
# PyTorch's index (TORCH_CPU_INDEX names a mirror) is enough; where that index is unreachable, PyPI's.
if "$PY" -c "import torch, sys; sys.exit(tuple(map(int, torch.__version__.split('.')[:2])) < (2, 8))" 2>/dev/null; then
  echo "setup: torch $("$PY" -c 'import torch; print(torch.__version__)') ... already installed"
elif command -v nvidia-smi >/dev/null 2>&1 || [ -e /dev/nvidia0 ]; then
  stage "torch 2.13.0 (GPU build, a few GB)"
  pip install -qq torch==2.13.0
  stage_done
else
  stage "torch 2.13.0 (cpu)"
  if pip install -qq --timeout 15 --retries 1 --index-url "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}" \
       torch==2.13.0 >/dev/null 2>&1; then
    stage_done
  else
    printf 'CPU index unreachable, PyPI build (with CUDA, a few GB) ... '
    pip install -qq torch==2.13.0
    stage_done
  fi
fi

# pyproject.toml's dependencies, its train extra and its build requirements (the build below runs
# without isolation: an isolated build environment would download torch again).
# tests/test_setup_scripts.py checks that these lists match pyproject.toml.
stage "numpy, transformers, tqdm, matplotlib, tensorboard, nanobind, scikit-build-core"
pip install -qq numpy "transformers>=4.48" tqdm matplotlib tensorboard "nanobind>=2.4" "scikit-build-core>=0.10"
stage_done

if [ $with_test = 1 ]; then  # the test and fuzz extras
  stage "pytest, hypothesis, heavyball, atheris"
  pip install -qq "pytest>=8" hypothesis
  # heavyball: the bench's peer (hb-soap, hb-kl-shampoo); without it its tests skip.
  pip install -qq heavyball >/dev/null 2>&1 || echo -n "(heavyball unavailable: its peer tests skip) "
  # The fuzz target prefers atheris (libFuzzer); without a wheel for this Python it falls back to hypothesis.
  if pip install -qq atheris >/dev/null 2>&1; then stage_done; else stage_done "ok, atheris unavailable: fuzzing uses hypothesis"; fi
fi

stage "building asteria (C++, about a minute on 2 cores when fresh)"
pip install -qq --no-build-isolation --no-deps .
stage_done "done"
echo "setup: ready in $((SECONDS - started)) s; python: $PY"
