// Fault injection into the refresh engine's worker jobs: each fault runs the real failure path
// (exception capture, result buffer failed, last good version kept, counters, BlockFailure,
// timeouts, close() during a job). No sleeps in the test logic: jobs are awaited through the
// engine's own bounded waits, and the only clock reads check that a delay happened inside a job
// or that close() did not wait for a hang.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "asteria/common/clock.h"
#include "asteria/common/errors.h"
#include "asteria/linalg/eigenbasis.h"
#include "asteria/runtime/refresh_engine.h"

namespace asteria::runtime {
namespace {

using namespace std::chrono_literals;

constexpr linalg::RootSpec kRoot{-0.5, 1e-12, 1.0};

EngineConfig engine_config(int workers = 1, int max_failures = 3, std::chrono::nanoseconds slot_timeout = 10s) {
  EngineConfig c;
  c.workers = workers;
  c.registry.staleness = 0;
  c.registry.max_consecutive_failures = max_failures;
  c.slot_timeout = slot_timeout;
  return c;
}

// One block's snapshot and result rings, (depth, rows, n) each, rows = n + 2 for an eigenbasis.
struct Block {
  Block(RefreshEngine& engine, int n, int depth, RefreshKind kind = RefreshKind::kInverseRoot)
      : n(n), depth(depth), rows(kind == RefreshKind::kEigenbasis ? n + 2 : n),
        snapshots(static_cast<std::size_t>(depth * n * n)), results(static_cast<std::size_t>(depth * rows * n)) {
    BlockMemory m{n, depth, snapshots.data(), static_cast<std::int64_t>(n) * n, results.data(),
                  static_cast<std::int64_t>(rows) * n};
    m.kind = kind;
    id = engine.add_block(m);
  }
  // Snapshots a well-conditioned SPD matrix (different per version) and submits it, due at `version`.
  void refresh(RefreshEngine& engine, std::int64_t version) {
    engine.begin_snapshot({id}, version, 5s);
    float* a = snapshots.data() + (version % depth) * n * n;
    std::mt19937 rng(static_cast<unsigned>(version));
    std::normal_distribution<float> normal;
    std::vector<float> g(static_cast<std::size_t>(n * n));
    for (float& x : g) x = normal(rng);
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) {
        double sum = i == j ? 1.0 : 0.0;
        for (int k = 0; k < n; ++k) sum += static_cast<double>(g[i * n + k]) * g[j * n + k] / n;
        a[i * n + j] = static_cast<float>(sum);
      }
    }
    engine.submit({id}, version, version, kRoot);
  }
  std::vector<float> result(std::int64_t version) const {
    const float* begin = results.data() + (version % depth) * rows * n;
    return {begin, begin + rows * n};
  }
  int n, depth, rows;
  std::vector<float> snapshots, results;
  std::int64_t id = -1;
};

