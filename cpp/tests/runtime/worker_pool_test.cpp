#include "asteria/runtime/worker_pool.h"

#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <latch>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "asteria/common/errors.h"
#include "asteria/runtime/blas_threads.h"
#include "threads.h"

namespace asteria::runtime {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using ::testing::IsSubstring;
using test_support::threads_named;

constexpr auto kLongWait = seconds(30);  // only hit if the code under test hangs

// Occupies the worker of a one-worker pool until release(), so that later jobs pile up in the queue.
class BlockedWorker {
 public:
  explicit BlockedWorker(WorkerPool& pool) {
    handle_ = pool.submit(-1, [this] {
      started_.count_down();
      release_.wait();
    });
    started_.wait();
  }
  // Waits for the job to end: it still uses the latches after release() returns.
  ~BlockedWorker() {
    release();
    handle_.wait(kLongWait);
  }
  void release() {
    if (!released_) {
      released_ = true;
      release_.count_down();
    }
  }
  const JobHandle& handle() const { return handle_; }

 private:
  std::latch started_{1};
  std::latch release_{1};
  bool released_ = false;
  JobHandle handle_;
};

TEST(WorkerPoolTest, RunsQueuedJobsInDeadlineOrder) {
  WorkerPool pool(1);
  std::vector<std::int64_t> deadlines(20);
  std::iota(deadlines.begin(), deadlines.end(), 0);
  std::shuffle(deadlines.begin(), deadlines.end(), std::mt19937(7));

  std::vector<std::int64_t> ran;  // written by the single worker only
  std::vector<JobHandle> jobs;
  BlockedWorker blocker(pool);
  for (const std::int64_t deadline : deadlines) {
    jobs.push_back(pool.submit(deadline, [&ran, deadline] { ran.push_back(deadline); }));
  }
  blocker.release();
  for (const JobHandle& job : jobs) job.wait(kLongWait);

  std::vector<std::int64_t> expected = deadlines;
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(ran, expected);
}

TEST(WorkerPoolTest, RunsEqualDeadlinesInSubmissionOrder) {
  WorkerPool pool(1);
  std::vector<int> ran;  // written by the single worker only
  std::vector<JobHandle> jobs;
  BlockedWorker blocker(pool);
  for (int i = 0; i < 10; ++i) jobs.push_back(pool.submit(i % 2 == 0 ? 5 : 3, [&ran, i] { ran.push_back(i); }));
  blocker.release();
  for (const JobHandle& job : jobs) job.wait(kLongWait);

  EXPECT_EQ(ran, (std::vector<int>{1, 3, 5, 7, 9, 0, 2, 4, 6, 8}));
  EXPECT_LT(jobs[0].id(), jobs[1].id());
}

TEST(WorkerPoolTest, RunsTheCostlierOfEqualDeadlinesFirstAndEqualCostsInSubmissionOrder) {
  WorkerPool pool(1);
  std::vector<int> ran;  // written by the single worker only
  std::vector<JobHandle> jobs;
  BlockedWorker blocker(pool);
  // (deadline, cost) per job i: the deadline decides first, then the larger cost, then submission order.
  const std::vector<std::pair<std::int64_t, double>> order = {{5, 1.0}, {3, 1.0}, {5, 8.0}, {3, 27.0}, {5, 8.0},
                                                              {3, 0.0}, {4, 1e9}, {5, 1.0}};
  for (int i = 0; i < static_cast<int>(order.size()); ++i) {
    jobs.push_back(pool.submit(order[i].first, [&ran, i] { ran.push_back(i); }, order[i].second));
  }
  blocker.release();
  for (const JobHandle& job : jobs) job.wait(kLongWait);

  EXPECT_EQ(ran, (std::vector<int>{3, 1, 5, 6, 2, 4, 0, 7}));
}

TEST(WorkerPoolTest, RunsBackgroundJobsAfterDueOnesCheapestFirst) {
  WorkerPool pool(1);
  std::vector<int> ran;  // written by the single worker only
  std::vector<JobHandle> jobs;
  BlockedWorker blocker(pool);
  // (deadline, cost, class) per job i. Due jobs first, by (deadline, larger cost); then background jobs by
  // (smaller cost, deadline, submission order), whatever their deadlines against the due ones'.
  constexpr JobClass kDue = JobClass::kDue;
  constexpr JobClass kBackground = JobClass::kBackground;
  const std::vector<std::tuple<std::int64_t, double, JobClass>> order = {
      {1, 8.0, kBackground}, {9, 1.0, kDue},        {2, 1.0, kBackground}, {9, 8.0, kDue},
      {1, 1.0, kBackground}, {0, 27.0, kBackground}, {1, 1.0, kBackground}, {20, 0.0, kDue}};
  for (int i = 0; i < static_cast<int>(order.size()); ++i) {
    const auto& [deadline, cost, job_class] = order[i];
    jobs.push_back(pool.submit(deadline, [&ran, i] { ran.push_back(i); }, cost, job_class));
  }
  blocker.release();
  for (const JobHandle& job : jobs) job.wait(kLongWait);

  EXPECT_EQ(ran, (std::vector<int>{3, 1, 7, 4, 6, 2, 0, 5}));
}

TEST(WorkerPoolTest, RefusesACostThatIsNotAFiniteNumberAtLeastZero) {
  WorkerPool pool(1);
  for (const double cost : {-1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    try {
      pool.submit(2, [] {}, cost);
      FAIL() << "cost " << cost << " was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_PRED_FORMAT2(IsSubstring, "Invalid cost=", e.what());
      EXPECT_PRED_FORMAT2(IsSubstring, "must be a finite number >= 0 (deadline 2)", e.what());
    }
  }
  EXPECT_EQ(pool.stats().submitted, 0u);
}

TEST(WorkerPoolTest, WorkerThreadsCarryTheirNameFromConstructionToShutdown) {
  const int before = threads_named(kWorkerThreadName);
  {
    WorkerPool pool(3);
    EXPECT_EQ(threads_named(kWorkerThreadName), before + 3);
    pool.shutdown();
    EXPECT_EQ(threads_named(kWorkerThreadName), before);
  }
}

TEST(WorkerPoolTest, WorkersRunAtTheRequestedNiceBelowTheCaller) {
  const int caller = getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)));
  WorkerPool pool(2, 1, 7);
  std::atomic<int> seen{-100};
  pool.submit(0, [&seen] { seen = getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid))); }).wait(kLongWait);
  EXPECT_EQ(seen.load(), std::min(19, std::max(caller, 7)));
  EXPECT_EQ(getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid))), caller);  // the caller is untouched
  EXPECT_THROW(WorkerPool(1, 1, 20), InvalidArgument);
  EXPECT_THROW(WorkerPool(1, 1, -1), InvalidArgument);
}

