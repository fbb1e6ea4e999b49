#include "asteria/coherence/registry.h"

#include <gtest/gtest.h>

#include <future>
#include <numeric>
#include <thread>
#include <utility>
#include <vector>

#include "asteria/common/errors.h"

namespace asteria::coherence {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using ::testing::IsSubstring;
using Changes = std::vector<std::pair<std::int64_t, std::int64_t>>;  // (block, version)

constexpr auto kLongWait = seconds(30);  // only hit if the code under test hangs

RegistryConfig deterministic(int staleness, int max_consecutive_failures = 3) {
  return RegistryConfig{.staleness = staleness, .deterministic = true,
                        .max_consecutive_failures = max_consecutive_failures};
}

RegistryConfig nondeterministic(int staleness, int sync_versions = 1) {
  return RegistryConfig{.staleness = staleness, .deterministic = false, .max_consecutive_failures = 3,
                        .sync_versions = sync_versions};
}

Changes activate(CoherenceRegistry& registry, std::int64_t step,
                 std::chrono::nanoseconds timeout = std::chrono::nanoseconds(0)) {
  Changes changes;
  for (const Activation& a : registry.activate(step, timeout)) changes.emplace_back(a.block, a.version);
  return changes;
}

// Returns once `registry` has counted `waits` blocking activate() calls. The count goes up while the
// registry's lock is held and the lock is only given up inside the wait, so a caller that sees it is
// ordered after the activate() call has started waiting.
void await_blocked_activate(const CoherenceRegistry& registry, std::uint64_t waits) {
  while (registry.stats().waits < waits) std::this_thread::yield();
}

std::uint64_t histogram_total(const RegistryStats& stats) {
  return std::accumulate(stats.staleness_histogram.begin(), stats.staleness_histogram.end(), std::uint64_t{0});
}

TEST(CoherenceRegistryTest, DeterministicActivatesExactlyAtTheActivationStep) {
  CoherenceRegistry registry(deterministic(2));
  const std::int64_t b = registry.add_block();
  registry.note_snapshot(b, 1, 10);
  registry.note_finished(b, 1, true);
  registry.note_snapshot(b, 2, 20);
  registry.note_finished(b, 2, true);  // long before it is due

  for (std::int64_t step = 0; step < 10; ++step) EXPECT_EQ(activate(registry, step), Changes{}) << step;
  EXPECT_EQ(activate(registry, 10), (Changes{{b, 1}}));
  for (std::int64_t step = 11; step < 20; ++step) EXPECT_EQ(activate(registry, step), Changes{}) << step;
  EXPECT_EQ(activate(registry, 20), (Changes{{b, 2}}));
  EXPECT_EQ(activate(registry, 21), Changes{});

  const BlockStatus status = registry.status(b);
  EXPECT_EQ(status.active_version, 2);
  EXPECT_EQ(status.newest_snapshot, 2);
  EXPECT_EQ(status.newest_finished, 2);
  EXPECT_EQ(status.newest_ok, 2);
  const RegistryStats stats = registry.stats();
  EXPECT_EQ(stats.activations, 2u);
  EXPECT_EQ(stats.waits, 0u);
  EXPECT_EQ(stats.skipped_versions, 0u);
}

TEST(CoherenceRegistryTest, AResumedBlockCountsItsStalenessFromTheVersionInUse) {
  // A run resumed from a checkpoint: block a uses version 30 and has 31 in flight; block b already uses
  // 32 (the non-deterministic rule took it earlier), so the older 31 snapshotted for its set is stale.
  CoherenceRegistry registry(nondeterministic(/*staleness=*/2));
  const std::int64_t a = registry.add_block(), b = registry.add_block();
  registry.resume_at({a, b}, {30, 32});
  registry.note_snapshot(a, 31, 310);
  registry.note_snapshot(b, 31, 310);
  EXPECT_EQ(activate(registry, 305), Changes{});
  EXPECT_EQ(registry.stats().max_staleness_seen, 1);  // not 31: counted from 30, and never below 0
  registry.note_finished(a, 31, true);
  registry.note_finished(b, 31, true);
  EXPECT_EQ(activate(registry, 310), (Changes{{a, 31}}));  // b keeps its newer version
  EXPECT_EQ(registry.status(b).active_version, 32);
  EXPECT_EQ(registry.stats().max_staleness_seen, 1);
  EXPECT_THROW(registry.resume_at({a}, {40}), InvalidArgument);  // versions were noted
  CoherenceRegistry fresh(deterministic(1));
  const std::int64_t c = fresh.add_block(), d = fresh.add_block();
  EXPECT_THROW(fresh.resume_at({c}, {-1}), InvalidArgument);
  EXPECT_THROW(fresh.resume_at({c}, {1, 2}), InvalidArgument);
  EXPECT_THROW(fresh.resume_at({c, d + 1}, {3, 3}), InvalidArgument);  // no such block: nothing changes
  EXPECT_EQ(fresh.status(c).active_version, 0);
  fresh.resume_at({c, d}, {3, 4});  // so the call can be made again
  EXPECT_EQ(fresh.status(d).active_version, 4);
}

TEST(CoherenceRegistryTest, DeterministicWaitsForADueVersionStillRunning) {
  CoherenceRegistry registry(deterministic(1));
  const std::int64_t ready = registry.add_block();
  const std::int64_t running = registry.add_block();
  registry.note_snapshot(ready, 1, 5);
  registry.note_finished(ready, 1, true);
  registry.note_snapshot(running, 1, 5);

  auto worker = std::async(std::launch::async, [&] {
    await_blocked_activate(registry, 1);
    registry.note_finished(running, 1, true);
  });
  EXPECT_EQ(activate(registry, 5, kLongWait), (Changes{{ready, 1}, {running, 1}}));
  worker.get();

  const RegistryStats stats = registry.stats();
  EXPECT_EQ(stats.waits, 1u);
  EXPECT_GT(stats.wait_seconds, 0.0);
  EXPECT_EQ(stats.max_wait_seconds, stats.wait_seconds);
  EXPECT_EQ(stats.activations, 2u);
}

TEST(CoherenceRegistryTest, CloseEndsAWaitingActivateAtOnce) {
  CoherenceRegistry registry(deterministic(1));
  const std::int64_t running = registry.add_block();
  registry.note_snapshot(running, 1, 5);
  auto closer = std::async(std::launch::async, [&] {
    await_blocked_activate(registry, 1);  // the activate below waits now
    registry.close();
  });
  try {
    activate(registry, 5, kLongWait);
    FAIL() << "activate returned while its version was still running";
  } catch (const CancelledError& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "the engine was closed while step 5 waited for block 0 version 1", e.what());
  }
  closer.get();
  EXPECT_THROW(activate(registry, 5, kLongWait), CancelledError);  // and every later wait
  EXPECT_LT(registry.stats().wait_seconds, std::chrono::duration<double>(kLongWait).count());
}

