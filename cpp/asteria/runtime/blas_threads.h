// Control of the BLAS library's own threading, per calling thread where the library allows it.
#pragma once

namespace asteria::runtime {

// Sets the number of threads BLAS/LAPACK calls use. OpenBLAS keeps one global setting; the worker
// pool sets it once per worker start, always to the same value, so the calls are idempotent.
void set_blas_threads(int threads);

// The current setting as the BLAS library reports it.
int blas_threads();

// The CPU kernel family the BLAS library dispatches to (e.g. "SkylakeX", "Haswell"). A generic
// family such as "Prescott" on a modern CPU means the library did not recognise it and runs slow
// kernels; OPENBLAS_CORETYPE set before the library loads overrides the choice.
const char* blas_core();

}  // namespace asteria::runtime
