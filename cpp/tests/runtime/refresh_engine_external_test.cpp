// The refresh engine's packed snapshots and its versions computed outside it (note_external): the same
// activation rule, staleness bound and failure count across both kinds of version.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "asteria/common/errors.h"
#include "asteria/linalg/eigenbasis.h"
#include "asteria/runtime/refresh_engine.h"

namespace asteria::runtime {
namespace {

using namespace std::chrono_literals;

EngineConfig config(bool deterministic, int staleness = 2) {
  EngineConfig c;
  c.workers = 2;
  c.registry.staleness = staleness;
  c.registry.deterministic = deterministic;
  c.slot_timeout = 5s;
  return c;
}

// A random symmetric positive definite n x n matrix (row-major).
std::vector<float> random_spd(int n, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  std::vector<float> g(static_cast<std::size_t>(n * n)), a(g.size(), 0.0f);
  for (float& x : g) x = normal(gen);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      for (int k = 0; k < n; ++k) a[i * n + j] += g[i * n + k] * g[j * n + k];
    }
    a[i * n + i] += 0.1f;
  }
  return a;
}

std::vector<float> lower_triangle(const std::vector<float>& a, int n) {
  std::vector<float> packed;
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j <= i; ++j) packed.push_back(a[i * n + j]);
  }
  return packed;
}

struct Memory {
  Memory(int depth, int n, bool packed, RefreshKind kind)
      : snapshot_elements(runtime::snapshot_elements(n, packed)),
        result_elements(static_cast<std::int64_t>(kind == RefreshKind::kEigenbasis ? n + 2 : n) * n),
        snapshots(static_cast<std::size_t>(depth * snapshot_elements)),
        results(static_cast<std::size_t>(depth * result_elements)),
        block{n, depth, snapshots.data(), snapshot_elements, results.data(), result_elements, kind, packed} {}
  float* snapshot(std::int64_t version) { return snapshots.data() + (version % block.depth) * snapshot_elements; }
  const float* result(std::int64_t version) const {
    return results.data() + (version % block.depth) * result_elements;
  }
  std::int64_t snapshot_elements;
  std::int64_t result_elements;
  std::vector<float> snapshots;
  std::vector<float> results;
  BlockMemory block;
};

// Version `version` of `block`, computed outside the engine and good, comes into use at step `version`.
void use_external(RefreshEngine& engine, std::int64_t block, std::int64_t version) {
  engine.note_external({block}, version, version);
  engine.finish_external({block}, version, {true}, "");
  ASSERT_EQ(engine.activate(version, 1s).size(), 1u);
  engine.release(block, version);
}

// Claims and fills `block`'s packed snapshot of `version` with a random SPD factor (seeded by the version).
void write_snapshot(RefreshEngine& engine, Memory& memory, std::int64_t block, std::int64_t version, int n) {
  engine.begin_snapshot({block}, version, 1s);
  const std::vector<float> lower = lower_triangle(random_spd(n, static_cast<unsigned>(version)), n);
  std::copy(lower.begin(), lower.end(), memory.snapshot(version));
}

TEST(PackedSnapshots, GiveTheSameResultsAsFullOnes) {
  constexpr int kN = 7;
  for (const RefreshKind kind : {RefreshKind::kInverseRoot, RefreshKind::kEigenbasis}) {
    RefreshEngine engine(config(/*deterministic=*/true));
    Memory full(2, kN, /*packed=*/false, kind), packed(2, kN, /*packed=*/true, kind);
    const auto a = engine.add_block(full.block), b = engine.add_block(packed.block);
    for (std::int64_t version = 1; version <= 2; ++version) {  // the second is an eigenbasis chain's QR refresh
      const std::vector<float> factor = random_spd(kN, static_cast<unsigned>(version));
      engine.begin_snapshot({a, b}, version, 1s);
      std::copy(factor.begin(), factor.end(), full.snapshot(version));
      const std::vector<float> lower = lower_triangle(factor, kN);
      std::copy(lower.begin(), lower.end(), packed.snapshot(version));
      engine.submit({a, b}, version, version, linalg::RootSpec{-0.25, 1e-6, 1.0});
      engine.drain(5s);
      ASSERT_EQ(engine.activate(version, 1s).size(), 2u);
      for (std::int64_t i = 0; i < full.result_elements; ++i) {
        ASSERT_EQ(full.result(version)[i], packed.result(version)[i]) << "element " << i << " of version " << version;
      }
      engine.release(a, version);
      engine.release(b, version);
    }
  }
}

