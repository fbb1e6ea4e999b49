// The refresh engine end to end: snapshots in, roots out, activation by schedule, failures kept.
#include "asteria/runtime/refresh_engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "asteria/common/errors.h"
#include "asteria/linalg/eigenbasis.h"
#include "asteria/runtime/blas_threads.h"
#include "rings.h"

namespace asteria::runtime {
namespace {

using namespace std::chrono_literals;

using test_support::fill_diagonal;
using test_support::Rings;

EngineConfig config(int staleness, int workers = 2, int max_failures = 3) {
  EngineConfig c;
  c.workers = workers;
  c.registry.staleness = staleness;
  c.registry.max_consecutive_failures = max_failures;
  c.slot_timeout = 5s;
  return c;
}

TEST(RefreshEngine, ComputesRootsAndActivatesOnSchedule) {
  constexpr int kDepth = 3, kN = 4;
  RefreshEngine engine(config(/*staleness=*/2));
  Rings rings(kDepth, kN);
  const auto block = engine.add_block(rings.memory(kDepth));
  for (std::int64_t version = 1; version <= 2; ++version) {
    engine.begin_snapshot({block}, version, 1s);
    fill_diagonal(rings.snapshot(version, kDepth), kN, 16.0f * static_cast<float>(version));
    engine.submit({block}, version, /*activation_step=*/10 * version + 20, linalg::RootSpec{-0.25, 1e-12, 1.0});
  }
  engine.drain(5s);
  EXPECT_TRUE(engine.activate(29, 1s).empty());  // version 1 is due at step 30
  const auto changes = engine.activate(30, 1s);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_EQ(changes[0].version, 1);
  EXPECT_NEAR(rings.result(1, kDepth)[0], 0.5f, 1e-6f);  // 16^(-1/4)
  engine.release(block, 1);
  const auto next = engine.activate(40, 1s);
  ASSERT_EQ(next.size(), 1u);
  EXPECT_NEAR(rings.result(2, kDepth)[kN + 1], std::pow(32.0f, -0.25f), 1e-6f);
  engine.release(block, 2);
  const auto stats = engine.stats();
  EXPECT_EQ(stats.refreshes_ok, 2u);
  EXPECT_EQ(stats.refreshes_failed, 0u);
}

TEST(RefreshEngine, AZeroFactorsRootIsTheIdentity) {
  // A block whose parameter has had no gradient yet: its factor is zero, and (eps I)^(-1/4) = 1000 I at
  // eps 1e-12 would scale its steps; it gets the identity. A nonzero factor still gets its root.
  constexpr int kDepth = 2, kN = 4;
  RefreshEngine engine(config(/*staleness=*/1));
  Rings rings(kDepth, kN);
  const auto block = engine.add_block(rings.memory(kDepth));
  engine.begin_snapshot({block}, 1, 1s);
  std::fill(rings.snapshot(1, kDepth), rings.snapshot(1, kDepth) + kN * kN, 0.0f);
  engine.submit({block}, 1, 10, linalg::RootSpec{-0.25, 1e-12, 1.0});
  engine.begin_snapshot({block}, 2, 1s);
  fill_diagonal(rings.snapshot(2, kDepth), kN, 16.0f);
  engine.submit({block}, 2, 20, linalg::RootSpec{-0.25, 1e-12, 1.0});
  engine.drain(5s);
  ASSERT_EQ(engine.activate(10, 1s).size(), 1u);
  for (int i = 0; i < kN; ++i) {
    for (int j = 0; j < kN; ++j) EXPECT_EQ(rings.result(1, kDepth)[i * kN + j], i == j ? 1.0f : 0.0f);
  }
  engine.release(block, 1);
  ASSERT_EQ(engine.activate(20, 1s).size(), 1u);
  EXPECT_NEAR(rings.result(2, kDepth)[0], 0.5f, 1e-6f);
  engine.release(block, 2);
  EXPECT_EQ(engine.stats().refreshes_ok, 2u);
}

// One worker held by a paused job of another block while three versions of `block` queue up.
EngineStats queue_three_behind_a_paused_job(bool deterministic, std::int64_t* newest_ok, std::int64_t* failures) {
  constexpr int kDepth = 4, kN = 4;
  EngineConfig c = config(/*staleness=*/3, /*workers=*/1);
  c.registry.deterministic = deterministic;
  RefreshEngine engine(c);
  Rings held_rings(kDepth, kN), rings(kDepth, kN);
  const auto held = engine.add_block(held_rings.memory(kDepth));
  const auto block = engine.add_block(rings.memory(kDepth));
  const linalg::RootSpec spec{-0.25, 1e-12, 1.0};
  engine.inject_fault(held, 1, FaultKind::kPause);
  engine.begin_snapshot({held}, 1, 1s);
  fill_diagonal(held_rings.snapshot(1, kDepth), kN, 1.0f);
  engine.submit({held}, 1, 10, spec);
  engine.wait_paused(1, 5s);  // the only worker now waits inside that job
  for (std::int64_t version = 1; version <= 3; ++version) {
    engine.begin_snapshot({block}, version, 1s);
    fill_diagonal(rings.snapshot(version, kDepth), kN, 16.0f * static_cast<float>(version));
    engine.submit({block}, version, 10 + version, spec);
  }
  engine.release_pauses();
  engine.drain(5s);
  *newest_ok = engine.status(block).newest_ok;
  *failures = engine.status(block).total_failures;
  const auto changes = engine.activate(100, 1s);
  for (const auto& change : changes) {
    if (change.block == block) {
      EXPECT_EQ(change.version, 3);
      EXPECT_NEAR(rings.result(3, kDepth)[0], std::pow(48.0f, -0.25f), 1e-6f);
    }
    engine.release(change.block, change.version);
  }
  return engine.stats();
}

TEST(RefreshEngine, NonDeterministicJobsBehindANewerVersionAreSuperseded) {
  std::int64_t newest_ok = 0, failures = -1;
  const EngineStats stats = queue_three_behind_a_paused_job(/*deterministic=*/false, &newest_ok, &failures);
  EXPECT_EQ(stats.refreshes_superseded, 2u);  // versions 1 and 2 found version 3 queued
  EXPECT_EQ(stats.registry.superseded_versions, 2u);
  EXPECT_EQ(stats.refreshes_ok, 2u);  // the held job and version 3
  EXPECT_EQ(stats.refreshes_failed, 0u);
  EXPECT_EQ(newest_ok, 3);
  EXPECT_EQ(failures, 0);
}

TEST(RefreshEngine, DeterministicJobsAreNeverSuperseded) {
  std::int64_t newest_ok = 0, failures = -1;
  const EngineStats stats = queue_three_behind_a_paused_job(/*deterministic=*/true, &newest_ok, &failures);
  EXPECT_EQ(stats.refreshes_superseded, 0u);
  EXPECT_EQ(stats.refreshes_ok, 4u);
  EXPECT_EQ(newest_ok, 3);
  EXPECT_EQ(failures, 0);
}

// One worker, held by a paused job: block B's version 1 is queued (deadline 11), then block C's version 1
// (deadline 12, paused when it starts), then B's version 2 (deadline 21). Returns B's newest good
// version at the moment C's job has started.
std::int64_t newest_of_b_when_c_starts(bool deterministic) {
  constexpr int kDepth = 3, kN = 4;
  EngineConfig c = config(/*staleness=*/3, /*workers=*/1);
  c.registry.deterministic = deterministic;
  RefreshEngine engine(c);
  Rings held_rings(kDepth, kN), b_rings(kDepth, kN), c_rings(kDepth, kN);
  const auto held = engine.add_block(held_rings.memory(kDepth));
  const auto b = engine.add_block(b_rings.memory(kDepth));
  const auto c_block = engine.add_block(c_rings.memory(kDepth));
  const linalg::RootSpec spec{-0.25, 1e-12, 1.0};
  const auto submit = [&](std::int64_t block, Rings& rings, std::int64_t version, std::int64_t step) {
    engine.begin_snapshot({block}, version, 1s);
    fill_diagonal(rings.snapshot(version, kDepth), kN, 16.0f);
    engine.submit({block}, version, step, spec);
  };
  engine.inject_fault(held, 1, FaultKind::kPause);
  engine.inject_fault(c_block, 1, FaultKind::kPause);
  submit(held, held_rings, 1, 10);
  engine.wait_paused(1, 5s);  // the only worker now waits inside the held job
  submit(b, b_rings, 1, 11);
  submit(c_block, c_rings, 1, 12);
  submit(b, b_rings, 2, 21);
  engine.release_pauses();
  engine.wait_paused(1, 5s);  // C's job has started: every job before it in the queue has ended
  const std::int64_t newest = engine.status(b).newest_ok;
  engine.release_pauses();
  engine.drain(5s);
  EXPECT_EQ(engine.status(b).newest_ok, 2);
  EXPECT_EQ(engine.status(c_block).newest_ok, 1);
  return newest;
}

TEST(RefreshEngine, NonDeterministicNewerVersionTakesTheQueuePlaceOfTheOneItSupersedes) {
  // B's version 1 is superseded when it starts, and version 2 runs at its place, before C's job (without
  // that, version 2 would wait behind C, and B would fall behind again with every version).
  EXPECT_EQ(newest_of_b_when_c_starts(/*deterministic=*/false), 2);
}

TEST(RefreshEngine, DeterministicJobsKeepTheirOwnDeadlines) {
  // Version 1 runs (never superseded), C's job next: its deadline 12 comes before version 2's 21.
  EXPECT_EQ(newest_of_b_when_c_starts(/*deterministic=*/true), 1);
}

TEST(RefreshEngine, NonFiniteSnapshotFailsAndKeepsLastGoodThenRaises) {
  constexpr int kDepth = 1, kN = 3;
  RefreshEngine engine(config(/*staleness=*/0, /*workers=*/1, /*max_failures=*/2));
  Rings rings(kDepth, kN);
  const auto block = engine.add_block(rings.memory(kDepth));
  auto refresh = [&](std::int64_t version, float value) {
    engine.begin_snapshot({block}, version, 1s);
    fill_diagonal(rings.snapshot(version, kDepth), kN, value);
    engine.submit({block}, version, version, linalg::RootSpec{-0.5, 1e-12, 1.0});
    return engine.activate(version, 5s);
  };
  ASSERT_EQ(refresh(1, 4.0f).size(), 1u);
  engine.release(block, 1);
  EXPECT_TRUE(refresh(2, NAN).empty());  // failed: version 1 stays in use
  EXPECT_EQ(engine.status(block).active_version, 1);
  EXPECT_EQ(engine.status(block).consecutive_failures, 1);
  EXPECT_NE(engine.status(block).last_error.find("non-finite"), std::string::npos);
  EXPECT_THROW(refresh(3, NAN), BlockFailure);
  EXPECT_EQ(engine.status(block).active_version, 1);
}

TEST(RefreshEngine, ActivateTimesOutWithAClearMessage) {
  RefreshEngine engine(config(/*staleness=*/0, /*workers=*/1));
  Rings rings(1, 2);
  const auto block = engine.add_block(rings.memory(1));
  Rings blocker(1, 2);
  (void)blocker;
  engine.begin_snapshot({block}, 1, 1s);
  fill_diagonal(rings.snapshot(1, 1), 2, 1.0f);
  engine.submit({block}, 1, 1, linalg::RootSpec{-0.5, 1e-12, 1.0});
  ASSERT_EQ(engine.activate(1, 5s).size(), 1u);
  // Version 2's job cannot write its result while version 1 stays pinned (never released here).
  engine.begin_snapshot({block}, 2, 1s);
  fill_diagonal(rings.snapshot(2, 1), 2, 1.0f);
  engine.submit({block}, 2, 2, linalg::RootSpec{-0.5, 1e-12, 1.0});
  try {
    engine.activate(2, 50ms);
    FAIL() << "expected TimeoutError";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("block 0"), std::string::npos) << e.what();
  }
  engine.release(block, 1);
  EXPECT_EQ(engine.activate(2, 5s).size(), 1u);
}

TEST(RefreshEngine, RejectsBadArguments) {
  EXPECT_THROW(RefreshEngine(config(0, /*workers=*/0)), InvalidArgument);
  RefreshEngine engine(config(0));
  Rings rings(1, 2);
  EXPECT_THROW(engine.add_block(BlockMemory{0, 1, rings.snapshots.data(), 4, rings.results.data(), 4}), InvalidArgument);
  EXPECT_THROW(engine.add_block(BlockMemory{2, 2, rings.snapshots.data(), 1, rings.results.data(), 4}), InvalidArgument);
  const auto block = engine.add_block(rings.memory(1));
  engine.begin_snapshot({block}, 1, 1s);
  EXPECT_THROW(engine.submit({block}, 1, 1, linalg::RootSpec{0.5, 1e-12, 1.0}), InvalidArgument);
  EXPECT_THROW(engine.submit({block}, 1, -1, linalg::RootSpec{-0.5, 1e-12, 1.0}), InvalidArgument);
  EXPECT_THROW(engine.begin_snapshot({7}, 1, 1s), InvalidArgument);
  engine.submit({block}, 1, 0, linalg::RootSpec{-0.5, 1e-12, 1.0});  // the snapshot was kept: usable at step 0
  EXPECT_EQ(engine.activate(0, 5s).size(), 1u);
}

TEST(RefreshEngine, CloseCancelsQueuedWorkAndRefusesMore) {
  RefreshEngine engine(config(/*staleness=*/4, /*workers=*/1));
  constexpr int kN = 64;
  std::vector<Rings> rings;
  rings.reserve(16);
  std::vector<std::int64_t> blocks;
  for (int i = 0; i < 16; ++i) {
    rings.emplace_back(1, kN);
    blocks.push_back(engine.add_block(rings.back().memory(1)));
    fill_diagonal(rings.back().snapshot(1, 1), kN, 2.0f);
  }
  engine.begin_snapshot(blocks, 1, 1s);
  engine.submit(blocks, 1, 100, linalg::RootSpec{-0.25, 1e-12, 1.0});
  engine.close();
  engine.close();
  EXPECT_TRUE(engine.closed());
  EXPECT_THROW(engine.activate(100, 10ms), CancelledError);
  EXPECT_THROW(engine.begin_snapshot(blocks, 2, 1s), CancelledError);
  EXPECT_THROW(engine.add_block(rings.front().memory(1)), CancelledError);
  EXPECT_EQ(engine.num_blocks(), 16);
  const auto stats = engine.stats();
  EXPECT_EQ(stats.pool.completed + stats.pool.cancelled, 16u);
}

// Eigenbasis blocks: (n + 2) x n results, a chain of warm-started jobs.

// G G^T / (2n) + 0.1 I with G n x 2n Gaussian, in torch's row-major layout.
std::vector<float> random_factor(int n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  const int cols = 2 * n;
  std::vector<float> g(static_cast<std::size_t>(n) * cols);
  for (float& x : g) x = normal(rng);
  std::vector<float> a(static_cast<std::size_t>(n) * n);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      double sum = 0;
      for (int k = 0; k < cols; ++k) sum += static_cast<double>(g[i * cols + k]) * g[j * cols + k];
      a[i * n + j] = static_cast<float>(sum / cols + (i == j ? 0.1 : 0.0));
    }
  }
  return a;
}

