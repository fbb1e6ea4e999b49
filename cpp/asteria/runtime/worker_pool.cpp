#include "asteria/runtime/worker_pool.h"

#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "asteria/common/clock.h"
#include "asteria/common/errors.h"
#include "asteria/runtime/blas_threads.h"

namespace asteria::runtime {

namespace detail {

// One job's state, shared by the pool and the job's handles (which may outlive the pool).
struct JobRecord {
  JobRecord(std::uint64_t id, std::int64_t deadline, std::function<void()> fn)
      : id(id), deadline(deadline), fn(std::move(fn)), submitted(Clock::now()) {}

  const std::uint64_t id;
  const std::int64_t deadline;
  // Owned by whoever holds the job's queue entry: the pool while queued, then the worker that pops
  // it or the shutdown() that cancels it; so it needs no lock.
  std::function<void()> fn;
  const Clock::time_point submitted;
  bool cheap = false;  // queued where the express workers take it (set before it is queued, then only read)

  std::mutex mutex;
  std::condition_variable changed;     // guarded by mutex
  JobState state = JobState::kQueued;  // guarded by mutex
  std::exception_ptr error;            // guarded by mutex
};

}  // namespace detail

namespace {

using detail::JobRecord;

bool is_final(JobState state) {
  return state == JobState::kDone || state == JobState::kFailed || state == JobState::kCancelled;
}

void settle(JobRecord& record, JobState state, std::exception_ptr error) {
  {
    std::lock_guard lock(record.mutex);
    record.state = state;
    record.error = std::move(error);
  }
  record.changed.notify_all();
}

JobRecord& checked(const std::shared_ptr<JobRecord>& record, const char* method) {
  if (!record) throw InvalidArgument(std::string("[JobHandle::") + method + "] empty JobHandle");
  return *record;
}

}  // namespace

const char* to_string(JobState state) noexcept {
  switch (state) {
    case JobState::kQueued: return "queued";
    case JobState::kRunning: return "running";
    case JobState::kDone: return "done";
    case JobState::kFailed: return "failed";
    case JobState::kCancelled: return "cancelled";
  }
  return "unknown";
}

std::uint64_t JobHandle::id() const { return checked(record_, "id").id; }

JobState JobHandle::state() const {
  JobRecord& record = checked(record_, "state");
  std::lock_guard lock(record.mutex);
  return record.state;
}

bool JobHandle::finished() const { return is_final(state()); }

void JobHandle::wait(std::chrono::nanoseconds timeout) const {
  JobRecord& record = checked(record_, "wait");
  const auto started = Clock::now();
  std::unique_lock lock(record.mutex);
  if (!record.changed.wait_until(lock, deadline_after(timeout), [&] { return is_final(record.state); })) {
    throw TimeoutError("[JobHandle::wait] job " + std::to_string(record.id) + " (deadline " +
                       std::to_string(record.deadline) + ") still " + to_string(record.state) + " after waiting " +
                       format_seconds(std::chrono::duration<double>(Clock::now() - started).count()) +
                       " for it to finish");
  }
  if (record.state == JobState::kFailed) std::rethrow_exception(record.error);
  if (record.state == JobState::kCancelled) {
    throw CancelledError("[JobHandle::wait] job " + std::to_string(record.id) + " (deadline " +
                         std::to_string(record.deadline) + ") was cancelled: the pool shut down before it ran");
  }
}

namespace {

// The CPU set of `cpus`; throws InvalidArgument for a CPU outside [0, CPU_SETSIZE) or one this process
// may not run on (checked against the calling thread's own affinity).
cpu_set_t cpu_set_of(const std::vector<int>& cpus) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (pthread_getaffinity_np(pthread_self(), sizeof(allowed), &allowed) != 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) CPU_SET(c, &allowed);
  }
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int cpu : cpus) {
    if (cpu < 0 || cpu >= CPU_SETSIZE || !CPU_ISSET(cpu, &allowed)) {
      throw InvalidArgument("[WorkerPool] cpus contains " + std::to_string(cpu) +
                            ": must be CPUs this process may run on (its affinity set)");
    }
    CPU_SET(cpu, &set);
  }
  return set;
}

}  // namespace