TEST(PackedSnapshots, AreHalfTheMemory) {
  EXPECT_EQ(snapshot_elements(4, /*packed=*/true), 10);
  EXPECT_EQ(snapshot_elements(4, /*packed=*/false), 16);
}

TEST(ExternalVersions, ActivateBesideTheWorkersOwn) {
  for (const bool deterministic : {true, false}) {
    RefreshEngine engine(config(deterministic));
    Memory memory(1, 4, /*packed=*/true, RefreshKind::kInverseRoot);
    const auto block = engine.add_block(memory.block);
    engine.note_external({block}, 1, /*activation_step=*/1);
    EXPECT_THROW(engine.activate(1, 10ms), TimeoutError);  // due (or, newest-finished: the first) and not done
    engine.finish_external({block}, 1, {true}, "");
    auto changes = engine.activate(1, 1s);
    ASSERT_EQ(changes.size(), 1u);
    EXPECT_EQ(changes[0].version, 1);
    engine.release(block, 1);  // not pinned: release only retires it
    // The next version on the workers, in the one buffer the ring has.
    engine.begin_snapshot({block}, 2, 1s);
    const std::vector<float> lower = lower_triangle(random_spd(4, 3), 4);
    std::copy(lower.begin(), lower.end(), memory.snapshot(2));
    engine.submit({block}, 2, 11, linalg::RootSpec{-0.25, 1e-6, 1.0});
    engine.drain(5s);
    changes = engine.activate(11, 1s);
    ASSERT_EQ(changes.size(), 1u);
    EXPECT_EQ(changes[0].version, 2);
    engine.release(block, 2);
    const EngineStats stats = engine.stats();
    EXPECT_EQ(stats.refreshes_ok, 2u);
    EXPECT_EQ(stats.external_versions, 1u);
    ASSERT_EQ(stats.by_dim.count(4), 1u);
    EXPECT_EQ(stats.by_dim.at(4).jobs, 1u);  // the workers' job only
    EXPECT_GT(stats.by_dim.at(4).seconds, 0.0);
  }
}

TEST(ExternalVersions, AFailureKeepsThePreviousVersionAndCounts) {
  EngineConfig c = config(/*deterministic=*/true);
  c.registry.max_consecutive_failures = 2;
  RefreshEngine engine(c);
  Memory memory(1, 4, /*packed=*/true, RefreshKind::kInverseRoot);
  const auto block = engine.add_block(memory.block);
  use_external(engine, block, 1);
  engine.note_external({block}, 2, 2);
  engine.finish_external({block}, 2, {false}, "non-finite result on the device");
  EXPECT_TRUE(engine.activate(2, 1s).empty());  // version 1 stays
  EXPECT_EQ(engine.status(block).active_version, 1);
  EXPECT_EQ(engine.status(block).last_error, "non-finite result on the device");
  engine.note_external({block}, 3, 3);
  engine.finish_external({block}, 3, {false}, "non-finite result on the device");
  EXPECT_THROW(engine.activate(3, 1s), BlockFailure);
  EXPECT_EQ(engine.stats().refreshes_failed, 2u);
}

