// The refresh engine end to end: snapshots in, roots out, activation by schedule, failures kept.
#include "asteria/runtime/refresh_engine.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <vector>

#include "asteria/common/errors.h"

namespace asteria::runtime {
namespace {

using namespace std::chrono_literals;

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

void fill_diagonal(float* a, int n, float value) {
  for (int i = 0; i < n * n; ++i) a[i] = 0.0f;
  for (int i = 0; i < n; ++i) a[i * n + i] = value;
}

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
  EXPECT_THROW(engine.begin_snapshot({7}, 1, 1s), InvalidArgument);
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
  const auto stats = engine.stats();
  EXPECT_EQ(stats.pool.completed + stats.pool.cancelled, 16u);
}

}  // namespace
}  // namespace asteria::runtime