TEST(CoherenceRegistryTest, CloseEndsAWaitEvenWhereItsVersionEndsMeanwhile) {
  // close() also ends the jobs still running, as failures: the step waiting for one must not go on with the
  // version before it on a closed engine, whichever of the two it wakes to.
  CoherenceRegistry registry(deterministic(1));
  const std::int64_t running = registry.add_block();
  registry.note_snapshot(running, 1, 5);
  auto closer = std::async(std::launch::async, [&] {
    await_blocked_activate(registry, 1);
    registry.close();
    registry.note_finished(running, 1, false);
  });
  EXPECT_THROW(activate(registry, 5, kLongWait), CancelledError);
  closer.get();
}

TEST(CoherenceRegistryTest, AClosedRegistryActivatesNothingEvenWithNothingToWaitFor) {
  CoherenceRegistry registry(deterministic(1));
  const std::int64_t ready = registry.add_block();
  registry.note_snapshot(ready, 1, 5);
  registry.note_finished(ready, 1, true);
  registry.close();
  try {
    activate(registry, 5, kLongWait);
    FAIL() << "a closed registry activated a version";
  } catch (const CancelledError& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "the engine is closed: step 5 activates nothing", e.what());
  }
}

TEST(CoherenceRegistryTest, ActivateTimesOutNamingTheBlockAndVersionAndChangesNothing) {
  CoherenceRegistry registry(deterministic(1));
  const std::int64_t ready = registry.add_block();
  const std::int64_t running = registry.add_block();
  registry.note_snapshot(ready, 1, 3);
  registry.note_finished(ready, 1, true);
  registry.note_snapshot(running, 1, 3);

  try {
    activate(registry, 3, milliseconds(50));
    FAIL() << "activate did not time out";
  } catch (const TimeoutError& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "[CoherenceRegistry::activate] step 3: block 1 needs version 1, still running",
                        e.what());
    EXPECT_PRED_FORMAT2(IsSubstring, "deterministic schedule", e.what());
  }
  EXPECT_EQ(registry.status(ready).active_version, 0);
  RegistryStats stats = registry.stats();
  EXPECT_EQ(stats.waits, 1u);
  EXPECT_GE(stats.wait_seconds, 0.04);
  EXPECT_EQ(stats.activations, 0u);
  EXPECT_EQ(histogram_total(stats), 0u);

  registry.note_finished(running, 1, true);
  EXPECT_EQ(activate(registry, 3), (Changes{{ready, 1}, {running, 1}}));
}

