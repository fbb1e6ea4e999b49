// The one LAPACK/BLAS shim of the core: typed templates dispatching to the s/d routines of the
// Fortran interface that OpenBLAS exports. Every call queries its workspace first where LAPACK
// has a query, checks `info` afterwards and throws NumericalError naming the routine.
// Matrices are column-major; a symmetric matrix reads the same either way.
#pragma once

#include <cstdint>
#include <vector>

namespace asteria::linalg {

// Symmetric eigendecomposition in place (xSYEVD, divide and conquer): on return `a` (n x n, lda)
// holds the orthonormal eigenvectors as columns and `w` (n) the eigenvalues in ascending order.
// `work`/`iwork` are grown as needed and may be reused across calls (one per thread). Nothing past
// a's last element is read: the BLAS kernels that would read there (lapack.cpp) get a copy.
// Throws NumericalError("[syevd] ssyevd failed, info=...") on failure.
template <typename T>
void syevd(int n, T* a, int lda, T* w, std::vector<T>& work, std::vector<int>& iwork);

// The same contract as syevd, computed faster for the core's inverse roots (bench/eigh_variants.cpp
// measures it): a Householder tridiagonalization with the xSYTRD algorithm but in-house BLAS-2
// steps (OpenBLAS serializes concurrent ?symv/?gemv calls on a lock), xSTEDC('I') for the
// eigenvectors Z of the tridiagonal matrix, then Q Z formed here rather than by xORMTR: the
// reflectors grouped 64 wide and applied through gemm to 256-column slices of Z, one
// cache-resident slice at a time. `work` grows to about 1.5 n^2 entries.
// Throws NumericalError("[eigh] sstedc failed, info=... (n=...)") on failure.
template <typename T>
void eigh(int n, T* a, int lda, T* w, std::vector<T>& work, std::vector<int>& iwork);

// c = alpha * a * a^T + beta * c on the lower triangle (xSYRK, 'L', 'N'); a is n x k.
template <typename T>
void syrk_lower(int n, int k, T alpha, const T* a, int lda, T beta, T* c, int ldc);

// c = alpha * op(a) * op(b) + beta * c (xGEMM); op is a transpose when the flag is set.
template <typename T>
void gemm(bool trans_a, bool trans_b, int m, int n, int k, T alpha, const T* a, int lda, const T* b, int ldb,
          T beta, T* c, int ldc);

// Copies the lower triangle of the n x n matrix `a` onto its upper triangle.
template <typename T>
void symmetrize_from_lower(int n, T* a, int lda);

// The vector kernels of the in-house steps ("avx512", "avx2" or "baseline"), as simd.h picks them: the widest the
// CPU runs, at most what ASTERIA_MAX_SIMD names. Throws InvalidArgument for a value of it that names none.
const char* simd_kernels();

}  // namespace asteria::linalg
