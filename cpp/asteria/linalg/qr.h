// The in-house Householder QR of the eigenbasis refresh (qr.cpp): blocked wider than LAPACK's
// xGEQRF/xORGQR, with the same reflectors and signs.
#pragma once

#include <vector>

namespace asteria::linalg {

// Householder QR of `a` (m x n, m >= n, column-major, leading dimension lda) in place, then Q formed:
// `a` becomes the first n columns of Q, with xGEQRF's reflectors and signs. `work` is grown as needed
// and may be reused across calls (one per thread).
// Throws InvalidArgument for a bad shape or leading dimension.
// Thread safety: safe to call concurrently on distinct `a` and `work`; it keeps no state of its own.
template <typename T>
void qr_q(int m, int n, T* a, int lda, std::vector<T>& work);

}  // namespace asteria::linalg