struct BasisRings {
  BasisRings(int depth, int n)
      : n(n), depth(depth), snapshots(static_cast<std::size_t>(depth * n * n)),
        results(static_cast<std::size_t>(depth * (n + 2) * n)) {}
  BlockMemory memory(bool first_from_identity = false) {
    BlockMemory m{n, depth, snapshots.data(), static_cast<std::int64_t>(n) * n, results.data(),
                  static_cast<std::int64_t>(n + 2) * n};
    m.kind = RefreshKind::kEigenbasis;
    m.first_from_identity = first_from_identity;
    return m;
  }
  float* snapshot(std::int64_t version) { return snapshots.data() + (version % depth) * n * n; }
  std::vector<float> result(std::int64_t version) const {
    const float* begin = results.data() + (version % depth) * (n + 2) * n;
    return std::vector<float>(begin, begin + (n + 2) * n);
  }
  int n, depth;
  std::vector<float> snapshots;
  std::vector<float> results;
};

// What the chain must produce: (n + 2) x n buffers from direct calls.
std::vector<float> direct_eigenbasis(int n, const std::vector<float>& a, double scale) {
  std::vector<float> out(static_cast<std::size_t>(n + 2) * n);
  linalg::eigenbasis(n, a.data(), out.data(), out.data() + n * n, scale);
  for (int j = 0; j < n; ++j) out[(n + 1) * n + j] = static_cast<float>(j);
  return out;
}

