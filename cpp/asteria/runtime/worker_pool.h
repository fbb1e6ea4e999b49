// A pool of CPU worker threads running jobs in deadline order, with express workers for the cheap ones.
#pragma once

#include <sched.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <queue>
#include <thread>
#include <vector>

namespace asteria::runtime {

enum class JobState { kQueued, kRunning, kDone, kFailed, kCancelled };

const char* to_string(JobState state) noexcept;

namespace detail {
struct JobRecord;
}

// A job's completion, shared between the pool and whoever submitted it.
// Thread safety: every method is safe to call concurrently.
class JobHandle {
 public:
  JobHandle() = default;
  explicit JobHandle(std::shared_ptr<detail::JobRecord> record) : record_(std::move(record)) {}

  std::uint64_t id() const;
  JobState state() const;
  // True once the job has finished, failed or been cancelled.
  bool finished() const;
  // Blocks until the job finishes. Rethrows the job's own exception if it failed, throws
  // CancelledError if it was cancelled, TimeoutError if `timeout` passes first.
  void wait(std::chrono::nanoseconds timeout) const;

 private:
  std::shared_ptr<detail::JobRecord> record_;
};

// Counters over the pool's life. Latency runs from submit to finish; run time from start to finish.
struct PoolStats {
  int workers = 0;
  std::uint64_t submitted = 0;
  std::uint64_t completed = 0;
  std::uint64_t failed = 0;
  std::uint64_t cancelled = 0;
  std::size_t queue_depth = 0;
  std::size_t max_queue_depth = 0;
  int express_workers = 0;
  double busy_seconds = 0.0;          // summed over the workers (express workers not included)
  double express_busy_seconds = 0.0;  // summed over the express workers
  double wall_seconds = 0.0;  // from construction to now, or to the shutdown() that joined the workers
  double mean_latency_seconds = 0.0;
  double max_latency_seconds = 0.0;
  double mean_run_seconds = 0.0;
  double max_run_seconds = 0.0;
  // The same for the cheap jobs alone (those the express workers may take, whichever thread ran them): where a
  // small block's version comes late, whether it waited for a thread or ran slowly beside a costly job.
  std::uint64_t cheap_ended = 0;
  double cheap_mean_latency_seconds = 0.0;
  double cheap_mean_run_seconds = 0.0;
};

// The name of every worker thread (Linux's 15-character limit): /proc/<pid>/task/<tid>/comm shows it.
inline constexpr const char* kWorkerThreadName = "asteria-worker";
inline constexpr const char* kExpressThreadName = "asteria-express";

// Threads beside the workers that take only the cheap jobs (cost <= max_cost), on the workers' CPUs at a
// higher CPU priority (a lower `nice`) than theirs: the kernel's scheduler then lets a cheap job preempt a
// costly one where every core is busy, so that a refresh of milliseconds never waits for a core behind
// refreshes of a second. They add no cores: the costly job resumes when the cheap one ends.
struct ExpressWorkers {
  int count = 0;          // >= 0 threads
  double max_cost = 0.0;  // finite, >= 0: the costliest job they take (a job's `cost` as submitted)
  int nice = 0;           // 0..19, at most the workers' nice
};

// How a queued job is ordered against the others.
enum class JobClass {
  // Its result is waited for at its deadline: earliest deadline first; among jobs due at the same step
  // the costlier first (longest processing time first, which shortens the time until the last of them is
  // done on several workers), then in submission order.
  kDue,
  // Its result is used whenever it is done (a bounded-staleness refresh): after every due job, the
  // cheapest first (shortest processing time first, which minimizes the mean time from submission to
  // result), then by deadline, then in submission order. A cheap job then never waits behind costly ones
  // queued before it; a costly one waits at most for the cheaper jobs' share of the work.
  kBackground,
};

// Jobs run in the order their JobClass gives (due jobs before background ones).
// A job's exception is caught on the worker and kept in its handle, to be rethrown at the wait.
// Thread safety: every method is safe to call concurrently.
class WorkerPool {
 public:
  // `num_workers` >= 1 threads; each sets its BLAS thread count to `blas_threads` (>= 1) before
  // running jobs, so that workers do not oversubscribe the cores.
  // `nice` (0..19) lowers the workers' CPU priority (Linux per-thread nice) so that the training
  // thread, which launches the GPU's work, never waits for a core behind them.
  // `cpus`: the logical CPUs every worker may run on (each worker gets the whole set; the kernel
  // balances within it); empty: wherever the creating thread may run. Keeping the workers off the
  // cores (and their SMT siblings) that the training thread uses stops them from slowing its kernel
  // launches. Throws InvalidArgument for a negative CPU or one the kernel refuses for this process.
  // `express`: the express workers (same BLAS threads and CPUs); a job they may take is also taken by an
  // idle worker, in the one order of JobClass.
  WorkerPool(int num_workers, int blas_threads = 1, int nice = 0, std::vector<int> cpus = {},
             ExpressWorkers express = {});
  ~WorkerPool();  // shutdown()

  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Queues `fn`, with `cost` (finite, >= 0, any unit: e.g. flops) ordering it as `job_class` says.
  // Throws CancelledError once the pool is shut down, InvalidArgument for an empty `fn` or a bad `cost`.
  JobHandle submit(std::int64_t deadline, std::function<void()> fn, double cost = 0.0,
                   JobClass job_class = JobClass::kDue);