TEST(CoherenceRegistryTest, DeterministicFallsBackPastAFailedVersionWithoutRacingTheOthers) {
  CoherenceRegistry registry(deterministic(5));
  const std::int64_t b = registry.add_block();
  registry.note_snapshot(b, 1, 1);
  registry.note_snapshot(b, 2, 1);
  registry.note_finished(b, 2, false, "eigh did not converge");
  // Version 1 is the fallback; the choice must not depend on whether it has finished yet.
  try {
    activate(registry, 1, milliseconds(50));
    FAIL() << "activate did not wait for version 1";
  } catch (const TimeoutError& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "block 0 needs version 1", e.what());
  }
  registry.note_finished(b, 1, true);
  EXPECT_EQ(activate(registry, 1), (Changes{{b, 1}}));
}

TEST(CoherenceRegistryTest, FailuresKeepTheLastGoodVersionThenRaiseBlockFailure) {
  CoherenceRegistry registry(deterministic(5, /*max_consecutive_failures=*/2));
  const std::int64_t failing = registry.add_block();
  const std::int64_t healthy = registry.add_block();
  registry.note_snapshot(failing, 1, 1);
  registry.note_finished(failing, 1, true);
  EXPECT_EQ(activate(registry, 1), (Changes{{failing, 1}}));

  registry.note_snapshot(failing, 2, 2);
  registry.note_finished(failing, 2, false, "eigh did not converge");
  EXPECT_EQ(activate(registry, 2), Changes{});
  BlockStatus status = registry.status(failing);
  EXPECT_EQ(status.active_version, 1);
  EXPECT_EQ(status.consecutive_failures, 1);
  EXPECT_EQ(status.last_error, "eigh did not converge");

  registry.note_snapshot(healthy, 1, 3);
  registry.note_finished(healthy, 1, true);
  registry.note_snapshot(failing, 3, 3);
  registry.note_finished(failing, 3, false, "non-finite factor");
  try {
    activate(registry, 3);
    FAIL() << "activate did not raise BlockFailure";
  } catch (const BlockFailure& e) {
    EXPECT_EQ(e.block(), failing);
    EXPECT_EQ(e.version(), 3);
    EXPECT_PRED_FORMAT2(IsSubstring, "non-finite factor", e.cause());
    EXPECT_PRED_FORMAT2(IsSubstring, "block 0 failed its refresh (version 3): non-finite factor (2 failures in a row",
                        e.what());
  }
  // The raising call changed nothing, not even the healthy block.
  EXPECT_EQ(registry.status(healthy).active_version, 0);
  EXPECT_EQ(registry.status(failing).active_version, 1);
  EXPECT_THROW(activate(registry, 3), BlockFailure);

  registry.note_snapshot(failing, 4, 4);
  registry.note_finished(failing, 4, true);
  status = registry.status(failing);
  EXPECT_EQ(status.consecutive_failures, 0);
  EXPECT_EQ(status.total_failures, 2);
  EXPECT_EQ(activate(registry, 4), (Changes{{failing, 4}, {healthy, 1}}));
  EXPECT_EQ(registry.stats().failures, 2u);
}

