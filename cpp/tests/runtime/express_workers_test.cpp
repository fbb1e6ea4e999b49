// Express workers: threads beside the pool's workers that take only the cheap jobs (WorkerPool's
// ExpressWorkers, EngineConfig::express_workers).
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <latch>
#include <string>
#include <thread>
#include <vector>

#include "asteria/common/errors.h"
#include "asteria/runtime/refresh_engine.h"
#include "asteria/runtime/worker_pool.h"
#include "rings.h"
#include "threads.h"

namespace asteria::runtime {
namespace {

using namespace std::chrono_literals;

using test_support::Rings;
using test_support::submit_diagonal;
using test_support::threads_named;

constexpr auto kLongWait = 30s;  // only hit if the code under test hangs

int nice_of_this_thread() { return getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid))); }

// A job that holds its thread until release(): `started` counts down once it runs.
struct Hold {
  std::latch started{1};
  std::latch release{1};
  std::function<void()> job() {
    return [this] {
      started.count_down();
      release.wait();
    };
  }
};

TEST(ExpressWorkers, TakeACheapJobWhileEveryWorkerIsBusyAndLeaveTheCostlyOnes) {
  WorkerPool pool(1, 1, 0, {}, ExpressWorkers{1, 10.0, 0});
  Hold worker;
  const JobHandle held = pool.submit(0, worker.job(), 100.0);
  worker.started.wait();  // the only worker runs the costly hold
  const JobHandle costly = pool.submit(1, [] {}, 11.0);
  const JobHandle cheap = pool.submit(2, [] {}, 10.0);  // queued after the costly one, with a later deadline
  cheap.wait(kLongWait);  // done by the express worker
  EXPECT_EQ(costly.state(), JobState::kQueued);  // the express worker never takes a job above max_cost
  worker.release.count_down();
  costly.wait(kLongWait);
  held.wait(kLongWait);
  const PoolStats stats = pool.stats();
  EXPECT_EQ(stats.workers, 1);
  EXPECT_EQ(stats.express_workers, 1);
  EXPECT_EQ(stats.completed, 3u);
  EXPECT_GE(stats.express_busy_seconds, 0.0);
  // The cheap job's own figures: counted alone, and its latency below the costly one's, which waited for the hold.
  EXPECT_EQ(stats.cheap_ended, 1u);
  EXPECT_GT(stats.cheap_mean_latency_seconds, 0.0);
  EXPECT_GE(stats.cheap_mean_latency_seconds, stats.cheap_mean_run_seconds);
  EXPECT_LT(stats.cheap_mean_latency_seconds, stats.max_latency_seconds);
}

TEST(ExpressWorkers, AWorkerTakesBothQueuesInTheOneOrder) {
  // The express worker is held by a cheap job, the worker by a costly one; then cheap and costly jobs are
  // queued, and the worker alone runs them: by deadline, then the costlier first, whichever queue they are in.
  WorkerPool pool(1, 1, 0, {}, ExpressWorkers{1, 10.0, 0});
  Hold worker, express;
  const JobHandle held_worker = pool.submit(-2, worker.job(), 100.0);
  worker.started.wait();
  const JobHandle held_express = pool.submit(-1, express.job(), 1.0);
  express.started.wait();
  std::vector<int> ran;  // written by the worker only (the express worker stays held)
  std::vector<JobHandle> jobs;
  const std::vector<std::pair<std::int64_t, double>> queued = {{3, 1.0}, {1, 50.0}, {2, 5.0}, {1, 2.0}, {0, 20.0}};
  for (int i = 0; i < static_cast<int>(queued.size()); ++i) {
    jobs.push_back(pool.submit(queued[i].first, [&ran, i] { ran.push_back(i); }, queued[i].second));
  }
  worker.release.count_down();
  for (const JobHandle& job : jobs) job.wait(kLongWait);
  EXPECT_EQ(ran, (std::vector<int>{4, 1, 3, 2, 0}));
  express.release.count_down();
  held_express.wait(kLongWait);
  held_worker.wait(kLongWait);
}

TEST(ExpressWorkers, RunAtTheirNiceUnderTheirOwnName) {
  const int caller = nice_of_this_thread();
  const int before = threads_named(kExpressThreadName);
  WorkerPool pool(1, 1, 12, {}, ExpressWorkers{2, 1.0, 6});
  EXPECT_EQ(threads_named(kExpressThreadName), before + 2);
  Hold worker;
  const JobHandle held = pool.submit(0, worker.job(), 5.0);  // costly: the worker's
  worker.started.wait();
  std::atomic<int> seen{-100};
  pool.submit(1, [&seen] { seen = nice_of_this_thread(); }, 1.0).wait(kLongWait);  // cheap: an express worker's
  EXPECT_EQ(seen.load(), std::min(19, std::max(caller, 6)));
  worker.release.count_down();
  held.wait(kLongWait);
  pool.shutdown();
  EXPECT_EQ(threads_named(kExpressThreadName), before);
}

TEST(ExpressWorkers, ShutdownCancelsTheQueuedJobsOfBothKinds) {
  WorkerPool pool(1, 1, 0, {}, ExpressWorkers{1, 10.0, 0});
  Hold worker, express;
  const JobHandle held_worker = pool.submit(0, worker.job(), 100.0);
  worker.started.wait();
  const JobHandle held_express = pool.submit(0, express.job(), 1.0);
  express.started.wait();
  const JobHandle cheap = pool.submit(1, [] {}, 1.0);
  const JobHandle costly = pool.submit(1, [] {}, 100.0);
  EXPECT_EQ(pool.stats().queue_depth, 2u);
  worker.release.count_down();
  express.release.count_down();
  pool.shutdown();
  // The held jobs may have taken the queued ones before the shutdown: each either ran or was cancelled.
  for (const JobHandle* job : {&cheap, &costly}) {
    EXPECT_TRUE(job->state() == JobState::kDone || job->state() == JobState::kCancelled);
  }
  EXPECT_EQ(held_worker.state(), JobState::kDone);
  EXPECT_EQ(held_express.state(), JobState::kDone);
}