std::vector<float> direct_refresh(int n, const std::vector<float>& a, const std::vector<float>& previous,
                                  double scale, double skip_tol) {
  std::vector<float> out(static_cast<std::size_t>(n + 2) * n);
  linalg::qr_refresh(n, a.data(), previous.data(), out.data(), out.data() + n * n, out.data() + (n + 1) * n, scale,
                     skip_tol);
  return out;
}

bool bitwise_equal(const std::vector<float>& x, const std::vector<float>& y) {
  return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) == 0;
}

constexpr double kBasisScale = 1.5;

// Runs versions 1..factors.size() of one eigenbasis block (a NaN factor fails its version) and
// returns the result buffers of all versions (empty for failed ones).
std::vector<std::vector<float>> run_chain(int workers, const std::vector<std::vector<float>>& factors,
                                          double skip_tol = 0.0, EngineStats* stats = nullptr,
                                          bool first_from_identity = false) {
  const int n = static_cast<int>(std::sqrt(static_cast<double>(factors[0].size())));
  const int depth = static_cast<int>(factors.size()) + 1;
  RefreshEngine engine(config(/*staleness=*/depth - 1, workers));
  BasisRings rings(depth, n);
  const auto block = engine.add_block(rings.memory(first_from_identity));
  for (std::size_t i = 0; i < factors.size(); ++i) {
    const std::int64_t version = static_cast<std::int64_t>(i) + 1;
    engine.begin_snapshot({block}, version, 1s);
    std::copy(factors[i].begin(), factors[i].end(), rings.snapshot(version));
    engine.submit({block}, version, /*activation_step=*/10 * version, linalg::RootSpec{0.0, 0.0, kBasisScale},
                  skip_tol);
  }
  engine.drain(10s);
  std::vector<std::vector<float>> out;
  for (std::size_t i = 0; i < factors.size(); ++i) {
    const std::int64_t version = static_cast<std::int64_t>(i) + 1;
    const bool ok = std::all_of(factors[i].begin(), factors[i].end(), [](float x) { return std::isfinite(x); });
    EXPECT_GE(engine.status(block).newest_finished, version);
    out.push_back(ok ? rings.result(version) : std::vector<float>{});
  }
  if (stats != nullptr) *stats = engine.stats();
  return out;
}