TEST(WorkerPoolTest, WorkersRunOnlyOnTheirCpus) {
  cpu_set_t mine;
  ASSERT_EQ(pthread_getaffinity_np(pthread_self(), sizeof(mine), &mine), 0);
  int last = -1;  // the highest CPU this process may use: the workers go there, away from CPU 0's
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &mine)) last = c;
  ASSERT_GE(last, 0);
  WorkerPool pool(2, 1, 0, {last, last});  // duplicates collapse
  EXPECT_EQ(pool.cpus(), std::vector<int>{last});
  std::vector<JobHandle> jobs;
  std::vector<int> seen(4, -2), counts(4, -1);
  for (int i = 0; i < 4; ++i) {
    jobs.push_back(pool.submit(i, [&seen, &counts, i] {
      cpu_set_t set;
      CPU_ZERO(&set);
      pthread_getaffinity_np(pthread_self(), sizeof(set), &set);
      counts[i] = CPU_COUNT(&set);
      seen[i] = sched_getcpu();
    }));
  }
  for (auto& job : jobs) job.wait(kLongWait);
  EXPECT_EQ(counts, std::vector<int>(4, 1));
  EXPECT_EQ(seen, std::vector<int>(4, last));
}

TEST(WorkerPoolTest, WaitRethrowsTheJobsOwnException) {
  WorkerPool pool(2);
  const JobHandle job = pool.submit(0, [] { throw std::out_of_range("row 7 is out of range"); });
  try {
    job.wait(kLongWait);
    FAIL() << "wait() did not rethrow";
  } catch (const std::out_of_range& e) {
    EXPECT_STREQ(e.what(), "row 7 is out of range");
  }
  EXPECT_EQ(job.state(), JobState::kFailed);
  EXPECT_TRUE(job.finished());
  // The error stays with the handle: every wait sees it.
  EXPECT_THROW(job.wait(kLongWait), std::out_of_range);

  const JobHandle fine = pool.submit(0, [] {});
  fine.wait(kLongWait);
  EXPECT_EQ(fine.state(), JobState::kDone);
  const PoolStats stats = pool.stats();
  EXPECT_EQ(stats.failed, 1u);
  EXPECT_EQ(stats.completed, 1u);
}

