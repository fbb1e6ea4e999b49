// Eigenbases of symmetric matrices for SOAP / KL-Shampoo: a full eigendecomposition, and the
// warm-started refresh of SOAP (Vyas et al. 2024), one power step followed by a QR factorization.
//
// Layout of every matrix here: row-major n x n as torch lays it out, Q[i * n + j] is component i
// of basis vector j (the vectors are torch's columns). A symmetric input reads the same either way.
#pragma once

namespace asteria::linalg {

// How the last call went.
struct BasisReport {
  bool used_float64 = false;         // the float32 attempt failed or produced non-finite output
  bool skipped = false;              // qr_refresh kept Q_prev: its off-diagonal ratio was <= skip_tol
  double off_diagonal_ratio = -1;    // ||M - diag(M)||_F / ||M||_F of M = Q_prev^T (scale A) Q_prev; -1 if not computed
};

// Full eigendecomposition of scale * A (n x n, symmetric, `scale` finite and > 0): `q` receives the
// orthonormal eigenvectors sorted by descending eigenvalue, `values` (n) the eigenvalues, values[0]
// the largest.
// - A zero A gets the identity and zero values: every basis diagonalizes it, and the identity marks
//   that nothing is known of its directions yet (`is_identity`: the refresh engine then computes the
//   block's next basis by a full eigendecomposition instead of warm-starting from this one).
// - Rejects non-finite input with NumericalError("... non-finite input ...").
// - Works in float32 first; if LAPACK fails or the result is not finite, retries in float64.
// - Quality gate: a result that is still not finite raises NumericalError and the outputs are left
//   untouched (the caller keeps its previous basis).
// Thread safety: safe to call concurrently; each thread keeps its own workspace.
BasisReport eigenbasis(int n, const float* a, float* q, float* values, double scale);
// The same in float64 throughout (a reference for tests).
BasisReport eigenbasis(int n, const double* a, double* q, double* values, double scale);

// Whether the n x n matrix `q` is exactly the identity.
bool is_identity(int n, const float* q);

// One warm-started refresh from the basis Q_prev (n x n, orthonormal columns):
//   T = (scale A) Q_prev,  est_j = Q_prev[:, j] . T[:, j]  (= diag(Q_prev^T scale A Q_prev)),
//   order = argsort(est) descending and stable (ties keep the lower index first),
//   estimates[j] = est[order[j]],  perm[j] = order[j],  q = Q of the QR factorization of T[:, order]
// (Householder reflectors with xGEQRF's signs, those of torch.linalg.qr; see qr_q in qr.h).
// Adaptive skip (`skip_tol` > 0): with M = Q_prev^T (scale A) Q_prev and
// ratio = ||M - diag(M)||_F / ||M||_F (reported; 0 for M = 0), a ratio <= skip_tol keeps the basis:
// q = q_prev bit for bit, perm = 0..n-1, estimates = diag(M) in Q_prev's order. `skip_tol` = 0
// never skips and does not compute the ratio (reported as -1).
// Same input and output gates and float64 retry as eigenbasis(). `q` may be `q_prev` (in place);
// no other output may overlap an input.
// Thread safety: safe to call concurrently; each thread keeps its own workspace.
BasisReport qr_refresh(int n, const float* a, const float* q_prev, float* q, float* estimates, float* perm,
                       double scale, double skip_tol);
// The same in float64 throughout (a reference for tests).
BasisReport qr_refresh(int n, const double* a, const double* q_prev, double* q, double* estimates, double* perm,
                       double scale, double skip_tol);

}  // namespace asteria::linalg