TEST(ExpressWorkers, RefuseInvalidSettingsByName) {
  const auto message = [](ExpressWorkers express) -> std::string {
    try {
      WorkerPool pool(1, 1, 10, {}, express);
    } catch (const InvalidArgument& e) {
      return e.what();
    }
    return "accepted";
  };
  EXPECT_NE(message({-1, 1.0, 5}).find("Invalid express.count=-1: must be >= 0"), std::string::npos);
  EXPECT_NE(message({1, -1.0, 5}).find("Invalid express.max_cost=-1"), std::string::npos);
  EXPECT_NE(message({1, std::nan(""), 5}).find("must be a finite number >= 0"), std::string::npos);
  EXPECT_NE(message({1, 1.0, 11}).find("Invalid express.nice=11: must be in [0, 10]"), std::string::npos);
  EXPECT_EQ(message({0, 0.0, 0}), "accepted");
  EngineConfig config;
  config.express_workers = -1;
  EXPECT_THROW(RefreshEngine{config}, InvalidArgument);
  config.express_workers = 1;
  config.express_max_n = -1;
  EXPECT_THROW(RefreshEngine{config}, InvalidArgument);
}

// One worker, held by a paused job of a large block; a small block's version is queued behind another large
// block's. With an express worker for blocks of at most 8, the small block's job starts (and pauses too) while
// the worker is still held.
TEST(ExpressWorkers, TheEngineRefreshesASmallBlockWhileTheWorkerHoldsALargeOne) {
  constexpr int kDepth = 2;
  EngineConfig config;
  config.workers = 1;
  config.express_workers = 1;
  config.express_max_n = 8;
  config.registry.deterministic = false;
  config.registry.sync_versions = 0;
  config.slot_timeout = 5s;
  RefreshEngine engine(config);
  EXPECT_EQ(engine.stats().pool.express_workers, 1);
  Rings held_rings(kDepth, 24), large_rings(kDepth, 24), small_rings(kDepth, 8);
  const auto held = engine.add_block(held_rings.memory(kDepth));
  const auto large = engine.add_block(large_rings.memory(kDepth));
  const auto small = engine.add_block(small_rings.memory(kDepth));
  engine.inject_fault(held, 1, FaultKind::kPause);
  engine.inject_fault(small, 1, FaultKind::kPause);
  submit_diagonal(engine, held, held_rings, kDepth, 1, 16.0f);
  engine.wait_paused(1, 5s);  // the worker waits inside the held job
  submit_diagonal(engine, large, large_rings, kDepth, 2, 16.0f);
  submit_diagonal(engine, small, small_rings, kDepth, 3, 16.0f);
  engine.wait_paused(2, 5s);  // the small block's job runs beside it: the express worker took it
  EXPECT_EQ(engine.status(large).newest_ok, 0);  // still queued for the worker
  engine.release_pauses();
  engine.drain(5s);
  for (const auto id : {held, large, small}) EXPECT_EQ(engine.status(id).newest_ok, 1);
  // (16 I)^(-1/4) = I / 2
  EXPECT_FLOAT_EQ(small_rings.result(1, kDepth)[0], 0.5f);
  const EngineStats stats = engine.stats();
  EXPECT_EQ(stats.refreshes_ok, 3u);
  EXPECT_EQ(stats.by_dim.at(8).jobs, 1u);
  EXPECT_EQ(stats.by_dim.at(24).jobs, 2u);
}

// A job's seconds (EngineStats::by_dim, refresh_seconds) are its thread's CPU time: a job held 200 ms in a pause
// counts the microseconds of its 8 x 8 root, not the wait; an injected delay stands for a slow job and counts.
TEST(ExpressWorkers, JobSecondsAreCpuTimeWithAnInjectedDelayCounted) {
  constexpr int kDepth = 2;
  EngineConfig config;
  config.workers = 1;
  config.registry.deterministic = false;
  config.registry.sync_versions = 0;
  config.slot_timeout = 5s;
  RefreshEngine engine(config);
  Rings paused_rings(kDepth, 8), delayed_rings(kDepth, 16);
  const auto paused = engine.add_block(paused_rings.memory(kDepth));
  const auto delayed = engine.add_block(delayed_rings.memory(kDepth));
  engine.inject_fault(paused, 1, FaultKind::kPause);
  engine.inject_fault(delayed, 1, FaultKind::kDelay, 300ms);
  submit_diagonal(engine, paused, paused_rings, kDepth, 1, 16.0f);
  engine.wait_paused(1, 5s);
  std::this_thread::sleep_for(200ms);  // (not a synchronization: the wall time the paused job spends waiting)
  engine.release_pauses();
  submit_diagonal(engine, delayed, delayed_rings, kDepth, 2, 16.0f);
  engine.drain(5s);
  const EngineStats stats = engine.stats();
  EXPECT_GE(stats.pool.max_run_seconds, 0.3);  // the wall time the jobs took
  EXPECT_LT(stats.by_dim.at(8).seconds, 0.1);
  EXPECT_GE(stats.by_dim.at(16).seconds, 0.3);
  EXPECT_LT(stats.by_dim.at(16).seconds, 0.4);
  EXPECT_DOUBLE_EQ(stats.refresh_seconds, stats.by_dim.at(8).seconds + stats.by_dim.at(16).seconds);
}

}  // namespace
}  // namespace asteria::runtime