TEST(ExternalVersions, HoldNoResultBufferThatTheWorkersNextVersionsWaitFor) {
  // A failed external version is never activated, so nothing retires it. The worker's version a ring's depth
  // later must still get its buffer; before, its job waited out slot_timeout while the training thread waited
  // for that job.
  constexpr int kN = 4;
  RefreshEngine engine(config(/*deterministic=*/false));
  Memory memory(2, kN, /*packed=*/true, RefreshKind::kInverseRoot);
  const auto block = engine.add_block(memory.block);
  use_external(engine, block, 1);
  engine.note_external({block}, 2, 2);
  engine.finish_external({block}, 2, {false}, "non-finite result on the device");
  engine.skip({block}, 3);  // deferred while version 2 was in flight
  write_snapshot(engine, memory, block, 4, kN);
  engine.submit({block}, 4, 4, linalg::RootSpec{-0.25, 1e-6, 1.0});
  engine.drain(5s);
  EXPECT_EQ(engine.status(block).newest_finished, 4);
  const auto changes = engine.activate(4, 1s);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_EQ(changes[0].version, 4);
  engine.release(block, 4);
  EXPECT_EQ(engine.stats().refreshes_failed, 1u);
  EXPECT_EQ(engine.status(block).active_version, 4);
}

TEST(ExternalVersions, ADeferredOrRetiredVersionIsRefusedBeforeAnythingChanges) {
  RefreshEngine engine(config(/*deterministic=*/true));
  Memory first(2, 4, /*packed=*/true, RefreshKind::kInverseRoot);
  Memory second(2, 4, /*packed=*/true, RefreshKind::kInverseRoot);
  const auto a = engine.add_block(first.block), b = engine.add_block(second.block);
  engine.start_at({b}, 5);  // b's versions before 5 are retired (a resumed run)
  EXPECT_THROW(engine.note_external({a, b}, 3, 3), InvalidArgument);
  EXPECT_EQ(engine.status(a).newest_snapshot, 0);  // neither block was touched
  EXPECT_EQ(engine.stats().external_versions, 0u);
  engine.skip({a}, 5);  // deferred
  EXPECT_THROW(engine.note_external({a}, 5, 5), InvalidArgument);
  engine.note_external({a, b}, 6, 6);
  engine.finish_external({a, b}, 6, {true, true}, "");
  EXPECT_EQ(engine.activate(6, 1s).size(), 2u);
}

TEST(ExternalVersions, OnePassedOverWhileItComputesMayStillEnd) {
  // Version 2 still computes outside the engine when version 3 (ended first) comes into use: 2's end is
  // counted, not refused (the caller's thread that reported it would die, and its later versions with it).
  RefreshEngine engine(config(/*deterministic=*/false));
  Memory memory(2, 4, /*packed=*/true, RefreshKind::kInverseRoot);
  const auto block = engine.add_block(memory.block);
  use_external(engine, block, 1);
  engine.note_external({block}, 2, 2);
  engine.note_external({block}, 3, 3);
  engine.finish_external({block}, 3, {true}, "");
  ASSERT_EQ(engine.activate(3, 1s).size(), 1u);
  engine.release(block, 3);
  engine.finish_external({block}, 2, {true}, "");
  EXPECT_EQ(engine.stats().refreshes_ok, 3u);
  EXPECT_THROW(engine.finish_external({block}, 2, {true}, ""), InvalidArgument);  // once only
  use_external(engine, block, 4);
  EXPECT_EQ(engine.status(block).active_version, 4);
}

TEST(ExternalVersions, AreRefusedOutOfOrderOrUnknown) {
  RefreshEngine engine(config(/*deterministic=*/true));
  Memory memory(1, 4, /*packed=*/false, RefreshKind::kInverseRoot);
  const auto block = engine.add_block(memory.block);
  engine.note_external({block}, 2, 2);
  EXPECT_THROW(engine.note_external({block}, 2, 3), InvalidArgument);
  EXPECT_THROW(engine.note_external({block + 1}, 3, 3), InvalidArgument);
  EXPECT_THROW(engine.finish_external({block}, 1, {true}, ""), InvalidArgument);   // never noted
  EXPECT_THROW(engine.finish_external({block}, 2, {true, true}, ""), InvalidArgument);  // one flag per block
  EXPECT_THROW(engine.note_external({block}, 3, -1), InvalidArgument);
}

