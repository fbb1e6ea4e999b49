#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the wheels that the training CLI needs beyond torch and numpy,
# for Python 3.12 on manylinux x86_64 (29 MB): for a GPU machine without network. Carry `.whl` and
# start the command there with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
# (or, into an environment of its own: python3 -m pip install --no-index --find-links .whl transformers).
# The project's device image already holds transformers, tokenizers, safetensors, huggingface-hub,
# tqdm, matplotlib, tensorboard and nvidia-ml-py; carry these wheels only where a machine lacks them.
# Usage: bash scripts/wheels.sh [PACKAGE==VERSION ...]   (default: transformers and its own needs)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh  # PY: the interpreter (pip download needs pip, which .venv has)
DEST=.whl
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
           manylinux1_x86_64)
# transformers' requirements minus torch and numpy (never carried: the GPU machine has its own builds).
DEFAULT=(transformers tokenizers safetensors huggingface-hub hf-xet regex pyyaml packaging filelock fsspec tqdm
         typer typing-extensions click shellingham rich markdown-it-py mdurl pygments annotated-doc httpcore2 truststore
         h11 anyio idna certifi sniffio httpx2 pydantic pydantic-core annotated-types typing-inspection)
PACKAGES=("${@:-${DEFAULT[@]}}")
mkdir -p "$DEST"
args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d "$DEST")
for platform in "${PLATFORMS[@]}"; do args+=(--platform "$platform"); done
for package in "${PACKAGES[@]}"; do
  $PY -m pip download -q "${args[@]}" "$package" || { echo "wheels: no wheel for $package" >&2; exit 1; }
done
size=$(du -sm "$DEST" | cut -f1)
echo "wheels: $(ls "$DEST" | wc -l) files, ${size} MB in $DEST"
if [ "$size" -gt 50 ]; then echo "wheels: over 50 MB; carry fewer packages" >&2; exit 1; fi
