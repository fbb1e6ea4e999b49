// The engine's hold on the memory it is handed: blocks on disjoint buffers only, and snapshot claims that are
// all or nothing, so that a call that failed (a timeout, a bad argument) can be made again.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include "asteria/common/errors.h"
#include "asteria/runtime/refresh_engine.h"
#include "rings.h"

namespace asteria::runtime {
namespace {

using namespace std::chrono_literals;

using test_support::fill_diagonal;
using test_support::Rings;

EngineConfig config(int workers) {
  EngineConfig c;
  c.workers = workers;
  c.registry.staleness = 200;
  c.slot_timeout = 5s;
  return c;
}

const linalg::RootSpec kSpec{-0.5, 1e-12, 1.0};

std::string refusal(RefreshEngine& engine, const BlockMemory& memory) {
  try {
    engine.add_block(memory);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(accepted)";
}

TEST(BlockMemory, BlocksOnOverlappingBuffersAreRefusedByName) {
  RefreshEngine engine(config(1));
  constexpr int kN = 4, kDepth = 2;
  Rings rings(kDepth, kN);
  const BlockMemory memory = rings.memory(kDepth);
  EXPECT_EQ(engine.add_block(memory), 0);
  std::string message = refusal(engine, memory);  // the same memory again
  EXPECT_NE(message.find("Invalid block memory: block 1's snapshot buffer 0"), std::string::npos) << message;
  EXPECT_NE(message.find("overlaps block 0's snapshot buffer 0"), std::string::npos) << message;
  // A block's snapshots over its own results, the next result buffer half over the snapshots of another block.
  Rings other(kDepth, kN);
  BlockMemory own = other.memory(kDepth);
  own.results = own.snapshots + kN * kN;
  message = refusal(engine, own);
  EXPECT_NE(message.find("block 1's snapshot buffer 1"), std::string::npos) << message;
  EXPECT_NE(message.find("overlaps block 1's result buffer 0"), std::string::npos) << message;
  BlockMemory shifted = other.memory(kDepth);
  shifted.results = rings.snapshots.data() + kN * kN / 2;
  message = refusal(engine, shifted);
  EXPECT_NE(message.find("block 1's result buffer 0"), std::string::npos) << message;
  EXPECT_NE(message.find("overlaps block 0's snapshot buffer"), std::string::npos) << message;
  EXPECT_EQ(engine.num_blocks(), 1);  // nothing of the refused blocks stayed
  EXPECT_EQ(engine.add_block(other.memory(kDepth)), 1);
}

TEST(BlockMemory, InterleavedRingsOfManyBlocksAreDisjoint) {
  // The layout the Python layer hands over: (depth, blocks, n * n) per set, block b's ring strided by blocks.
  constexpr int kN = 3, kDepth = 3, kBlocks = 4;
  std::vector<float> snapshots(kDepth * kBlocks * kN * kN), results(snapshots.size());
  RefreshEngine engine(config(1));
  for (int b = 0; b < kBlocks; ++b) {
    const std::int64_t stride = static_cast<std::int64_t>(kBlocks) * kN * kN;
    engine.add_block(BlockMemory{kN, kDepth, snapshots.data() + b * kN * kN, stride, results.data() + b * kN * kN,
                                 stride});
  }
  EXPECT_EQ(engine.num_blocks(), kBlocks);
}

TEST(BlockMemory, AFailedSnapshotClaimGivesBackTheClaimsBeforeIt) {
  constexpr int kN = 4;
  RefreshEngine engine(config(2));
  Rings a_rings(1, kN), b_rings(1, kN);
  const auto a = engine.add_block(a_rings.memory(1));
  const auto b = engine.add_block(b_rings.memory(1));
  // Version 1 of both; b's job pauses while it holds b's only snapshot buffer.
  engine.inject_fault(b, 1, FaultKind::kPause);
  engine.begin_snapshot({a, b}, 1, 1s);
  fill_diagonal(a_rings.snapshot(1, 1), kN, 4.0f);
  fill_diagonal(b_rings.snapshot(1, 1), kN, 4.0f);
  engine.submit({a}, 1, 1, kSpec);
  engine.submit({b}, 1, 2, kSpec);
  engine.wait_paused(1, 5s);
  ASSERT_EQ(engine.activate(1, 5s).size(), 1u);  // a's job is done with its snapshot
  engine.release(a, 1);
  // a's buffer is free, b's is not: the claim times out on b, and gives a's back.
  EXPECT_THROW(engine.begin_snapshot({a, b}, 2, 20ms), TimeoutError);
  EXPECT_THROW(engine.begin_snapshot({a, a}, 2, 1s), InvalidArgument);  // listed twice: a's first claim given back
  EXPECT_THROW(engine.begin_snapshot({a, 7}, 2, 1s), InvalidArgument);  // a bad id after a good one
  engine.release_pauses();
  ASSERT_EQ(engine.activate(2, 5s).size(), 1u);
  engine.release(b, 1);
  engine.begin_snapshot({a, b}, 2, 1s);  // the same call again: before, a's buffer stayed claimed and this threw
  fill_diagonal(a_rings.snapshot(2, 1), kN, 16.0f);
  fill_diagonal(b_rings.snapshot(2, 1), kN, 16.0f);
  engine.submit({a, b}, 2, 3, kSpec);
  const auto changes = engine.activate(3, 5s);
  EXPECT_EQ(changes.size(), 2u);
  for (const auto& change : changes) EXPECT_EQ(change.version, 2);
  EXPECT_NEAR(a_rings.result(2, 1)[0], 0.25f, 1e-6f);  // (16)^(-1/2)
  EXPECT_NEAR(b_rings.result(2, 1)[0], 0.25f, 1e-6f);
}

TEST(BlockMemory, AClaimNotSubmittedCanBeAbandoned) {
  constexpr int kN = 2;
  RefreshEngine engine(config(1));
  Rings rings(2, kN), other(2, kN);
  const auto block = engine.add_block(rings.memory(2));
  const auto spare = engine.add_block(other.memory(2));
  engine.begin_snapshot({block}, 1, 1s);
  EXPECT_THROW(engine.abandon_snapshot({block, spare}, 1), InvalidArgument);  // spare claimed nothing
  EXPECT_THROW(engine.abandon_snapshot({block, block}, 1), InvalidArgument);
  EXPECT_THROW(engine.abandon_snapshot({block}, 2), InvalidArgument);
  engine.abandon_snapshot({block}, 1);  // (the refused calls above changed nothing)
  EXPECT_THROW(engine.submit({block}, 1, 1, kSpec), InvalidArgument);  // no longer claimed
  engine.begin_snapshot({block}, 1, 1s);
  fill_diagonal(rings.snapshot(1, 2), kN, 9.0f);
  engine.submit({block}, 1, 1, kSpec);
  EXPECT_THROW(engine.abandon_snapshot({block}, 1), InvalidArgument);  // submitted
  ASSERT_EQ(engine.activate(1, 5s).size(), 1u);
  EXPECT_NEAR(rings.result(1, 2)[0], 1.0f / 3.0f, 1e-6f);
}

}  // namespace
}  // namespace asteria::runtime