TEST(RefreshEngineEigenbasis, ChainMatchesDirectCallsBitForBitWithAnyWorkerCount) {
  set_blas_threads(1);
  constexpr int kN = 24;
  const std::vector<std::vector<float>> factors = {random_factor(kN, 1), random_factor(kN, 2),
                                                   random_factor(kN, 3)};
  const auto v1 = direct_eigenbasis(kN, factors[0], kBasisScale);
  const auto basis = [](const std::vector<float>& result) {
    return std::vector<float>(result.begin(), result.begin() + kN * kN);
  };
  const auto v2 = direct_refresh(kN, factors[1], basis(v1), kBasisScale, 0);
  const auto v3 = direct_refresh(kN, factors[2], basis(v2), kBasisScale, 0);
  EngineStats stats;
  const auto one_worker = run_chain(1, factors, 0.0, &stats);
  ASSERT_EQ(one_worker.size(), 3u);
  EXPECT_TRUE(bitwise_equal(one_worker[0], v1));
  EXPECT_TRUE(bitwise_equal(one_worker[1], v2));
  EXPECT_TRUE(bitwise_equal(one_worker[2], v3));
  EXPECT_EQ(stats.refreshes_ok, 3u);
  EXPECT_EQ(stats.refreshes_skipped, 0u);
  const auto four_workers = run_chain(4, factors);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(bitwise_equal(four_workers[i], one_worker[i])) << "version " << i + 1;
}