TEST(WorkerPoolTest, WaitTimesOutOnAQueuedJob) {
  WorkerPool pool(1);
  BlockedWorker blocker(pool);
  const JobHandle job = pool.submit(4, [] {});
  try {
    job.wait(milliseconds(50));
    FAIL() << "wait() did not time out";
  } catch (const TimeoutError& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "job " + std::to_string(job.id()) + " (deadline 4) still queued", e.what());
  }
  EXPECT_EQ(job.state(), JobState::kQueued);
  blocker.release();
  job.wait(kLongWait);
  EXPECT_EQ(job.state(), JobState::kDone);
}

TEST(WorkerPoolTest, ShutdownCancelsQueuedJobsAndLetsTheRunningOneFinish) {
  WorkerPool pool(1);
  auto blocker = std::make_unique<BlockedWorker>(pool);
  std::atomic<int> ran{0};
  std::vector<JobHandle> queued;
  for (int i = 0; i < 5; ++i) queued.push_back(pool.submit(i, [&ran] { ran += 1; }));

  // shutdown() blocks until the running job ends, so it runs on its own thread.
  std::thread stopper([&pool] { pool.shutdown(); });
  for (const JobHandle& job : queued) {
    EXPECT_THROW(job.wait(kLongWait), CancelledError);
    EXPECT_EQ(job.state(), JobState::kCancelled);
  }
  EXPECT_EQ(blocker->handle().state(), JobState::kRunning);
  blocker->release();
  stopper.join();

  blocker->handle().wait(kLongWait);
  EXPECT_EQ(blocker->handle().state(), JobState::kDone);
  EXPECT_EQ(ran.load(), 0);
  EXPECT_THROW(pool.submit(0, [] {}), CancelledError);
  pool.shutdown();  // idempotent

  const PoolStats stats = pool.stats();
  EXPECT_EQ(stats.submitted, 6u);
  EXPECT_EQ(stats.completed, 1u);
  EXPECT_EQ(stats.cancelled, 5u);
  EXPECT_EQ(stats.queue_depth, 0u);
}

TEST(WorkerPoolTest, ShutdownUnderLoadNeitherHangsNorLosesJobs) {
  constexpr int kSubmitters = 6;
  constexpr int kJobsEach = 300;
  auto pool = std::make_unique<WorkerPool>(4);
  std::atomic<int> ran{0};
  std::latch half_submitted(kSubmitters);
  std::vector<std::vector<JobHandle>> handles(kSubmitters);
  std::vector<std::thread> submitters;
  for (int s = 0; s < kSubmitters; ++s) {
    submitters.emplace_back([&, s] {
      for (int i = 0; i < kJobsEach; ++i) {
        if (i == kJobsEach / 2) half_submitted.count_down();
        try {
          handles[s].push_back(pool->submit(i % 17, [&ran] { ran += 1; }));
        } catch (const CancelledError&) {
          return;  // the pool shut down under us; later submits would fail the same way
        }
      }
    });
  }
  half_submitted.wait();
  std::thread concurrent_stopper([&pool] { pool->shutdown(); });
  pool->shutdown();
  concurrent_stopper.join();
  for (std::thread& t : submitters) t.join();

  std::uint64_t done = 0;
  std::uint64_t cancelled = 0;
  std::uint64_t total = 0;
  for (const auto& list : handles) {
    for (const JobHandle& job : list) {
      ASSERT_TRUE(job.finished());
      total += 1;
      try {
        job.wait(kLongWait);
        done += 1;
      } catch (const CancelledError&) {
        cancelled += 1;
      }
    }
  }
  const PoolStats stats = pool->stats();
  EXPECT_GE(total, static_cast<std::uint64_t>(kSubmitters * kJobsEach / 2));
  EXPECT_EQ(stats.submitted, total);
  EXPECT_EQ(stats.completed, done);
  EXPECT_EQ(stats.cancelled, cancelled);
  EXPECT_EQ(stats.failed, 0u);
  EXPECT_EQ(static_cast<std::uint64_t>(ran.load()), done);
  pool.reset();  // the handles outlive the pool
  for (const auto& list : handles) {
    for (const JobHandle& job : list) {
      EXPECT_TRUE(job.state() == JobState::kDone || job.state() == JobState::kCancelled) << to_string(job.state());
    }
  }
}