WorkerPool::WorkerPool(int num_workers, int blas_threads, int nice, std::vector<int> cpus, ExpressWorkers express)
    : started_(Clock::now()) {
  if (num_workers < 1) {
    throw InvalidArgument("[WorkerPool] num_workers=" + std::to_string(num_workers) + " must be >= 1");
  }
  if (blas_threads < 1) {
    throw InvalidArgument("[WorkerPool] blas_threads=" + std::to_string(blas_threads) + " must be >= 1");
  }
  if (nice < 0 || nice > 19) {
    throw InvalidArgument("[WorkerPool] nice=" + std::to_string(nice) + " must be in [0, 19]");
  }
  if (express.count < 0) {
    throw InvalidArgument("[WorkerPool] Invalid express.count=" + std::to_string(express.count) + ": must be >= 0");
  }
  if (!(std::isfinite(express.max_cost) && express.max_cost >= 0.0)) {
    throw InvalidArgument("[WorkerPool] Invalid express.max_cost=" + format_number(express.max_cost) +
                          ": must be a finite number >= 0");
  }
  if (express.nice < 0 || express.nice > nice) {
    throw InvalidArgument("[WorkerPool] Invalid express.nice=" + std::to_string(express.nice) + ": must be in [0, " +
                          std::to_string(nice) + "] (at most the workers' nice, so that they preempt the workers)");
  }
  nice_ = nice;
  num_workers_ = num_workers;
  express_ = express;
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  if (!cpus.empty()) cpu_set_ = cpu_set_of(cpus);  // validates before any thread starts
  cpus_ = std::move(cpus);
  stats_.workers = num_workers;
  stats_.express_workers = express.count;
  threads_.reserve(static_cast<std::size_t>(num_workers + express.count));
  try {
    for (int i = 0; i < num_workers + express.count; ++i) {
      const bool is_express = i >= num_workers;
      threads_.emplace_back([this, blas_threads, is_express] { worker_loop(blas_threads, is_express); });
      // Named before the constructor returns, so that tools (top -H, gdb, py-spy) and tests tell the
      // workers from other threads; best effort: a refused name leaves the inherited one.
      (void)pthread_setname_np(threads_.back().native_handle(), is_express ? kExpressThreadName : kWorkerThreadName);
    }
  } catch (...) {
    // The destructor does not run for a half-built pool: stop the threads that did start.
    shutdown();
    throw;
  }
}

WorkerPool::~WorkerPool() { shutdown(); }

JobHandle WorkerPool::submit(std::int64_t deadline, std::function<void()> fn, double cost, JobClass job_class) {
  if (!fn) throw InvalidArgument("[WorkerPool::submit] fn is empty (deadline " + std::to_string(deadline) + ")");
  if (!(std::isfinite(cost) && cost >= 0.0)) {
    throw InvalidArgument("[WorkerPool::submit] Invalid cost=" + format_number(cost) +
                          ": must be a finite number >= 0 (deadline " + std::to_string(deadline) + ")");
  }
  std::shared_ptr<JobRecord> record;
  bool cheap = false;
  {
    std::lock_guard lock(mutex_);
    if (stopping_) {
      throw CancelledError("[WorkerPool::submit] the pool is shut down; job with deadline " +
                           std::to_string(deadline) + " not queued");
    }
    const std::uint64_t seq = next_seq_++;
    record = std::make_shared<JobRecord>(seq, deadline, std::move(fn));
    cheap = express_.count > 0 && cost <= express_.max_cost;
    record->cheap = cheap;
    (cheap ? cheap_ : queue_).push(QueueEntry{deadline, cost, job_class, seq, record});
    stats_.submitted += 1;
    stats_.queue_depth = queue_.size() + cheap_.size();
    stats_.max_queue_depth = std::max(stats_.max_queue_depth, stats_.queue_depth);
  }
  // A cheap job wakes a thread of each kind: whichever comes first takes it, the other finds the queue
  // empty and sleeps again (an express worker woken for a costly job would leave it to the sleeping workers).
  work_available_.notify_one();
  if (cheap) cheap_available_.notify_one();
  return JobHandle(std::move(record));
}

