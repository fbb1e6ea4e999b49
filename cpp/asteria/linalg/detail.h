// Internals shared by the numerics' translation units (not part of the core's interface).
#pragma once

#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <vector>

namespace asteria::linalg::detail {

// |x| <= max is false for inf and NaN; unlike a branch on std::isfinite it vectorizes.
template <typename T, typename Limit = T>
bool all_within(const T* x, std::size_t count) {
  bool ok = true;
  for (std::size_t i = 0; i < count; ++i) ok &= std::abs(x[i]) <= static_cast<T>(std::numeric_limits<Limit>::max());
  return ok;
}

// Grows a per-thread buffer to at least `size` elements; buffers are kept at the largest size seen.
template <typename T>
void grow(std::vector<T>& v, std::size_t size) {
  if (v.size() < size) v.resize(size);
}

// xLARFG: the reflector H = I - tau [1; v] [1; v]^T with H [alpha; x] = [beta; 0]; alpha becomes beta
// and x becomes v (n counts alpha).
template <typename T>
void larfg(int n, T* alpha, T* x, T* tau);

// The upper triangular T (k x k, ldt) of the block reflector H(0) ... H(k-1) = I - V T V^T, V (rows x k,
// ldv) dense with explicit unit diagonal and zeros above; zeros below T's diagonal (defined in lapack.cpp).
template <typename T>
void block_reflector_factor(int rows, int k, const T* v, int ldv, const T* tau, T* t, int ldt);

}  // namespace asteria::linalg::detail