TEST(CoherenceRegistryTest, AFailureDuringTheWaitEndsItWithBlockFailure) {
  CoherenceRegistry registry(deterministic(1, /*max_consecutive_failures=*/1));
  const std::int64_t awaited = registry.add_block();
  const std::int64_t failing = registry.add_block();
  registry.note_snapshot(awaited, 1, 1);
  registry.note_snapshot(failing, 1, 1);

  auto worker = std::async(std::launch::async, [&] {
    await_blocked_activate(registry, 1);
    registry.note_finished(failing, 1, false, "out of memory");
  });
  // Block 0 never finishes: only the failure can end this wait before kLongWait.
  EXPECT_THROW(activate(registry, 1, kLongWait), BlockFailure);
  worker.get();
}

TEST(CoherenceRegistryTest, StalenessHistogramCountsEveryBlockStep) {
  CoherenceRegistry registry(deterministic(2));
  const std::int64_t b = registry.add_block();
  registry.add_block();  // never snapshotted: records nothing
  EXPECT_EQ(registry.stats().staleness_histogram, (std::vector<std::uint64_t>{0, 0, 0, 0}));

  registry.note_snapshot(b, 1, 10);
  registry.note_finished(b, 1, true);
  activate(registry, 1);   // nothing active yet: 1 behind
  activate(registry, 10);  // version 1 active: 0 behind
  for (std::int64_t v = 2; v <= 5; ++v) registry.note_snapshot(b, v, 100);
  activate(registry, 11);  // 4 behind, beyond S + 1

  const RegistryStats stats = registry.stats();
  EXPECT_EQ(stats.staleness_histogram, (std::vector<std::uint64_t>{1, 1, 0, 1}));
  EXPECT_EQ(stats.max_staleness_seen, 4);
}

// The non-deterministic rule may activate a step twice (at prefetch, then in step() for versions that
// finished in between): the second call replaces the step's record instead of adding block-steps.
TEST(CoherenceRegistryTest, ActivatingAStepAgainReplacesItsStalenessRecord) {
  CoherenceRegistry registry(nondeterministic(3));
  const std::int64_t b = registry.add_block();
  const std::int64_t c = registry.add_block();
  for (std::int64_t v = 1; v <= 3; ++v) {
    registry.note_snapshot(b, v, 1000);
    registry.note_snapshot(c, v, 1000);
  }
  registry.note_finished(b, 1, true);
  registry.note_finished(c, 1, true);
  EXPECT_EQ(activate(registry, 5), (Changes{{b, 1}, {c, 1}}));  // both 2 behind
  EXPECT_EQ(registry.stats().max_staleness_seen, 2);
  registry.note_finished(b, 2, true);
  registry.note_finished(b, 3, true);
  EXPECT_EQ(activate(registry, 5), (Changes{{b, 3}}));  // the same step: b is now up to date
  RegistryStats stats = registry.stats();
  EXPECT_EQ(stats.staleness_histogram, (std::vector<std::uint64_t>{1, 0, 1, 0, 0}));
  EXPECT_EQ(stats.max_staleness_seen, 2);  // c's
  registry.note_finished(c, 2, true);
  registry.note_finished(c, 3, true);
  activate(registry, 5);
  EXPECT_EQ(registry.stats().max_staleness_seen, 0);  // the step's final record: nothing was 2 behind
  activate(registry, 6);  // a new step adds its own record
  stats = registry.stats();
  EXPECT_EQ(histogram_total(stats), 4u);
  EXPECT_EQ(stats.staleness_histogram[0], 4u);
}