  // Cancels every queued job (their waiters get CancelledError), lets running jobs finish and
  // joins the threads. Idempotent; a concurrent caller returns once the threads are joined. Must
  // not be called from one of the pool's own jobs (a worker cannot join itself).
  void shutdown();

  PoolStats stats() const;
  int num_workers() const noexcept { return num_workers_; }
  const std::vector<int>& cpus() const noexcept { return cpus_; }

 private:
  struct QueueEntry {
    std::int64_t deadline;
    double cost;
    JobClass job_class;
    std::uint64_t seq;
    std::shared_ptr<detail::JobRecord> record;
    // "Runs later than" (see JobClass).
    bool operator>(const QueueEntry& other) const {
      if (job_class != other.job_class) return job_class == JobClass::kBackground;
      if (job_class == JobClass::kBackground && cost != other.cost) return cost > other.cost;
      if (deadline != other.deadline) return deadline > other.deadline;
      if (cost != other.cost) return cost < other.cost;
      return seq > other.seq;
    }
  };

  using Queue = std::priority_queue<QueueEntry, std::vector<QueueEntry>, std::greater<>>;

  void worker_loop(int blas_threads, bool express);
  // The queue whose top runs next for a worker (`express`: the cheap queue only); null when none has a job.
  Queue* next_queue(bool express);

  mutable std::mutex mutex_;
  std::condition_variable work_available_;   // guarded by mutex_: a job for the workers
  std::condition_variable cheap_available_;  // guarded by mutex_: a job for the express workers
  Queue queue_;                              // guarded by mutex_: the jobs only the workers take
  Queue cheap_;                              // guarded by mutex_: those the express workers also take
  bool stopping_ = false;                                                           // guarded by mutex_
  std::uint64_t next_seq_ = 0;                                                      // guarded by mutex_
  PoolStats stats_;                                                                 // guarded by mutex_
  double latency_sum_ = 0.0;                                                        // guarded by mutex_
  double cheap_latency_sum_ = 0.0;                                                  // guarded by mutex_
  double cheap_run_sum_ = 0.0;                                                      // guarded by mutex_
  const std::chrono::steady_clock::time_point started_;
  // When shutdown() had joined the workers: the pool's life, over which busy_seconds is counted, ends there.
  std::optional<std::chrono::steady_clock::time_point> stopped_;  // guarded by mutex_
  // Filled by the constructor only; join_mutex_ serializes the joins of concurrent shutdown() calls.
  std::mutex join_mutex_;
  std::vector<std::thread> threads_;  // elements guarded by join_mutex_ (the workers, then the express ones)
  int num_workers_ = 0;
  ExpressWorkers express_;
  int nice_ = 0;
  std::vector<int> cpus_;  // sorted, unique; empty: not pinned
  cpu_set_t cpu_set_{};    // the same as a CPU set (set by the constructor, read by the workers)
};

}  // namespace asteria::runtime
