// Inverse p-th roots of symmetric positive semi-definite matrices through an eigendecomposition.
#pragma once

#include <cstdint>
#include <string>

namespace asteria::linalg {

// What to compute: (scale * A + shift * I)^exponent, with the eigenvalues regularized as
//   mu_i = scale * lambda_i + max(0, -scale * lambda_min)
//   lambda_i' = mu_i + eps + relative_eps * mu_max
// i.e. a spectrum whose smallest eigenvalue is negative (round-off on a semi-definite matrix) is
// first shifted up to zero, then every eigenvalue gets eps plus relative_eps times the largest.
// The relative term bounds the root's condition number by (1 + 1/relative_eps)^|exponent| whatever
// the factor's scale: a factor of few, small gradients (a small model, early steps) keeps near-zero
// eigenvalues whose directions an absolute eps alone would amplify by eps^exponent.
// `exponent` < 0 (e.g. -1/4 for a two-sided Shampoo factor), `eps` > 0, `relative_eps` >= 0,
// `scale` > 0 (a bias correction 1 / (1 - beta2^t)).
struct RootSpec {
  double exponent = -0.25;
  double eps = 1e-12;
  double scale = 1.0;
  double relative_eps = 0.0;
};

// Validates a RootSpec; throws InvalidArgument naming the field and value.
void validate(const RootSpec& spec);

// How the last call went: which precision produced the result and the eigenvalue range seen.
struct RootReport {
  bool used_float64 = false;   // the float32 attempt failed or produced non-finite output
  double lambda_min = 0.0;     // of scale * A, before regularization
  double lambda_max = 0.0;
};

// Computes the root of the n x n symmetric matrix `a` (leading dimension lda, not modified) into
// `out` (n x n, leading dimension ldo, fully written, symmetric).
// - Rejects non-finite input with NumericalError("... non-finite input ...").
// - Works in float32 first; if LAPACK fails or the result is not finite, retries in float64.
// - Quality gate: a result that is still not finite raises NumericalError and `out` is left
//   untouched (the caller keeps its previous root).
// Thread safety: safe to call concurrently; each thread keeps its own workspace.
RootReport inverse_root(int n, const float* a, int lda, float* out, int ldo, const RootSpec& spec);

// The same in float64 throughout (used by the retry, and by tests as a reference).
RootReport inverse_root(int n, const double* a, int lda, double* out, int ldo, const RootSpec& spec);

}  // namespace asteria::linalg