TEST(CoherenceRegistryTest, NonDeterministicUsesTheNewestGoodVersion) {
  CoherenceRegistry registry(nondeterministic(3));
  const std::int64_t b = registry.add_block();
  for (std::int64_t v = 1; v <= 3; ++v) registry.note_snapshot(b, v, 1000);

  registry.note_finished(b, 2, true);
  EXPECT_EQ(activate(registry, 0), (Changes{{b, 2}}));  // no need to wait for version 1
  registry.note_finished(b, 1, true);                    // too late: superseded
  registry.note_finished(b, 3, false, "non-finite factor");
  EXPECT_EQ(activate(registry, 1), Changes{});
  EXPECT_EQ(registry.status(b).active_version, 2);

  registry.note_snapshot(b, 4, 1000);
  registry.note_snapshot(b, 5, 1000);
  registry.note_finished(b, 4, true);
  registry.note_finished(b, 5, true);
  EXPECT_EQ(activate(registry, 2), (Changes{{b, 5}}));  // jumps over version 4

  const RegistryStats stats = registry.stats();
  EXPECT_EQ(stats.skipped_versions, 2u);  // versions 1 and 4
  EXPECT_EQ(stats.waits, 0u);
  EXPECT_EQ(stats.failures, 1u);
}

TEST(CoherenceRegistryTest, NonDeterministicWaitsToStayWithinTheStalenessBound) {
  CoherenceRegistry registry(nondeterministic(1));
  const std::int64_t b = registry.add_block();
  for (std::int64_t v = 1; v <= 3; ++v) registry.note_snapshot(b, v, 0);

  // Version 3 is the newest snapshot, so with S = 1 at least version 2 must be in use.
  auto worker = std::async(std::launch::async, [&] {
    await_blocked_activate(registry, 1);
    registry.note_finished(b, 2, true);
  });
  EXPECT_EQ(activate(registry, 0, kLongWait), (Changes{{b, 2}}));
  worker.get();
  EXPECT_EQ(registry.stats().waits, 1u);

  // Version 4 fails, so the bound waits for version 5 instead.
  registry.note_snapshot(b, 4, 0);
  registry.note_snapshot(b, 5, 0);
  registry.note_finished(b, 4, false, "eigh did not converge");
  try {
    activate(registry, 1, milliseconds(50));
    FAIL() << "activate did not wait for version 5";
  } catch (const TimeoutError& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "block 0 needs version 5", e.what());
    EXPECT_PRED_FORMAT2(IsSubstring, "staleness bound S=1", e.what());
  }
  // Once every version that could meet the bound has failed, the block keeps its last good one.
  registry.note_finished(b, 5, false, "eigh did not converge");
  EXPECT_EQ(activate(registry, 2), Changes{});
  EXPECT_EQ(registry.status(b).active_version, 2);

  const RegistryStats stats = registry.stats();
  EXPECT_EQ(stats.waits, 2u);
  // Steps 0 and 2 (step 1 timed out): 1 behind, then 3 behind (the ">= S + 1" bin).
  EXPECT_EQ(stats.staleness_histogram, (std::vector<std::uint64_t>{0, 1, 1}));
  EXPECT_EQ(stats.max_staleness_seen, 3);
}

TEST(CoherenceRegistryTest, NonDeterministicWaitsForTheFirstVersionFromItsActivationStep) {
  CoherenceRegistry registry(nondeterministic(3));
  const std::int64_t b = registry.add_block();
  registry.note_snapshot(b, 1, /*activation_step=*/5);  // the bootstrap refresh, due at step 5
  EXPECT_EQ(activate(registry, 4), Changes{});          // not due yet: no wait
  EXPECT_THROW(activate(registry, 5, milliseconds(20)), TimeoutError);
  registry.note_finished(b, 1, true);
  EXPECT_EQ(activate(registry, 5), (Changes{{b, 1}}));
  // Once a version is in use the newest-finished rule applies again: no wait for version 2.
  registry.note_snapshot(b, 2, 6);
  EXPECT_EQ(activate(registry, 6), Changes{});
  EXPECT_EQ(registry.stats().waits, 1u);
}

