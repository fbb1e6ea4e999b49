// The refresh engine's internals, shared by its translation units (refresh_engine.cpp, its eigenbasis
// chain and its fault injection): a block's rings and bookkeeping, and small helpers. Not part of the API.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "asteria/runtime/refresh_engine.h"

namespace asteria::runtime {

namespace detail {

// Elements of one result buffer: the root, or the basis plus its estimates and permutation rows.
inline std::int64_t result_elements(int n, RefreshKind kind) {
  const std::int64_t rows = kind == RefreshKind::kEigenbasis ? n + 2 : n;
  return rows * n;
}

inline std::string block_name(std::int64_t id) { return "block " + std::to_string(id); }

// Whether the block at `it` is listed earlier in `blocks` too (a call's blocks are all checked before any changes).
inline bool listed_before(const std::vector<std::int64_t>& blocks, std::vector<std::int64_t>::const_iterator it) {
  return std::find(blocks.begin(), it, *it) != it;
}

// Whether none of the `count` floats at `x` is infinite or NaN (a basis handed in, a job's result).
inline bool all_finite(const float* x, std::size_t count) {
  return std::all_of(x, x + count, [](float v) { return std::isfinite(v); });
}

inline std::string job_name(std::int64_t id, std::int64_t version) {
  return block_name(id) + " version " + std::to_string(version);
}

}  // namespace detail

struct RefreshEngine::Block {
  Block(std::int64_t id, const BlockMemory& memory)
      : n(memory.n),
        kind(memory.kind),
        packed(memory.packed),
        first_from_identity(memory.first_from_identity),
        snapshots(reinterpret_cast<std::byte*>(memory.snapshots),
                  static_cast<std::size_t>(snapshot_elements(memory.n, memory.packed)) * sizeof(float),
                  static_cast<std::size_t>(memory.snapshot_stride) * sizeof(float), memory.depth,
                  detail::block_name(id) + " snapshots"),
        results(reinterpret_cast<std::byte*>(memory.results),
                static_cast<std::size_t>(detail::result_elements(memory.n, memory.kind)) * sizeof(float),
                static_cast<std::size_t>(memory.result_stride) * sizeof(float), memory.depth,
                detail::block_name(id) + " results"),
        result_base(memory.results),
        result_stride(memory.depth > 1 ? memory.result_stride : 0),
        depth(memory.depth) {}
  const int n;
  const RefreshKind kind;
  const bool packed;
  const bool first_from_identity;
  store::VersionedRing snapshots;
  store::VersionedRing results;
  float* const result_base;         // result buffer 0, in the caller's memory
  const std::int64_t result_stride;  // floats between result buffers
  const int depth;

  // Newest version submitted, any kind: an older job that starts later is superseded
  // (non-deterministic rule); guarded by mutex_.
  std::int64_t newest_submitted = 0;
  // The block's last job and its place in the pool's queue (the deadline it was queued with);
  // guarded by mutex_. A newer version submitted while that job is still queued takes its place.
  std::optional<JobHandle> queued_job;
  std::int64_t queued_deadline = 0;

  // The version activate() returned last (or the one given to set_basis or seed_basis); guarded by mutex_.
  std::int64_t activated = 0;

  // Versions computed outside the engine, noted and not yet released -> whether they have ended. One that a
  // newer release passed over stays until it ends (finish_external), since the caller may still be computing
  // it; guarded by mutex_.
  std::map<std::int64_t, bool> external;
  // The newest version released: an external version below it has been passed over; guarded by mutex_.
  std::int64_t released = 0;
  // An external version came after the chain's newest basis: set_basis() or seed_basis() must seed it before
  // the next eigenbasis job; guarded by mutex_.
  bool chain_needs_basis = false;

  // The eigenbasis chain, submission side; guarded by the engine's mutex_.
  std::optional<JobHandle> last_job;
  std::int64_t last_version = 0;  // newest version submitted or seeded
  std::int64_t seeded_next = 0;   // seed_basis() named the version submitted next (0: none)
  std::int64_t last_activation_step = std::numeric_limits<std::int64_t>::min();

  // The eigenbasis chain, job side. The block's jobs already run one at a time, each waiting for its
  // predecessor; the mutex makes that visible and protects set_basis().
  std::mutex chain_mutex;
  std::vector<float> good_basis;  // guarded by chain_mutex; n x n, torch layout
  std::int64_t good_version = 0;  // guarded by chain_mutex; 0: no good basis yet
  // seed_basis(): the basis of seed_version in a result buffer, until the block's next job takes it; guarded
  // by chain_mutex. Nothing writes that buffer before: a job of the block reads it at its start.
  const float* seed = nullptr;
  std::int64_t seed_version = 0;
};

}  // namespace asteria::runtime
