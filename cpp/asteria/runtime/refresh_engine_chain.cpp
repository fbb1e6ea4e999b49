// The refresh engine's eigenbasis chain (SOAP, KL-Shampoo): each job of a block warm-starts from the
// newest good basis before it, and an activation that passes over good versions composes their column
// orders, so that state kept in eigen-coordinates follows in one permutation.
#include <limits>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "asteria/common/errors.h"
#include "asteria/linalg/eigenbasis.h"
#include "asteria/runtime/refresh_engine.h"
#include "asteria/runtime/refresh_engine_impl.h"

namespace asteria::runtime {

using detail::block_name;

void RefreshEngine::claim_seed(Block& b, std::int64_t version, const std::string& where) {
  if (closed_) throw CancelledError(where + "the engine is closed");
  if (version < 1 || version < b.last_version || (b.last_job && !b.last_job->finished())) {
    throw InvalidArgument(where + "Invalid version=" + std::to_string(version) +
                          ": must be >= 1 and >= the newest submitted version " + std::to_string(b.last_version) +
                          ", with no eigenbasis job of the block in flight");
  }
  b.last_version = version;
  b.activated = version;
  b.chain_needs_basis = false;
}

void RefreshEngine::set_basis(std::int64_t id, std::int64_t version, const float* basis) {
  Block& b = block(id);
  const std::string where = "[RefreshEngine::set_basis] " + block_name(id) + ": ";
  if (b.kind != RefreshKind::kEigenbasis) throw InvalidArgument(where + "not an eigenbasis block");
  if (basis == nullptr) throw InvalidArgument(where + "Invalid null basis");
  const std::size_t nn = static_cast<std::size_t>(b.n) * static_cast<std::size_t>(b.n);
  if (!detail::all_finite(basis, nn)) {
    throw InvalidArgument(where + "the basis of version " + std::to_string(version) + " is not finite");
  }
  std::lock_guard lock(mutex_);
  claim_seed(b, version, where);
  b.seeded_next = 0;
  std::lock_guard chain(b.chain_mutex);
  b.good_basis.assign(basis, basis + nn);
  b.good_version = version;
  b.seed = nullptr;
}

void RefreshEngine::seed_basis(std::int64_t id, std::int64_t version, std::int64_t next) {
  Block& b = block(id);
  const std::string where = "[RefreshEngine::seed_basis] " + block_name(id) + ": ";
  if (b.kind != RefreshKind::kEigenbasis) throw InvalidArgument(where + "not an eigenbasis block");
  if (next <= version) {
    throw InvalidArgument(where + "Invalid next=" + std::to_string(next) + ": must be after version=" +
                          std::to_string(version) + ", whose basis its result buffer holds");
  }
  std::lock_guard lock(mutex_);
  claim_seed(b, version, where);
  b.seeded_next = next;
  std::lock_guard chain(b.chain_mutex);
  b.seed = result_buffer(b, next);
  b.seed_version = version;
}

void RefreshEngine::adopt_seed(Block& b, std::int64_t id) {
  std::lock_guard chain(b.chain_mutex);
  if (b.seed == nullptr) return;
  const float* seed = std::exchange(b.seed, nullptr);
  const std::size_t nn = static_cast<std::size_t>(b.n) * static_cast<std::size_t>(b.n);
  if (!detail::all_finite(seed, nn)) {
    throw InvalidArgument("[RefreshEngine] " + block_name(id) + ": the basis of version " +
                          std::to_string(b.seed_version) + " given by seed_basis is not finite (the chain keeps " +
                          "version " + std::to_string(b.good_version) + "'s)");
  }
  b.good_basis.assign(seed, seed + nn);
  b.good_version = b.seed_version;
}

bool RefreshEngine::chain_busy(std::int64_t id) const {
  const Block& b = block(id);
  std::lock_guard lock(mutex_);
  return b.last_job && !b.last_job->finished();
}

RefreshEngine::JobOutcome RefreshEngine::compute_eigenbasis(Block& b, std::int64_t id, std::int64_t version,
                                                            const float* input, float* output,
                                                            const linalg::RootSpec& spec, double skip_tol,
                                                            bool poison) {
  const std::size_t nn = static_cast<std::size_t>(b.n) * static_cast<std::size_t>(b.n);
  float* q = output;
  float* estimates = output + nn;
  float* perm = estimates + b.n;
  JobOutcome outcome;
  std::lock_guard chain(b.chain_mutex);
  // A newer version's basis already in the chain: this job started late, behind a superseded job that ended
  // without waiting for its own predecessor (or a seed came meanwhile). Its result could only be passed over,
  // and warm-started from the newer basis and kept, it would move the chain back to an older version.
  if (b.good_version > version) {
    outcome.passed_over = true;
    return outcome;
  }
  // No basis yet, or the identity of a zero factor (a block whose parameter had no gradient yet): the
  // full eigendecomposition, as at a block's first refresh, or one QR step from the identity.
  const bool first = b.good_version == 0 || linalg::is_identity(b.n, b.good_basis.data());
  if (first && !b.first_from_identity) {
    outcome.used_float64 = linalg::eigenbasis(b.n, input, q, estimates, spec.scale).used_float64;
    std::iota(perm, perm + b.n, 0.0f);
  } else {
    std::vector<float> identity;
    if (first) {
      identity.assign(nn, 0.0f);
      for (int i = 0; i < b.n; ++i) identity[static_cast<std::size_t>(i) * b.n + i] = 1.0f;
    }
    const float* start = first ? identity.data() : b.good_basis.data();
    const linalg::BasisReport report =
        linalg::qr_refresh(b.n, input, start, q, estimates, perm, spec.scale, skip_tol);
    outcome.used_float64 = report.used_float64;
    outcome.skipped = report.skipped;
  }
  if (poison) q[0] = std::numeric_limits<float>::quiet_NaN();
  // The basis and its estimates; a rejected result never becomes the chain's good basis.
  gate_result(id, version, output, nn + static_cast<std::size_t>(b.n));
  b.good_basis.assign(q, q + nn);
  b.good_version = version;
  return outcome;
}

float* RefreshEngine::result_buffer(Block& b, std::int64_t version) {
  return b.result_base + (version % b.depth) * b.result_stride;
}

float* RefreshEngine::order_row(Block& b, std::int64_t version) {
  return result_buffer(b, version) + static_cast<std::int64_t>(b.n) * (b.n + 1);
}

void RefreshEngine::compose_order(Block& b, std::int64_t version) {
  // Version v's order is relative to the newest good basis before it. When activation passes over
  // good versions (the newest finished one under the non-deterministic rule, or several versions due
  // at once), the caller's state is still in the order of the version it has: compose the skipped
  // versions' orders, newest last, so that the row says where each column comes from in that one.
  // Skipped versions stay published until release() retires them, and only this thread retires.
  if (b.activated == 0) return;
  float* composed = order_row(b, version);
  for (std::int64_t u = version - 1; u > b.activated; --u) {
    if (b.results.state(u) != store::SlotState::kPublished) continue;  // failed: not in the chain
    const float* order = order_row(b, u);
    for (int j = 0; j < b.n; ++j) composed[j] = order[static_cast<int>(composed[j])];
  }
}

}  // namespace asteria::runtime