TEST(CoherenceRegistryTest, NonDeterministicWaitsForEverySyncVersionAtItsActivationStep) {
  CoherenceRegistry registry(nondeterministic(3, /*sync_versions=*/2));
  const std::int64_t b = registry.add_block();
  registry.note_snapshot(b, 1, 1);
  registry.note_finished(b, 1, true);
  EXPECT_EQ(activate(registry, 1), (Changes{{b, 1}}));
  // Version 2 is a sync version: due at its own step 11, it is waited for although version 1 is usable.
  registry.note_snapshot(b, 2, 11);
  EXPECT_EQ(activate(registry, 10), Changes{});
  EXPECT_THROW(activate(registry, 11, milliseconds(20)), TimeoutError);
  registry.note_finished(b, 2, true);
  EXPECT_EQ(activate(registry, 11), (Changes{{b, 2}}));
  // Version 3 is past sync_versions: the newest-finished rule applies, and its due step means nothing.
  registry.note_snapshot(b, 3, 21);
  EXPECT_EQ(activate(registry, 21), Changes{});
  EXPECT_EQ(registry.status(b).active_version, 2);
  EXPECT_EQ(registry.stats().waits, 1u);
}

TEST(CoherenceRegistryTest, RejectsOutOfOrderSnapshotsAndUnknownVersions) {
  CoherenceRegistry registry(deterministic(1));
  const std::int64_t b = registry.add_block();
  EXPECT_THROW(registry.note_snapshot(b, 0, 0), InvalidArgument);
  registry.note_snapshot(b, 2, 0);
  try {
    registry.note_snapshot(b, 2, 0);
    FAIL() << "version 2 noted twice";
  } catch (const InvalidArgument& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "block 0: version 2 must be > the newest snapshot, version 2", e.what());
  }
  EXPECT_THROW(registry.note_snapshot(b, 1, 0), InvalidArgument);

  EXPECT_THROW(registry.note_finished(b, 1, true), InvalidArgument);  // never noted
  EXPECT_THROW(registry.note_finished(b, 3, true), InvalidArgument);
  registry.note_finished(b, 2, true);
  try {
    registry.note_finished(b, 2, true);
    FAIL() << "version 2 finished twice";
  } catch (const InvalidArgument& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "block 0: version 2 is not running", e.what());
  }

  try {
    registry.note_snapshot(5, 1, 0);
    FAIL() << "unknown block accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "[CoherenceRegistry::note_snapshot] block 5 does not exist (1 blocks)", e.what());
  }
  EXPECT_THROW(registry.note_finished(-1, 1, true), InvalidArgument);
  EXPECT_THROW(registry.status(1), InvalidArgument);
}

TEST(CoherenceRegistryTest, RejectsInvalidConfigAndNumbersBlocksInOrder) {
  try {
    CoherenceRegistry registry(deterministic(-1));
    FAIL() << "staleness=-1 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "staleness=-1 must be >= 0", e.what());
  }
  try {
    CoherenceRegistry registry(deterministic(1, 0));
    FAIL() << "max_consecutive_failures=0 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "max_consecutive_failures=0 must be >= 1", e.what());
  }
  try {
    CoherenceRegistry registry(nondeterministic(1, -1));
    FAIL() << "sync_versions=-1 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "sync_versions=-1 must be >= 0", e.what());
  }

  CoherenceRegistry registry(nondeterministic(0));
  EXPECT_EQ(registry.num_blocks(), 0);
  EXPECT_EQ(registry.add_block(), 0);
  EXPECT_EQ(registry.add_block(), 1);
  EXPECT_EQ(registry.num_blocks(), 2);
  EXPECT_FALSE(registry.config().deterministic);
  EXPECT_EQ(registry.stats().staleness_histogram.size(), 2u);
}

}  // namespace
}  // namespace asteria::coherence