TEST(WorkerPoolTest, StatsCountJobsQueueDepthAndTimes) {
  WorkerPool pool(1);
  std::vector<JobHandle> jobs;
  {
    BlockedWorker blocker(pool);
    for (int i = 0; i < 3; ++i) jobs.push_back(pool.submit(i, [] {}));
    const PoolStats queued = pool.stats();
    EXPECT_EQ(queued.queue_depth, 3u);
    EXPECT_EQ(queued.max_queue_depth, 3u);
    EXPECT_EQ(queued.completed, 0u);
    jobs.push_back(blocker.handle());
  }
  for (const JobHandle& job : jobs) job.wait(kLongWait);

  const PoolStats stats = pool.stats();
  EXPECT_EQ(stats.workers, 1);
  EXPECT_EQ(pool.num_workers(), 1);
  EXPECT_EQ(stats.submitted, 4u);
  EXPECT_EQ(stats.completed, 4u);
  EXPECT_EQ(stats.failed, 0u);
  EXPECT_EQ(stats.cancelled, 0u);
  EXPECT_EQ(stats.queue_depth, 0u);
  EXPECT_EQ(stats.max_queue_depth, 3u);
  EXPECT_GT(stats.busy_seconds, 0.0);
  EXPECT_GE(stats.wall_seconds, stats.busy_seconds);
  EXPECT_GE(stats.max_run_seconds, stats.mean_run_seconds);
  EXPECT_GE(stats.max_latency_seconds, stats.mean_latency_seconds);
  // A job's latency includes its run time; the queued jobs also waited for the blocker.
  EXPECT_GE(stats.mean_latency_seconds, stats.mean_run_seconds);
  EXPECT_GE(stats.max_latency_seconds, stats.max_run_seconds);
}

TEST(WorkerPoolTest, WallTimeEndsAtShutdownSoTheBusyFractionHoldsAfterwards) {
  WorkerPool pool(1);
  pool.submit(0, [] {}).wait(kLongWait);
  const auto let_the_clock_move = [] {  // spins until the steady clock has moved on by a millisecond
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1);
    while (std::chrono::steady_clock::now() < until) {
    }
  };
  const double live = pool.stats().wall_seconds;
  let_the_clock_move();
  EXPECT_GT(pool.stats().wall_seconds, live);  // a running pool's life goes on
  pool.shutdown();
  const PoolStats stopped = pool.stats();
  let_the_clock_move();
  EXPECT_EQ(pool.stats().wall_seconds, stopped.wall_seconds);
  EXPECT_EQ(pool.stats().busy_seconds, stopped.busy_seconds);
  EXPECT_GT(stopped.busy_seconds, 0.0);
}

TEST(WorkerPoolTest, WorkersSetTheirBlasThreadCount) {
  const int before = blas_threads();
  {
    WorkerPool pool(1, 2);
    int seen = 0;
    pool.submit(0, [&seen] { seen = blas_threads(); }).wait(kLongWait);
    EXPECT_EQ(seen, 2);
  }
  set_blas_threads(before);
  EXPECT_EQ(blas_threads(), before);
}

TEST(WorkerPoolTest, RejectsInvalidArguments) {
  EXPECT_THROW(WorkerPool(1, 1, 0, {-1}), InvalidArgument);
  EXPECT_THROW(WorkerPool(1, 1, 0, {CPU_SETSIZE}), InvalidArgument);
  try {
    WorkerPool pool(0);
    FAIL() << "num_workers=0 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "num_workers=0", e.what());
  }
  try {
    WorkerPool pool(2, 0);
    FAIL() << "blas_threads=0 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "blas_threads=0", e.what());
  }
  EXPECT_THROW(set_blas_threads(0), InvalidArgument);

  WorkerPool pool(1);
  EXPECT_THROW(pool.submit(0, std::function<void()>()), InvalidArgument);

  const JobHandle empty;
  EXPECT_THROW(empty.id(), InvalidArgument);
  EXPECT_THROW(empty.state(), InvalidArgument);
  EXPECT_THROW(empty.finished(), InvalidArgument);
  try {
    empty.wait(milliseconds(1));
    FAIL() << "empty handle waited";
  } catch (const InvalidArgument& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "empty JobHandle", e.what());
  }
}

TEST(WorkerPoolTest, NamesJobStates) {
  EXPECT_STREQ(to_string(JobState::kQueued), "queued");
  EXPECT_STREQ(to_string(JobState::kRunning), "running");
  EXPECT_STREQ(to_string(JobState::kDone), "done");
  EXPECT_STREQ(to_string(JobState::kFailed), "failed");
  EXPECT_STREQ(to_string(JobState::kCancelled), "cancelled");
}

}  // namespace
}  // namespace asteria::runtime