TEST(RefreshEngineEigenbasis, FailedVersionIsSkippedByTheChain) {
  set_blas_threads(1);
  constexpr int kN = 16;
  std::vector<std::vector<float>> factors = {random_factor(kN, 4), random_factor(kN, 5), random_factor(kN, 6)};
  factors[1][0] = NAN;
  const auto v1 = direct_eigenbasis(kN, factors[0], kBasisScale);
  const auto v3 = direct_refresh(kN, factors[2], std::vector<float>(v1.begin(), v1.begin() + kN * kN), kBasisScale, 0);
  for (const int workers : {1, 4}) {
    EngineStats stats;
    const auto results = run_chain(workers, factors, 0.0, &stats);
    EXPECT_TRUE(bitwise_equal(results[0], v1));
    EXPECT_TRUE(results[1].empty());
    EXPECT_TRUE(bitwise_equal(results[2], v3)) << workers << " workers";
    EXPECT_EQ(stats.refreshes_ok, 2u);
    EXPECT_EQ(stats.refreshes_failed, 1u);
  }
}

TEST(RefreshEngineEigenbasis, FirstVersionFailingLeavesTheNextToDecomposeFully) {
  constexpr int kN = 8;
  std::vector<std::vector<float>> factors = {random_factor(kN, 7), random_factor(kN, 8)};
  factors[0][3] = INFINITY;
  const auto results = run_chain(2, factors);
  EXPECT_TRUE(results[0].empty());
  EXPECT_TRUE(bitwise_equal(results[1], direct_eigenbasis(kN, factors[1], kBasisScale)));
}

