// The order in which the engine's workers take queued refreshes (EngineConfig::queue_order).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>

#include "asteria/runtime/refresh_engine.h"
#include "rings.h"

namespace asteria::runtime {
namespace {

using namespace std::chrono_literals;

using test_support::Rings;
using test_support::submit_diagonal;

struct Order {
  QueueOrder queue_order;
  bool deterministic;
  int sync_versions;
};

// One worker, held by a paused job. A large block's version 1 is queued (activation step 11), then a small
// block's version 1 (activation step 20, paused when it starts). Returns whether the large block's version
// had ended by the time the small block's job started.
bool large_ran_before_small(Order order) {
  constexpr int kDepth = 2;
  EngineConfig config;
  config.workers = 1;
  config.registry.staleness = 3;
  config.registry.deterministic = order.deterministic;
  config.registry.sync_versions = order.sync_versions;
  config.queue_order = order.queue_order;
  config.slot_timeout = 5s;
  RefreshEngine engine(config);
  Rings held_rings(kDepth, 4), large_rings(kDepth, 24), small_rings(kDepth, 4);
  const auto held = engine.add_block(held_rings.memory(kDepth));
  const auto large = engine.add_block(large_rings.memory(kDepth));
  const auto small = engine.add_block(small_rings.memory(kDepth));
  engine.inject_fault(held, 1, FaultKind::kPause);
  engine.inject_fault(small, 1, FaultKind::kPause);
  submit_diagonal(engine, held, held_rings, kDepth, 1, 4.0f);
  engine.wait_paused(1, 5s);  // the only worker now waits inside the held job
  submit_diagonal(engine, large, large_rings, kDepth, 11, 4.0f);
  submit_diagonal(engine, small, small_rings, kDepth, 20, 4.0f);
  engine.release_pauses();
  engine.wait_paused(1, 5s);  // the small block's job has started: the jobs before it in the queue have ended
  const bool large_first = engine.status(large).newest_ok == 1;
  engine.release_pauses();
  engine.drain(5s);
  EXPECT_EQ(engine.status(large).newest_ok, 1);
  EXPECT_EQ(engine.status(small).newest_ok, 1);
  return large_first;
}

TEST(QueueOrder, ShortestRunsASmallBlocksBackgroundVersionBeforeALargerOneQueuedEarlier) {
  EXPECT_FALSE(large_ran_before_small({QueueOrder::kShortest, /*deterministic=*/false, /*sync_versions=*/0}));
}

TEST(QueueOrder, DeadlineRunsByActivationStep) {
  EXPECT_TRUE(large_ran_before_small({QueueOrder::kDeadline, /*deterministic=*/false, /*sync_versions=*/0}));
}

TEST(QueueOrder, ShortestKeepsTheDeadlineForVersionsThatAreWaitedFor) {
  // The deterministic rule waits for every version at its activation step; the newest-finished rule waits
  // for versions 1..sync_versions.
  EXPECT_TRUE(large_ran_before_small({QueueOrder::kShortest, /*deterministic=*/true, /*sync_versions=*/0}));
  EXPECT_TRUE(large_ran_before_small({QueueOrder::kShortest, /*deterministic=*/false, /*sync_versions=*/1}));
}

}  // namespace
}  // namespace asteria::runtime