void WorkerPool::shutdown() {
  std::vector<std::shared_ptr<JobRecord>> cancelled;
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    for (Queue* queue : {&queue_, &cheap_}) {
      while (!queue->empty()) {
        cancelled.push_back(queue->top().record);
        queue->pop();
      }
    }
    stats_.cancelled += cancelled.size();
    stats_.queue_depth = 0;
  }
  work_available_.notify_all();
  cheap_available_.notify_all();
  // Outside mutex_: destroying a job's captures may run arbitrary code.
  for (const auto& record : cancelled) {
    record->fn = nullptr;
    settle(*record, JobState::kCancelled, nullptr);
  }
  std::lock_guard join_lock(join_mutex_);
  for (std::thread& thread : threads_) {
    if (thread.joinable()) thread.join();
  }
  std::lock_guard lock(mutex_);
  if (!stopped_) stopped_ = Clock::now();
}

PoolStats WorkerPool::stats() const {
  std::lock_guard lock(mutex_);
  PoolStats out = stats_;
  out.wall_seconds = std::chrono::duration<double>(stopped_.value_or(Clock::now()) - started_).count();
  const std::uint64_t ended = stats_.completed + stats_.failed;
  if (ended > 0) {
    out.mean_latency_seconds = latency_sum_ / static_cast<double>(ended);
    out.mean_run_seconds = (stats_.busy_seconds + stats_.express_busy_seconds) / static_cast<double>(ended);
  }
  if (stats_.cheap_ended > 0) {
    out.cheap_mean_latency_seconds = cheap_latency_sum_ / static_cast<double>(stats_.cheap_ended);
    out.cheap_mean_run_seconds = cheap_run_sum_ / static_cast<double>(stats_.cheap_ended);
  }
  return out;
}

WorkerPool::Queue* WorkerPool::next_queue(bool express) {
  if (express) return cheap_.empty() ? nullptr : &cheap_;
  if (queue_.empty()) return cheap_.empty() ? nullptr : &cheap_;
  if (cheap_.empty()) return &queue_;
  return queue_.top() > cheap_.top() ? &cheap_ : &queue_;
}

void WorkerPool::worker_loop(int blas_threads, bool express) {
  set_blas_threads(blas_threads);
  // At least its nice (a thread starts at its creator's nice); best effort: a refused change leaves it there.
  const int nice = express ? express_.nice : nice_;
  const auto tid = static_cast<id_t>(syscall(SYS_gettid));
  if (nice > 0 && getpriority(PRIO_PROCESS, tid) < nice) (void)setpriority(PRIO_PROCESS, tid, nice);
  if (!cpus_.empty()) {
    // Validated by the constructor; should the process's affinity have changed since, the kernel's
    // refusal leaves this worker where it is (best effort, like nice).
    (void)pthread_setaffinity_np(pthread_self(), sizeof(cpu_set_), &cpu_set_);
  }
  std::unique_lock lock(mutex_);
  for (;;) {
    (express ? cheap_available_ : work_available_).wait(lock, [&] {
      return stopping_ || next_queue(express) != nullptr;
    });
    // shutdown() empties the queues as it sets stopping_, so no job here means stop.
    Queue* queue = next_queue(express);
    if (queue == nullptr) return;
    std::shared_ptr<JobRecord> record = queue->top().record;
    queue->pop();
    stats_.queue_depth = queue_.size() + cheap_.size();
    lock.unlock();

    std::function<void()> fn = std::move(record->fn);
    const auto started = Clock::now();
    settle(*record, JobState::kRunning, nullptr);
    std::exception_ptr error;
    try {
      fn();
    } catch (...) {
      error = std::current_exception();
    }
    fn = nullptr;  // the job's captures die before its waiters wake
    const auto finished = Clock::now();
    const double run_seconds = std::chrono::duration<double>(finished - started).count();
    const double latency_seconds = std::chrono::duration<double>(finished - record->submitted).count();

    // Counted before the waiters wake, so that a caller that waited sees its job in stats().
    lock.lock();
    (error ? stats_.failed : stats_.completed) += 1;
    (express ? stats_.express_busy_seconds : stats_.busy_seconds) += run_seconds;
    stats_.max_run_seconds = std::max(stats_.max_run_seconds, run_seconds);
    latency_sum_ += latency_seconds;
    if (record->cheap) {
      stats_.cheap_ended += 1;
      cheap_latency_sum_ += latency_seconds;
      cheap_run_sum_ += run_seconds;
    }
    stats_.max_latency_seconds = std::max(stats_.max_latency_seconds, latency_seconds);
    lock.unlock();
    settle(*record, error ? JobState::kFailed : JobState::kDone, error);
    lock.lock();
  }
}

}  // namespace asteria::runtime