TEST(RefreshEngineEigenbasis, AZeroFactorsIdentityIsNotWarmStartedFrom) {
  // A block whose parameter has had no gradient yet has a zero factor: its basis is the identity, and
  // the first nonzero factor after it gets the full eigendecomposition a first refresh gets (a warm
  // start from the identity would take many refreshes to reach the eigenbasis).
  set_blas_threads(1);
  constexpr int kN = 10;
  const std::vector<float> zero(kN * kN, 0.0f);
  const std::vector<std::vector<float>> factors = {zero, zero, random_factor(kN, 12), random_factor(kN, 13)};
  const auto results = run_chain(2, factors);
  for (int version = 0; version < 2; ++version) {
    EXPECT_TRUE(linalg::is_identity(kN, results[version].data())) << "version " << version + 1;
  }
  const auto v3 = direct_eigenbasis(kN, factors[2], kBasisScale);
  EXPECT_TRUE(bitwise_equal(results[2], v3));
  const auto v4 = direct_refresh(kN, factors[3], std::vector<float>(v3.begin(), v3.begin() + kN * kN),
                                 kBasisScale, 0);
  EXPECT_TRUE(bitwise_equal(results[3], v4));  // from then on, warm-started as usual
  const auto warm_from_identity = direct_refresh(kN, factors[2], direct_eigenbasis(kN, zero, 1.0), kBasisScale, 0);
  EXPECT_FALSE(bitwise_equal(results[2], warm_from_identity));  // the rule above is what made the difference
}

