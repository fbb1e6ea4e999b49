#!/usr/bin/env bash
# Sets up the machine (scripts/setup.sh) and runs every test: the C++ core's GoogleTest suite in a
# plain build and under AddressSanitizer+UBSan and ThreadSanitizer, then the Python suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
ASTERIA_PYTHON_QUIET=1 source scripts/python_env.sh  # PY: the interpreter that setup.sh installed into

jobs=$(nproc)
for variant in plain address thread; do
  dir=build/cpp-$variant
  sanitize=$([ "$variant" = plain ] && echo "" || echo "$variant")
  cmake -S . -B "$dir" -G Ninja -DASTERIA_BUILD_PYTHON=OFF -DASTERIA_BUILD_TESTS=ON \
        -DCMAKE_BUILD_TYPE=RelWithDebInfo -DASTERIA_SANITIZE="$sanitize" >/dev/null
  cmake --build "$dir" -j "$jobs" >/dev/null
  echo "== C++ tests ($variant)"
  # The core runs BLAS at one thread per worker (OPENBLAS_NUM_THREADS=1 gives the tests that call
  # the numerics directly the same setting; OpenBLAS's own thread pool trips TSan on its internal
  # memsets). TSan needs the default address-space layout; ASan must not stop on OpenBLAS's leaks.
  OPENBLAS_NUM_THREADS=1 ASAN_OPTIONS=detect_leaks=0 TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
    setarch "$(uname -m)" -R ctest --test-dir "$dir" --output-on-failure -j "$jobs"
done

bash scripts/fuzz.sh 30  # the NVMe page-header parser under libFuzzer (or the gcc driver), 30 s
echo "== Fuzzing the checkpoint manifest parser (20 s)"
"$PY" fuzz/checkpoint_manifest_fuzz.py --seconds 20

echo "== Python tests"
"$PY" -m pytest -q tests