TEST(ExternalVersions, AnEigenbasisChainNeedsItsBasisBeforeTheWorkersGoOn) {
  constexpr int kN = 4;
  RefreshEngine engine(config(/*deterministic=*/true));
  Memory memory(1, kN, /*packed=*/true, RefreshKind::kEigenbasis);
  const auto block = engine.add_block(memory.block);
  use_external(engine, block, 1);
  write_snapshot(engine, memory, block, 2, kN);
  EXPECT_THROW(engine.submit({block}, 2, 2, linalg::RootSpec{}), InvalidArgument);
  std::vector<float> identity(kN * kN, 0.0f);
  for (int i = 0; i < kN; ++i) identity[i * kN + i] = 1.0f;
  identity[0] = 0.0f;  // not exactly the identity: a real basis to warm-start from
  identity[1] = 1.0f;
  identity[kN] = 1.0f;
  identity[kN + 1] = 0.0f;
  engine.set_basis(block, 1, identity.data());
  engine.submit({block}, 2, 2, linalg::RootSpec{});
  engine.drain(5s);
  ASSERT_EQ(engine.activate(2, 1s).size(), 1u);
  engine.release(block, 2);
}

// A basis a warm start can tell from the identity: an eigenbasis of another factor.
std::vector<float> some_basis(int n, unsigned seed) {
  std::vector<float> out(static_cast<std::size_t>(n + 2) * n);
  linalg::eigenbasis(n, random_spd(n, seed).data(), out.data(), out.data() + n * n, 1.0);
  return std::vector<float>(out.begin(), out.begin() + n * n);
}

TEST(ExternalVersions, SeedBasisHandsTheChainTheBasisInTheNextVersionsResultBuffer) {
  // The lane computed versions 1 and 2; version 3 goes back to the workers, its warm start (version 2's basis)
  // written into version 3's result buffer instead of passed: the result has the bits set_basis gives.
  constexpr int kN = 6;
  for (const int depth : {1, 2}) {
    std::vector<float> results[2];
    for (const bool seeded : {false, true}) {
      RefreshEngine engine(config(/*deterministic=*/false));
      Memory memory(depth, kN, /*packed=*/true, RefreshKind::kEigenbasis);
      const auto block = engine.add_block(memory.block);
      use_external(engine, block, 1);
      use_external(engine, block, 2);
      const std::vector<float> basis = some_basis(kN, 40);
      write_snapshot(engine, memory, block, 3, kN);
      if (seeded) {
        EXPECT_THROW(engine.seed_basis(block, 2, 2), InvalidArgument);  // next must come after the version
        engine.seed_basis(block, 2, 3);
        std::copy(basis.begin(), basis.end(), memory.results.data() + (3 % depth) * memory.result_elements);
      } else {
        engine.set_basis(block, 2, basis.data());
      }
      engine.submit({block}, 3, 3, linalg::RootSpec{});
      engine.drain(5s);
      ASSERT_EQ(engine.activate(3, 1s).size(), 1u);
      const float* result = memory.result(3);
      results[seeded].assign(result, result + kN * kN);
      engine.release(block, 3);
    }
    EXPECT_EQ(results[0], results[1]) << "depth " << depth;
    EXPECT_NE(results[0], some_basis(kN, 40));  // (refreshed from it, not it)
  }
}

TEST(ExternalVersions, AClosedEngineRefusesABasisAndASeed) {
  constexpr int kN = 4;
  RefreshEngine engine(config(/*deterministic=*/false));
  Memory memory(1, kN, /*packed=*/true, RefreshKind::kEigenbasis);
  const auto block = engine.add_block(memory.block);
  use_external(engine, block, 1);
  const std::vector<float> basis = some_basis(kN, 41);
  engine.close();
  EXPECT_THROW(engine.set_basis(block, 1, basis.data()), CancelledError);
  EXPECT_THROW(engine.seed_basis(block, 1, 2), CancelledError);
}

