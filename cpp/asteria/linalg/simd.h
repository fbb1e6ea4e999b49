// Vector kernels of the in-house BLAS-2 steps (internal to the numerics' translation units). They are
// inline templates so that each caller's CPU-specific instantiation ([[gnu::target]]) gets its own code.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "asteria/common/errors.h"

namespace asteria::linalg::simd {

// GCC/Clang vector extensions; the kernels that use them (tridiagonalization, QR panels) compile
// them to AVX-512, AVX2 or the baseline (SSE2 on x86-64, NEON on aarch64).
template <typename T, int N>
struct VectorOf {
  typedef T type __attribute__((vector_size(N * sizeof(T))));
};
template <typename T, int N>
using Vector = typename VectorOf<T, N>::type;
template <typename T>
constexpr int kWide = 64 / static_cast<int>(sizeof(T));  // lanes of one 64-byte vector
template <typename T>
using Wide = Vector<T, kWide<T>>;
template <typename T>
using Quad = Vector<T, 4>;

// The vector registers' width of the instruction set this translation unit is compiled for (the
// baseline's where simd::widest_supported picks the wider kernels at run time).
#if defined(__AVX512F__)
constexpr int kRegisterBytes = 64;
#elif defined(__AVX__)
constexpr int kRegisterBytes = 32;
#else
constexpr int kRegisterBytes = 16;  // SSE2, NEON
#endif

template <typename V, typename T>
[[gnu::always_inline]] inline void load(V& v, const T* p) {
  std::memcpy(&v, p, sizeof v);
}
template <typename V, typename T>
[[gnu::always_inline]] inline void store(T* p, const V& v) {
  std::memcpy(p, &v, sizeof v);
}

// Adds the upper half of v's lanes onto the lower half.
template <typename V, typename H, std::size_t... I>
[[gnu::always_inline]] inline void fold(const V& v, H& half, std::index_sequence<I...>) {
  half = __builtin_shufflevector(v, v, I...) + __builtin_shufflevector(v, v, (I + sizeof...(I))...);
}
template <typename T, int N>
[[gnu::always_inline]] inline void fold_to_quad(const Vector<T, N>& v, Quad<T>& quad) {
  if constexpr (N == 4) {
    quad = v;
  } else {
    Vector<T, N / 2> half;
    fold(v, half, std::make_index_sequence<N / 2>{});
    fold_to_quad<T, N / 2>(half, quad);
  }
}
template <typename T>
[[gnu::always_inline]] inline T sum(const Quad<T>& q) {
  return (q[0] + q[2]) + (q[1] + q[3]);
}
// {sum(a), sum(b), sum(c), sum(d)} by a transposing butterfly: six shuffles and three adds.
template <typename T>
[[gnu::always_inline]] inline void sum4(const Quad<T>& a, const Quad<T>& b, const Quad<T>& c, const Quad<T>& d,
                                        Quad<T>& sums) {
  const Quad<T> ab = __builtin_shufflevector(a, b, 0, 4, 1, 5) + __builtin_shufflevector(a, b, 2, 6, 3, 7);
  const Quad<T> cd = __builtin_shufflevector(c, d, 0, 4, 1, 5) + __builtin_shufflevector(c, d, 2, 6, 3, 7);
  sums = __builtin_shufflevector(ab, cd, 0, 1, 4, 5) + __builtin_shufflevector(ab, cd, 2, 3, 6, 7);
}

// z += alpha * x + beta * y
template <typename T>
[[gnu::always_inline]] inline void axpy2(int n, T alpha, const T* x, T beta, const T* y, T* z) {
  constexpr int W = kWide<T>;
  const Wide<T> va = alpha - Wide<T>{}, vb = beta - Wide<T>{};
  int i = 0;
  for (; i + W <= n; i += W) {
    Wide<T> xi, yi, zi;
    load(xi, x + i);
    load(yi, y + i);
    load(zi, z + i);
    zi += va * xi + vb * yi;
    store(z + i, zi);
  }
  for (; i < n; ++i) z[i] += alpha * x[i] + beta * y[i];
}

// z = alpha * z + beta * x
template <typename T>
[[gnu::always_inline]] inline void scale_add(int n, T alpha, T* z, T beta, const T* x) {
  constexpr int W = kWide<T>;
  const Wide<T> va = alpha - Wide<T>{}, vb = beta - Wide<T>{};
  int i = 0;
  for (; i + W <= n; i += W) {
    Wide<T> xi, zi;
    load(xi, x + i);
    load(zi, z + i);
    zi = va * zi + vb * xi;
    store(z + i, zi);
  }
  for (; i < n; ++i) z[i] = alpha * z[i] + beta * x[i];
}

// x . y
template <typename T>
[[gnu::always_inline]] inline T dot(int n, const T* x, const T* y) {
  constexpr int W = kWide<T>;
  Wide<T> s = {};
  int i = 0;
  for (; i + W <= n; i += W) {
    Wide<T> xi, yi;
    load(xi, x + i);
    load(yi, y + i);
    s += xi * yi;
  }
  Quad<T> q;
  fold_to_quad<T, W>(s, q);
  T total = sum<T>(q);
  for (; i < n; ++i) total += x[i] * y[i];
  return total;
}

// (x . v, y . v)
template <typename T>
[[gnu::always_inline]] inline void dot2(int n, const T* x, const T* y, const T* v, T& xv, T& yv) {
  constexpr int W = kWide<T>;
  Wide<T> sx = {}, sy = {};
  int i = 0;
  for (; i + W <= n; i += W) {
    Wide<T> xi, yi, vi;
    load(xi, x + i);
    load(yi, y + i);
    load(vi, v + i);
    sx += xi * vi;
    sy += yi * vi;
  }
  Quad<T> qx, qy;
  fold_to_quad<T, W>(sx, qx);
  fold_to_quad<T, W>(sy, qy);
  xv = sum<T>(qx);
  yv = sum<T>(qy);
  for (; i < n; ++i) {
    xv += x[i] * v[i];
    yv += y[i] * v[i];
  }
}

// A build for baseline x86-64 also compiles the kernels that use these for AVX-512 and AVX2
// ([[gnu::target]] instantiations) and picks one once by CPU feature, not through target_clones (its
// ifunc resolver runs before ThreadSanitizer is initialized and crashes the sanitizer build). A build
// with -march at AVX2 or above uses its own target only.
#if defined(__x86_64__) && !defined(__AVX2__)
#define ASTERIA_SIMD_DISPATCH_BY_CPU 1
#endif

// The vector kernels the numerics run: the widest this CPU runs, at most the one the environment's
// ASTERIA_MAX_SIMD names ("avx512", "avx2" or "baseline": the tests run each kernel on one CPU so, and a user can
// rule a kernel out when diagnosing a result). A build without run-time dispatch names the one it was compiled for
// and ignores the variable. Throws InvalidArgument for any other value of it.
inline const char* pick_kernels() {
#if defined(ASTERIA_SIMD_DISPATCH_BY_CPU)
  const char* cap = std::getenv("ASTERIA_MAX_SIMD");
  const std::string limit = cap == nullptr ? "avx512" : cap;
  if (limit != "avx512" && limit != "avx2" && limit != "baseline") {
    throw InvalidArgument("Invalid ASTERIA_MAX_SIMD='" + limit +
                          "': must be avx512, avx2 or baseline (the widest vector kernels to use), or unset");
  }
  __builtin_cpu_init();
  if (limit == "avx512" && __builtin_cpu_supports("x86-64-v4")) return "avx512";
  if (limit != "baseline" && __builtin_cpu_supports("x86-64-v3")) return "avx2";
  return "baseline";
#else
  return kRegisterBytes == 64 ? "avx512" : kRegisterBytes == 32 ? "avx2" : "baseline";
#endif
}

// pick_kernels() at the first call, in every translation unit: what the kernels chosen since still run, whatever
// the environment says later.
inline const char* kernels() {
  static const char* const chosen = pick_kernels();
  return chosen;
}

#if defined(ASTERIA_SIMD_DISPATCH_BY_CPU)
// The kernel of those three that kernels() names.
template <typename Kernel>
Kernel widest_supported(Kernel avx512, Kernel avx2, Kernel baseline) {
  const std::string chosen = kernels();
  return chosen == "avx512" ? avx512 : chosen == "avx2" ? avx2 : baseline;
}
#endif

}  // namespace asteria::linalg::simd
