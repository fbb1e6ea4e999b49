// A refresh engine block's memory for the tests: `depth` full n x n snapshot and result buffers.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "asteria/runtime/refresh_engine.h"

namespace asteria::runtime::test_support {

struct Rings {
  Rings(int depth, int n) : n(n), snapshots(static_cast<std::size_t>(depth * n * n)), results(snapshots.size()) {}
  BlockMemory memory(int depth) {
    return BlockMemory{n, depth, snapshots.data(), static_cast<std::int64_t>(n) * n, results.data(),
                       static_cast<std::int64_t>(n) * n};
  }
  float* snapshot(std::int64_t version, int depth) { return snapshots.data() + (version % depth) * n * n; }
  float* result(std::int64_t version, int depth) { return results.data() + (version % depth) * n * n; }
  int n;
  std::vector<float> snapshots;
  std::vector<float> results;
};

// `a` (n x n) = value * I.
inline void fill_diagonal(float* a, int n, float value) {
  for (int i = 0; i < n * n; ++i) a[i] = 0.0f;
  for (int i = 0; i < n; ++i) a[i * n + i] = value;
}

// Snapshots block `id` (memory `rings`, ring depth `depth`) as version 1 = value * I and submits its inverse
// fourth root, due at `step`.
inline void submit_diagonal(RefreshEngine& engine, std::int64_t id, Rings& rings, int depth, std::int64_t step,
                            float value) {
  engine.begin_snapshot({id}, 1, std::chrono::seconds(1));
  fill_diagonal(rings.snapshot(1, depth), rings.n, value);
  engine.submit({id}, 1, step, linalg::RootSpec{-0.25, 1e-12, 1.0});
}

}  // namespace asteria::runtime::test_support