bool all_finite(const std::vector<float>& x) {
  return std::all_of(x.begin(), x.end(), [](float v) { return std::isfinite(v); });
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(FaultInjection, ThrowFailsTheVersionKeepsTheLastGoodOneAndRaisesPastTheBound) {
  RefreshEngine engine(engine_config(/*workers=*/2, /*max_failures=*/2));
  Block block(engine, 6, /*depth=*/4);  // version 1 stays pinned: later versions use other buffers
  block.refresh(engine, 1);
  ASSERT_EQ(engine.activate(1, 5s).size(), 1u);
  const std::vector<float> good = block.result(1);
  engine.inject_fault(block.id, 2, FaultKind::kThrow);
  engine.inject_fault(block.id, 3, FaultKind::kThrow);
  block.refresh(engine, 2);
  EXPECT_TRUE(engine.activate(2, 5s).empty());  // version 2 failed: version 1 stays in use
  const auto status = engine.status(block.id);
  EXPECT_EQ(status.active_version, 1);
  EXPECT_EQ(status.consecutive_failures, 1);
  EXPECT_TRUE(contains(status.last_error, "block 0 version 2: injected worker exception")) << status.last_error;
  EXPECT_EQ(block.result(1), good);  // the pinned good version is untouched
  block.refresh(engine, 3);
  try {
    engine.activate(3, 5s);
    FAIL() << "expected BlockFailure";
  } catch (const BlockFailure& e) {
    EXPECT_EQ(e.block(), block.id);
    EXPECT_EQ(e.version(), 3);
    EXPECT_TRUE(contains(e.cause(), "injected worker exception")) << e.cause();
  }
  EXPECT_EQ(engine.status(block.id).active_version, 1);
  const auto stats = engine.stats();
  EXPECT_EQ(stats.faults_triggered, 2u);
  EXPECT_EQ(stats.refreshes_failed, 2u);
  EXPECT_EQ(stats.refreshes_ok, 1u);
  EXPECT_EQ(stats.pool.failed, 0u);  // the engine captured the exception inside its job
}

TEST(FaultInjection, NonFiniteResultIsRejectedByTheQualityGate) {
  RefreshEngine engine(engine_config());
  Block block(engine, 5, /*depth=*/1);
  engine.inject_fault(block.id, 1, FaultKind::kNonFinite);
  block.refresh(engine, 1);
  EXPECT_TRUE(engine.activate(1, 5s).empty());
  const auto status = engine.status(block.id);
  EXPECT_EQ(status.total_failures, 1);
  EXPECT_TRUE(contains(status.last_error, "not finite (quality gate)")) << status.last_error;
  // The fault fired once: the next version is computed and used.
  block.refresh(engine, 2);
  ASSERT_EQ(engine.activate(2, 5s).size(), 1u);
  EXPECT_TRUE(all_finite(block.result(2)));
  EXPECT_EQ(engine.status(block.id).consecutive_failures, 0);
}

TEST(FaultInjection, NonFiniteEigenbasisNeverBecomesTheChainsGoodBasis) {
  // Version 2 fails, by a poisoned result or by an exception before any numerics; either way
  // version 3 must warm-start from version 1's basis: were the poisoned basis kept as the chain's
  // warm start, version 3 would fail or differ.
  auto run = [](FaultKind fault) {
    RefreshEngine engine(engine_config());
    Block block(engine, 8, /*depth=*/4, RefreshKind::kEigenbasis);
    engine.inject_fault(block.id, 2, fault);
    for (std::int64_t version = 1; version <= 3; ++version) block.refresh(engine, version);
    engine.drain(5s);
    const auto status = engine.status(block.id);
    EXPECT_EQ(status.total_failures, 1);
    EXPECT_EQ(status.newest_ok, 3);
    return block.result(3);
  };
  const std::vector<float> poisoned = run(FaultKind::kNonFinite), thrown = run(FaultKind::kThrow);
  EXPECT_TRUE(all_finite(poisoned));
  EXPECT_EQ(std::memcmp(poisoned.data(), thrown.data(), poisoned.size() * sizeof(float)), 0);
}

TEST(FaultInjection, AnOlderEigenbasisJobNeverMovesTheChainBack) {
  // Under the newest-finished rule version 2 is superseded before it waits for version 1, which is still
  // computing, so version 3 ends first. Version 1 must then be passed over: warm-started from version 3's
  // basis and kept as the chain's, it would move the chain back, and version 4 would start from it.
  constexpr int kN = 8;
  EngineConfig config = engine_config(/*workers=*/2);
  config.registry.deterministic = false;
  config.registry.staleness = 10;
  RefreshEngine engine(config);
  Block root(engine, 2, /*depth=*/2);
  Block chain(engine, kN, /*depth=*/4, RefreshKind::kEigenbasis);
  engine.inject_fault(chain.id, 1, FaultKind::kPause);
  chain.refresh(engine, 1);
  engine.wait_paused(1, 10s);  // version 1 holds a worker, past its supersede checks
  engine.inject_fault(root.id, 1, FaultKind::kDelay, 300ms);
  root.refresh(engine, 1);  // (due first: the other worker takes it, and versions 2 and 3 queue behind it)
  chain.refresh(engine, 2);
  chain.refresh(engine, 3);
  const auto waited = Clock::now();  // (a bounded wait for version 3's end: no latch reaches into a job)
  while (engine.status(chain.id).newest_finished < 3 && seconds_since(waited) < 30.0) std::this_thread::yield();
  ASSERT_EQ(engine.status(chain.id).newest_ok, 3);
  engine.release_pauses();
  engine.drain(10s);
  chain.refresh(engine, 4);
  engine.drain(10s);
  const std::vector<float> v3 = chain.result(3), v4 = chain.result(4);
  const float* a4 = chain.snapshots.data() + (4 % chain.depth) * kN * kN;
  std::vector<float> q(kN * kN), estimates(kN), perm(kN);
  linalg::qr_refresh(kN, a4, v3.data(), q.data(), estimates.data(), perm.data(), kRoot.scale, 0.0);
  EXPECT_EQ(std::memcmp(v4.data(), q.data(), q.size() * sizeof(float)), 0) << "version 4 did not start from 3's basis";
  const auto stats = engine.stats();
  EXPECT_EQ(stats.refreshes_superseded, 2u);  // versions 2 and 1
  EXPECT_EQ(stats.refreshes_ok, 3u);           // the root's, versions 3 and 4
  EXPECT_EQ(engine.status(chain.id).newest_ok, 4);
}

TEST(FaultInjection, HangTimesOutTheActivationAndCloseEndsIt) {
  RefreshEngine engine(engine_config(/*workers=*/1, 3, /*slot_timeout=*/600s));
  Block block(engine, 4, /*depth=*/1);
  engine.inject_fault(block.id, 1, FaultKind::kHang);
  block.refresh(engine, 1);
  try {
    engine.activate(1, 50ms);
    FAIL() << "expected TimeoutError";
  } catch (const TimeoutError& e) {
    EXPECT_TRUE(contains(e.what(), "block 0")) << e.what();
  }
  const auto started = Clock::now();
  engine.close();  // must not wait for the hang's 600 s slot timeout
  EXPECT_LT(seconds_since(started), 30.0);
  const auto status = engine.status(block.id);
  EXPECT_EQ(status.total_failures, 1);
  EXPECT_TRUE(contains(status.last_error, "injected hang ended by close()")) << status.last_error;
}

TEST(FaultInjection, BoundedHangFailsAfterItsDuration) {
  RefreshEngine engine(engine_config(/*workers=*/1));
  Block block(engine, 4, /*depth=*/1);
  engine.inject_fault(block.id, 1, FaultKind::kHang, 20ms);
  block.refresh(engine, 1);
  EXPECT_TRUE(engine.activate(1, 30s).empty());  // the version failed; there is none to use
  EXPECT_TRUE(contains(engine.status(block.id).last_error, "injected hang ended after"))
      << engine.status(block.id).last_error;
}

TEST(FaultInjection, AVersionThatNeverClaimedItsBufferHoldsUpNoLaterOne) {
  // Version 2 of an eigenbasis chain gives up waiting for version 1 (hung) before it claims its result
  // buffer. Nothing fails or retires it there, so version 4, the next in that buffer (version 3 was
  // deferred), waited for it until slot_timeout and failed too, and so on down the ring.
  RefreshEngine engine(engine_config(/*workers=*/2, /*max_failures=*/10, /*slot_timeout=*/300ms));
  Block block(engine, 4, /*depth=*/2, RefreshKind::kEigenbasis);
  engine.inject_fault(block.id, 1, FaultKind::kHang, 600ms);
  block.refresh(engine, 1);
  block.refresh(engine, 2);
  engine.drain(5s);
  EXPECT_EQ(engine.status(block.id).newest_finished, 2);
  EXPECT_EQ(engine.status(block.id).newest_ok, 0);  // both failed: version 1 hung, version 2 gave up on it
  engine.skip({block.id}, 3);
  block.refresh(engine, 4);
  engine.drain(5s);
  const auto status = engine.status(block.id);
  EXPECT_EQ(status.newest_ok, 4) << status.last_error;
  EXPECT_TRUE(all_finite(block.result(4)));
}

TEST(FaultInjection, DelayHappensInsideTheJobAndCloseCutsItShort) {
  RefreshEngine engine(engine_config());
  Block block(engine, 4, /*depth=*/2);
  engine.inject_fault(block.id, 1, FaultKind::kDelay, 100ms);
  const auto submitted = Clock::now();
  block.refresh(engine, 1);
  // A delayed job still succeeds, and the caller's barrier waited for the worker that slept. (The pool's
  // run-time statistics are recorded after the job has published, so they may lag the barrier.)
  ASSERT_EQ(engine.activate(1, 30s).size(), 1u);
  EXPECT_GE(seconds_since(submitted), 0.1);
  engine.release(block.id, 1);
  EXPECT_EQ(engine.stats().refreshes_ok, 1u);

  engine.inject_fault(block.id, 2, FaultKind::kDelay, 600s);
  block.refresh(engine, 2);
  const auto started = Clock::now();
  engine.close();
  EXPECT_LT(seconds_since(started), 30.0);
}

TEST(FaultInjection, AnyVersionFaultsPersistUntilClearedAndExactOnesTakePrecedence) {
  RefreshEngine engine(engine_config(/*workers=*/1, /*max_failures=*/10));
  Block block(engine, 4, /*depth=*/1);
  engine.inject_fault(block.id, kAnyVersion, FaultKind::kThrow);
  engine.inject_fault(block.id, 2, FaultKind::kNonFinite);
  for (std::int64_t version = 1; version <= 3; ++version) {
    block.refresh(engine, version);
    EXPECT_TRUE(engine.activate(version, 5s).empty());
  }
  auto status = engine.status(block.id);
  EXPECT_EQ(status.consecutive_failures, 3);
  EXPECT_TRUE(contains(status.last_error, "injected worker exception"));  // version 3: the any-version fault
  engine.clear_faults();
  block.refresh(engine, 4);
  EXPECT_EQ(engine.activate(4, 5s).size(), 1u);
  EXPECT_EQ(engine.stats().faults_triggered, 3u);
}

TEST(FaultInjection, RandomDelaysDoNotChangeResults) {
  auto run = [](bool delays) {
    RefreshEngine engine(engine_config(/*workers=*/3));
    if (delays) engine.set_random_delay(5ms, /*seed=*/42);
    std::vector<Block> blocks;
    blocks.reserve(4);
    for (int i = 0; i < 4; ++i) blocks.emplace_back(engine, 6, /*depth=*/4);
    std::vector<float> out;
    for (std::int64_t version = 1; version <= 3; ++version) {
      for (Block& b : blocks) b.refresh(engine, version);
    }
    engine.drain(30s);
    for (const Block& b : blocks) {
      const auto r = b.result(3);
      out.insert(out.end(), r.begin(), r.end());
    }
    EXPECT_EQ(engine.stats().faults_triggered, delays ? 12u : 0u);
    EXPECT_EQ(engine.stats().refreshes_ok, 12u);
    return out;
  };
  const auto plain = run(false), delayed = run(true);
  EXPECT_EQ(std::memcmp(plain.data(), delayed.data(), plain.size() * sizeof(float)), 0);
}

TEST(FaultInjection, RejectsBadArguments) {
  RefreshEngine engine(engine_config());
  Block block(engine, 2, 1);
  EXPECT_THROW(engine.inject_fault(7, 1, FaultKind::kThrow), InvalidArgument);
  EXPECT_THROW(engine.inject_fault(block.id, -1, FaultKind::kThrow), InvalidArgument);
  EXPECT_THROW(engine.inject_fault(block.id, 1, FaultKind::kDelay), InvalidArgument);  // no duration
  EXPECT_THROW(engine.inject_fault(block.id, 1, FaultKind::kHang, -1s), InvalidArgument);
  EXPECT_THROW(engine.inject_fault(block.id, 1, FaultKind::kNonFinite, 1s), InvalidArgument);
  EXPECT_THROW(engine.inject_fault(block.id, 1, static_cast<FaultKind>(9)), InvalidArgument);
  EXPECT_THROW(engine.set_random_delay(-1ms, 0), InvalidArgument);
  try {
    engine.inject_fault(block.id, 1, FaultKind::kThrow, 5ms);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(contains(e.what(), "Invalid duration=5000000 ns")) << e.what();
  }
}

}  // namespace
}  // namespace asteria::runtime