TEST(ExternalVersions, ASeededJobSupersededBeforeItStartsHandsItsSeedToTheNext) {
  // The one worker is held by another block's job while the seeded version 2 and then version 3 queue: 2 is
  // superseded when it starts, and 3 warm-starts from the seed in 2's buffer.
  constexpr int kN = 6;
  EngineConfig one_worker = config(/*deterministic=*/false);
  one_worker.workers = 1;
  RefreshEngine engine(one_worker);
  Memory held_memory(1, kN, /*packed=*/true, RefreshKind::kInverseRoot), memory(2, kN, true, RefreshKind::kEigenbasis);
  const auto held = engine.add_block(held_memory.block);
  const auto block = engine.add_block(memory.block);
  use_external(engine, block, 1);
  engine.inject_fault(held, 1, FaultKind::kPause);
  write_snapshot(engine, held_memory, held, 1, kN);
  engine.submit({held}, 1, 10, linalg::RootSpec{-0.25, 1e-6, 1.0});
  const std::vector<float> basis = some_basis(kN, 42);
  engine.wait_paused(1, 5s);  // the only worker now waits inside that job
  write_snapshot(engine, memory, block, 2, kN);
  engine.seed_basis(block, 1, 2);
  std::copy(basis.begin(), basis.end(), memory.results.data() + (2 % 2) * memory.result_elements);
  engine.submit({block}, 2, 2, linalg::RootSpec{});
  write_snapshot(engine, memory, block, 3, kN);
  engine.submit({block}, 3, 3, linalg::RootSpec{});
  engine.release_pauses();
  engine.drain(5s);
  EXPECT_EQ(engine.stats().refreshes_superseded, 1u);
  const std::vector<float> factor = random_spd(kN, 3);  // version 3's snapshot (write_snapshot)
  std::vector<float> expected(static_cast<std::size_t>(kN + 2) * kN);
  linalg::qr_refresh(kN, factor.data(), basis.data(), expected.data(), expected.data() + kN * kN,
                     expected.data() + (kN + 1) * kN, 1.0, 0.0);
  const float* result = memory.result(3);
  EXPECT_EQ(std::vector<float>(result, result + kN * kN), std::vector<float>(expected.begin(), expected.begin() + kN * kN));
}

TEST(ExternalVersions, ASeedMustBeFollowedByItsVersionAndANonFiniteOneFailsThatJob) {
  constexpr int kN = 4;
  RefreshEngine engine(config(/*deterministic=*/false));
  Memory memory(1, kN, /*packed=*/true, RefreshKind::kEigenbasis);
  const auto block = engine.add_block(memory.block);
  use_external(engine, block, 1);
  write_snapshot(engine, memory, block, 2, kN);
  engine.seed_basis(block, 1, 3);
  EXPECT_THROW(engine.submit({block}, 2, 2, linalg::RootSpec{}), InvalidArgument);  // seeded for version 3
  engine.seed_basis(block, 1, 2);  // a seed may be given again while no job runs
  std::vector<float> basis = some_basis(kN, 41);
  basis[5] = NAN;
  std::copy(basis.begin(), basis.end(), memory.results.data());
  engine.submit({block}, 2, 2, linalg::RootSpec{});
  engine.drain(5s);
  EXPECT_TRUE(engine.activate(2, 1s).empty());  // version 1 stays in use
  EXPECT_EQ(engine.stats().refreshes_failed, 1u);
  EXPECT_NE(engine.status(block).last_error.find("seed_basis is not finite"), std::string::npos);
  RefreshEngine other(config(/*deterministic=*/false));
  Memory roots(1, kN, /*packed=*/true, RefreshKind::kInverseRoot);
  EXPECT_THROW(other.seed_basis(other.add_block(roots.block), 1, 2), InvalidArgument);  // a root has no basis
}

}  // namespace
}  // namespace asteria::runtime