TEST(RefreshEngineEigenbasis, AFirstBasisFromTheIdentityIsOneQrStepFromIt) {
  // Distributed Shampoo's rule: the first basis (also after a zero factor's identity) is the warm refresh
  // from the identity, and the chain goes on from it; the same bits with any worker count.
  set_blas_threads(1);
  constexpr int kN = 12;
  std::vector<float> identity(kN * kN, 0.0f);
  for (int i = 0; i < kN; ++i) identity[i * kN + i] = 1.0f;
  const std::vector<std::vector<float>> factors = {std::vector<float>(kN * kN, 0.0f), random_factor(kN, 14),
                                                   random_factor(kN, 15)};
  const auto v2 = direct_refresh(kN, factors[1], identity, kBasisScale, 0);
  const auto v3 = direct_refresh(kN, factors[2], std::vector<float>(v2.begin(), v2.begin() + kN * kN), kBasisScale, 0);
  for (const int workers : {1, 4}) {
    const auto results = run_chain(workers, factors, 0.0, nullptr, /*first_from_identity=*/true);
    EXPECT_TRUE(linalg::is_identity(kN, results[0].data()));  // a zero factor keeps the identity
    EXPECT_TRUE(bitwise_equal(results[1], v2)) << workers << " workers";
    EXPECT_TRUE(bitwise_equal(results[2], v3)) << workers << " workers";
  }
  EXPECT_FALSE(bitwise_equal(v2, direct_eigenbasis(kN, factors[1], kBasisScale)));  // not the full decomposition
  RefreshEngine engine(config(1, 1));
  std::vector<float> snapshots(kN * kN), roots(kN * kN);
  BlockMemory root{kN, 1, snapshots.data(), 0, roots.data(), 0};
  root.first_from_identity = true;
  EXPECT_THROW(engine.add_block(root), InvalidArgument);  // a root has no basis
}

TEST(RefreshEngineEigenbasis, SkipsAndCountsANearlyDiagonalRefresh) {
  constexpr int kN = 12;
  const std::vector<float> factor = random_factor(kN, 9);
  EngineStats stats;
  const auto results = run_chain(1, {factor, factor}, /*skip_tol=*/1e-3, &stats);
  EXPECT_EQ(stats.refreshes_skipped, 1u);
  EXPECT_EQ(std::memcmp(results[0].data(), results[1].data(), kN * kN * sizeof(float)), 0);
  for (int j = 0; j < kN; ++j) EXPECT_EQ(results[1][(kN + 1) * kN + j], static_cast<float>(j));
}

TEST(RefreshEngineEigenbasis, SetBasisSeedsTheChain) {
  constexpr int kN = 8, kDepth = 2;
  RefreshEngine engine(config(/*staleness=*/1, /*workers=*/2));
  BasisRings rings(kDepth, kN);
  const auto block = engine.add_block(rings.memory());
  const std::vector<float> seed_factor = random_factor(kN, 10), factor = random_factor(kN, 11);
  const auto seed = direct_eigenbasis(kN, seed_factor, 1.0);
  const std::vector<float> basis(seed.begin(), seed.begin() + kN * kN);
  engine.start_at({block}, 6);
  engine.set_basis(block, 5, basis.data());
  engine.begin_snapshot({block}, 6, 1s);
  std::copy(factor.begin(), factor.end(), rings.snapshot(6));
  engine.submit({block}, 6, 60, linalg::RootSpec{0.0, 0.0, 1.0});
  engine.drain(5s);
  EXPECT_TRUE(bitwise_equal(rings.result(6), direct_refresh(kN, factor, basis, 1.0, 0.0)));
  EXPECT_THROW(engine.set_basis(block, 5, basis.data()), InvalidArgument);  // not after version 6
}

// Activation that passes over good versions hands back one order relative to the basis in use.
void expect_composed_order(bool middle_fails) {
  set_blas_threads(1);
  constexpr int kN = 12, kDepth = 4;
  EngineConfig c = config(/*staleness=*/3, /*workers=*/2);
  c.registry.deterministic = false;  // the newest finished version: 4, passing over 2 and 3
  RefreshEngine engine(c);
  BasisRings rings(kDepth, kN);
  const auto block = engine.add_block(rings.memory());
  std::vector<std::vector<float>> factors;
  for (unsigned seed = 20; seed < 24; ++seed) factors.push_back(random_factor(kN, seed));
  if (middle_fails) factors[2][5] = NAN;
  const auto submit = [&](std::int64_t version) {
    engine.begin_snapshot({block}, version, 1s);
    std::copy(factors[version - 1].begin(), factors[version - 1].end(), rings.snapshot(version));
    engine.submit({block}, version, 10 * version, linalg::RootSpec{0.0, 0.0, 1.0});
  };
  submit(1);
  engine.drain(5s);
  auto changes = engine.activate(1, 1s);
  ASSERT_EQ(changes.size(), 1u);
  engine.release(block, 1);
  for (std::int64_t v = 2; v <= 4; ++v) {
    submit(v);
    engine.drain(5s);  // each job starts before the next is submitted, so none is superseded
  }
  changes = engine.activate(40, 1s);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_EQ(changes[0].version, 4);

  // The chain from direct calls: each version warm-starts from the newest good one before it.
  const auto basis = [](const std::vector<float>& result) {
    return std::vector<float>(result.begin(), result.begin() + kN * kN);
  };
  const auto v1 = direct_eigenbasis(kN, factors[0], 1.0);
  const auto v2 = direct_refresh(kN, factors[1], basis(v1), 1.0, 0.0);
  const auto v3 = middle_fails ? v2 : direct_refresh(kN, factors[2], basis(v2), 1.0, 0.0);
  const auto v4 = direct_refresh(kN, factors[3], basis(v3), 1.0, 0.0);
  const auto order = [](const std::vector<float>& result, int j) {
    return static_cast<int>(result[(kN + 1) * kN + j]);
  };
  const auto got = rings.result(4);
  EXPECT_EQ(std::memcmp(got.data(), v4.data(), (kN + 1) * kN * sizeof(float)), 0);  // basis and estimates
  bool permuted = false;
  for (int j = 0; j < kN; ++j) {
    const int expected = middle_fails ? order(v2, order(v4, j)) : order(v2, order(v3, order(v4, j)));
    EXPECT_EQ(order(got, j), expected) << "column " << j;
    permuted |= expected != j;
  }
  EXPECT_TRUE(permuted);  // the check would be vacuous with identity orders
  engine.release(block, 4);
  EXPECT_EQ(engine.status(block).active_version, 4);
}

TEST(RefreshEngineEigenbasis, ActivationPassingOverVersionsComposesTheirOrders) { expect_composed_order(false); }

TEST(RefreshEngineEigenbasis, ComposedOrderLeavesOutAFailedVersion) { expect_composed_order(true); }

TEST(RefreshEngineEigenbasis, RejectsBadArguments) {
  constexpr int kN = 4;
  RefreshEngine engine(config(/*staleness=*/1));
  BasisRings rings(2, kN);
  BlockMemory short_stride = rings.memory();
  short_stride.result_stride = kN * kN;
  EXPECT_THROW(engine.add_block(short_stride), InvalidArgument);
  const auto block = engine.add_block(rings.memory());
  Rings root_rings(1, kN);
  const auto root_block = engine.add_block(root_rings.memory(1));
  std::vector<float> basis(kN * kN, 0.0f);
  EXPECT_THROW(engine.set_basis(root_block, 1, basis.data()), InvalidArgument);
  basis[1] = NAN;
  EXPECT_THROW(engine.set_basis(block, 1, basis.data()), InvalidArgument);

  engine.start_at({block}, 2);
  engine.begin_snapshot({block}, 2, 1s);
  fill_diagonal(rings.snapshot(2), kN, 1.0f);
  EXPECT_THROW(engine.submit({block}, 2, 20, linalg::RootSpec{0.0, 0.0, 0.0}), InvalidArgument);  // scale
  EXPECT_THROW(engine.submit({block}, 2, 20, linalg::RootSpec{0.0, 0.0, 1.0}, -1.0), InvalidArgument);
  engine.submit({block}, 2, 20, linalg::RootSpec{0.0, 0.0, 1.0});  // exponent and eps do not apply
  engine.begin_snapshot({block}, 3, 1s);
  fill_diagonal(rings.snapshot(3), kN, 1.0f);
  EXPECT_THROW(engine.submit({block}, 3, 19, linalg::RootSpec{0.0, 0.0, 1.0}), InvalidArgument);  // step order
  engine.submit({block}, 3, 20, linalg::RootSpec{0.0, 0.0, 1.0});
  engine.drain(5s);
  EXPECT_EQ(engine.stats().refreshes_ok, 2u);
}

}  // namespace
}  // namespace asteria::runtime
