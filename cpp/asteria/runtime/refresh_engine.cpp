#include "asteria/runtime/refresh_engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <utility>

#include "asteria/common/clock.h"
#include "asteria/common/errors.h"
#include "asteria/linalg/eigenbasis.h"

namespace asteria::runtime {

namespace {

std::size_t matrix_bytes(int n) {
  return static_cast<std::size_t>(n) * static_cast<std::size_t>(n) * sizeof(float);
}

// Elements of one result buffer: the root, or the basis plus its estimates and permutation rows.
std::int64_t result_elements(int n, RefreshKind kind) {
  const std::int64_t rows = kind == RefreshKind::kEigenbasis ? n + 2 : n;
  return rows * n;
}

std::string block_name(std::int64_t id) { return "block " + std::to_string(id); }

// Thrown inside a job that finds a newer version of its block queued (see RefreshEngine::submit).
struct Superseded {};

std::string job_name(std::int64_t id, std::int64_t version) {
  return block_name(id) + " version " + std::to_string(version);
}

// SplitMix64's finalizer: a well-mixed 64-bit hash, so that a job's random delay depends only on
// (seed, block, version) and not on which worker runs it or when.
std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

bool all_zero(const float* x, std::size_t count) {
  return std::all_of(x, x + count, [](float v) { return v == 0.0f; });
}

void write_identity(int n, float* out) {
  const std::size_t size = static_cast<std::size_t>(n);
  std::fill(out, out + size * size, 0.0f);
  for (std::size_t i = 0; i < size; ++i) out[i * size + i] = 1.0f;
}

}  // namespace

const char* to_string(FaultKind kind) noexcept {
  switch (kind) {
    case FaultKind::kThrow: return "throw";
    case FaultKind::kNonFinite: return "nonfinite";
    case FaultKind::kHang: return "hang";
    case FaultKind::kDelay: return "delay";
    case FaultKind::kPause: return "pause";
  }
  return "unknown";
}

struct RefreshEngine::Block {
  Block(std::int64_t id, const BlockMemory& memory)
      : n(memory.n),
        kind(memory.kind),
        snapshots(reinterpret_cast<std::byte*>(memory.snapshots), matrix_bytes(memory.n),
                  static_cast<std::size_t>(memory.snapshot_stride) * sizeof(float), memory.depth,
                  "block " + std::to_string(id) + " snapshots"),
        results(reinterpret_cast<std::byte*>(memory.results),
                static_cast<std::size_t>(result_elements(memory.n, memory.kind)) * sizeof(float),
                static_cast<std::size_t>(memory.result_stride) * sizeof(float), memory.depth,
                "block " + std::to_string(id) + " results"),
        result_base(memory.results),
        result_stride(memory.depth > 1 ? memory.result_stride : 0),
        depth(memory.depth) {}

  const int n;
  const RefreshKind kind;
  store::VersionedRing snapshots;
  store::VersionedRing results;
  float* const result_base;         // result buffer 0, in the caller's memory
  const std::int64_t result_stride;  // floats between result buffers
  const int depth;

  // Newest version submitted, any kind: an older job that starts later is superseded
  // (non-deterministic rule); guarded by mutex_.
  std::int64_t newest_submitted = 0;
  // The block's last job and its place in the pool's queue (the deadline it was queued with);
  // guarded by mutex_. A newer version submitted while that job is still queued takes its place.
  std::optional<JobHandle> queued_job;
  std::int64_t queued_deadline = 0;

  // The version activate() returned last (or the one given to set_basis); guarded by mutex_.
  std::int64_t activated = 0;

  // The eigenbasis chain, submission side; guarded by the engine's mutex_.
  std::optional<JobHandle> last_job;
  std::int64_t last_version = 0;  // newest version submitted or seeded
  std::int64_t last_activation_step = std::numeric_limits<std::int64_t>::min();

  // The eigenbasis chain, job side. The block's jobs already run one at a time, each waiting for its
  // predecessor; the mutex makes that visible and protects set_basis().
  std::mutex chain_mutex;
  std::vector<float> good_basis;  // guarded by chain_mutex; n x n, torch layout
  std::int64_t good_version = 0;  // guarded by chain_mutex; 0: no good basis yet
};

RefreshEngine::RefreshEngine(EngineConfig config) : config_(config), registry_(config.registry) {
  if (config.slot_timeout <= std::chrono::nanoseconds::zero()) {
    throw InvalidArgument("Invalid slot_timeout=" + std::to_string(config.slot_timeout.count()) +
                          " ns: must be > 0");
  }
  pool_ = std::make_unique<WorkerPool>(config.workers, config.blas_threads, config.worker_nice,
                                       config.worker_cpus);
}

RefreshEngine::~RefreshEngine() { close(); }

std::int64_t RefreshEngine::add_block(const BlockMemory& memory) {
  if (closed()) throw CancelledError("[RefreshEngine::add_block] the engine is closed");
  if (memory.n < 1) throw InvalidArgument("Invalid n=" + std::to_string(memory.n) + ": must be >= 1");
  if (memory.depth < 1) {
    throw InvalidArgument("Invalid depth=" + std::to_string(memory.depth) + ": must be >= 1");
  }
  if (memory.kind != RefreshKind::kInverseRoot && memory.kind != RefreshKind::kEigenbasis) {
    throw InvalidArgument("Invalid kind=" + std::to_string(static_cast<int>(memory.kind)));
  }
  const std::int64_t elems = static_cast<std::int64_t>(memory.n) * memory.n;
  const std::int64_t result_elems = result_elements(memory.n, memory.kind);
  if (memory.depth > 1 && (memory.snapshot_stride < elems || memory.result_stride < result_elems)) {
    throw InvalidArgument("Invalid strides (snapshots " + std::to_string(memory.snapshot_stride) + ", results " +
                          std::to_string(memory.result_stride) + "): must be >= n*n = " + std::to_string(elems) +
                          " and >= " + std::to_string(result_elems) +
                          (memory.kind == RefreshKind::kEigenbasis ? " = (n+2)*n" : " = n*n"));
  }
  if (memory.snapshots == nullptr || memory.results == nullptr) {
    throw InvalidArgument("Invalid block memory: snapshot and result buffers must not be null");
  }
  const std::int64_t id = registry_.add_block();
  blocks_.push_back(std::make_unique<Block>(id, memory));
  return id;
}

std::int64_t RefreshEngine::num_blocks() const { return static_cast<std::int64_t>(blocks_.size()); }

int RefreshEngine::block_dim(std::int64_t id) const { return block(id).n; }

int RefreshEngine::depth(std::int64_t id) const { return block(id).results.depth(); }

double RefreshEngine::job_cost(const Block& b) { return static_cast<double>(b.n) * b.n * b.n; }

RefreshEngine::Block& RefreshEngine::block(std::int64_t id) {
  return const_cast<Block&>(static_cast<const RefreshEngine&>(*this).block(id));
}

const RefreshEngine::Block& RefreshEngine::block(std::int64_t id) const {
  if (id < 0 || id >= static_cast<std::int64_t>(blocks_.size())) {
    throw InvalidArgument("Invalid block=" + std::to_string(id) + ": the engine has " +
                          std::to_string(blocks_.size()) + " blocks");
  }
  return *blocks_[static_cast<std::size_t>(id)];
}

void RefreshEngine::start_at(const std::vector<std::int64_t>& blocks, std::int64_t version) {
  if (version < 1) throw InvalidArgument("Invalid version=" + std::to_string(version) + ": must be >= 1");
  for (const std::int64_t id : blocks) {
    block(id).snapshots.retire_through(version - 1);
    block(id).results.retire_through(version - 1);
  }
}

void RefreshEngine::resume_at(const std::vector<std::int64_t>& blocks, const std::vector<std::int64_t>& versions) {
  for (const std::int64_t id : blocks) block(id);  // a bad id throws before anything changes
  registry_.resume_at(blocks, versions);            // all or nothing
  std::lock_guard lock(mutex_);
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    Block& b = block(blocks[i]);
    b.activated = std::max(b.activated, versions[i]);
  }
}

void RefreshEngine::begin_snapshot(const std::vector<std::int64_t>& blocks, std::int64_t version,
                                   std::chrono::nanoseconds timeout) {
  if (closed()) throw CancelledError("[RefreshEngine::begin_snapshot] the engine is closed");
  const auto started = Clock::now();
  const auto deadline = deadline_after(timeout);
  bool any_waited = false;
  for (const std::int64_t id : blocks) {
    bool waited = false;
    block(id).snapshots.begin_write(version, time_left(deadline), &waited);
    any_waited = any_waited || waited;
  }
  if (any_waited) {
    // A snapshot buffer still being read means the workers lag the schedule: the training thread
    // blocks here as it would at the activation barrier, and is counted the same way.
    const double seconds = seconds_since(started);
    std::lock_guard lock(mutex_);
    snapshot_waits_ += 1;
    snapshot_wait_seconds_ += seconds;
  }
}

void RefreshEngine::submit(const std::vector<std::int64_t>& blocks, std::int64_t version,
                           std::int64_t activation_step, const linalg::RootSpec& spec, double skip_tol) {
  if (activation_step < 0) {
    throw InvalidArgument("[RefreshEngine::submit] Invalid activation_step=" + std::to_string(activation_step) +
                          ": must be a step >= 0");
  }
  const bool any_root = std::any_of(blocks.begin(), blocks.end(),
                                    [&](std::int64_t id) { return block(id).kind == RefreshKind::kInverseRoot; });
  if (any_root) {
    linalg::validate(spec);
  } else if (!(std::isfinite(spec.scale) && spec.scale > 0)) {
    throw InvalidArgument("Invalid scale=" + std::to_string(spec.scale) + ": must be a finite number > 0");
  }
  if (!(std::isfinite(skip_tol) && skip_tol >= 0)) {
    throw InvalidArgument("Invalid skip_tol=" + std::to_string(skip_tol) + ": must be a finite number >= 0");
  }
  {
    std::lock_guard lock(mutex_);
    if (closed_) throw CancelledError("[RefreshEngine::submit] the engine is closed");
    for (const std::int64_t id : blocks) {
      const Block& b = block(id);
      if (b.kind != RefreshKind::kEigenbasis) continue;
      if (version <= b.last_version || activation_step < b.last_activation_step) {
        throw InvalidArgument("[RefreshEngine::submit] " + block_name(id) + ": eigenbasis version " +
                              std::to_string(version) + " (activation step " + std::to_string(activation_step) +
                              ") must come after version " + std::to_string(b.last_version) +
                              " with an activation step >= " + std::to_string(b.last_activation_step) +
                              ": each job warm-starts from the one before");
      }
    }
    // Ended jobs are dropped here so that the list only ever holds the work in flight.
    std::erase_if(in_flight_, [](const JobHandle& job) { return job.finished(); });
  }
  for (const std::int64_t id : blocks) {
    Block& b = block(id);
    std::optional<JobHandle> previous;
    if (b.kind == RefreshKind::kEigenbasis) {
      std::lock_guard lock(mutex_);
      previous = b.last_job;
    }
    b.snapshots.publish(version);
    // The job's pin keeps the snapshot intact until the job has read it; retiring it right away lets
    // the buffer be reused as soon as that pin is released.
    b.snapshots.acquire(version);
    b.snapshots.retire_through(version);
    registry_.note_snapshot(id, version, activation_step);
    // The pool runs jobs by deadline. Under the non-deterministic rule a queued older job of the block
    // will be superseded when it starts, so the new one is queued at that job's deadline (right behind
    // it): otherwise a block whose versions keep being superseded while the workers are behind would
    // move to the back of the queue with each new version, until the staleness bound made the training
    // thread wait for it. The registry keeps the version's own activation step.
    std::int64_t deadline = activation_step;
    {
      std::lock_guard lock(mutex_);
      b.newest_submitted = std::max(b.newest_submitted, version);
      if (!config_.registry.deterministic && b.queued_job && b.queued_job->state() == JobState::kQueued) {
        deadline = std::min(deadline, b.queued_deadline);
      }
    }
    // Among the jobs due at one step, the largest blocks start first (their O(n^3) numerics take longest):
    // the last of the step's versions is then done sooner on several workers. The cost must be the same for
    // every job of a block: the pool then keeps a block's jobs in (deadline, submission) order, which the
    // eigenbasis chain relies on (job v waits for job v - 1, which must have been dequeued before it).
    const double cost = job_cost(b);
    JobHandle job;
    try {
      job = pool_->submit(deadline, [this, id, version, spec, skip_tol, previous] {
        run_job(id, version, spec, skip_tol, previous);
      }, cost);
    } catch (const CancelledError& e) {
      b.snapshots.release(version);
      registry_.note_finished(id, version, false, e.what());
      throw;
    }
    std::lock_guard lock(mutex_);
    b.queued_job = job;
    b.queued_deadline = deadline;
    if (b.kind == RefreshKind::kEigenbasis) {
      b.last_job = job;
      b.last_version = version;
      b.last_activation_step = activation_step;
    }
    in_flight_.push_back(std::move(job));
  }
}

void RefreshEngine::set_basis(std::int64_t id, std::int64_t version, const float* basis) {
  Block& b = block(id);
  const std::string where = "[RefreshEngine::set_basis] " + block_name(id) + ": ";
  if (b.kind != RefreshKind::kEigenbasis) throw InvalidArgument(where + "not an eigenbasis block");
  if (basis == nullptr) throw InvalidArgument(where + "Invalid null basis");
  const std::size_t nn = static_cast<std::size_t>(b.n) * static_cast<std::size_t>(b.n);
  if (!std::all_of(basis, basis + nn, [](float x) { return std::isfinite(x); })) {
    throw InvalidArgument(where + "the basis of version " + std::to_string(version) + " is not finite");
  }
  std::lock_guard lock(mutex_);
  if (version < 1 || version < b.last_version || (b.last_job && !b.last_job->finished())) {
    throw InvalidArgument(where + "Invalid version=" + std::to_string(version) +
                          ": must be >= 1 and >= the newest submitted version " + std::to_string(b.last_version) +
                          ", with no eigenbasis job of the block in flight");
  }
  b.last_version = version;
  b.activated = version;
  std::lock_guard chain(b.chain_mutex);
  b.good_basis.assign(basis, basis + nn);
  b.good_version = version;
}

void RefreshEngine::run_job(std::int64_t id, std::int64_t version, const linalg::RootSpec& spec, double skip_tol,
                            const std::optional<JobHandle>& previous) {
  Block& b = block(id);
  const auto started = Clock::now();
  JobOutcome outcome;
  std::string error;
  bool superseded = false;
  try {
    // Same buffer that submit() pinned: acquiring again only reads its address.
    const auto* input = reinterpret_cast<const float*>(b.snapshots.acquire(version));
    b.snapshots.release(version);
    float* output = nullptr;
    try {
      if (previous) {
        // The previous job of the chain was dequeued before this one (submit() keeps the chain's
        // deadlines in order), so it is running or has ended; its failure is in the registry already.
        try {
          previous->wait(config_.slot_timeout);
        } catch (const TimeoutError& e) {
          throw TimeoutError("[RefreshEngine] " + block_name(id) + " version " + std::to_string(version) +
                             ": the previous eigenbasis job did not end: " + e.what());
        } catch (const std::exception&) {
        }
      }
      output = reinterpret_cast<float*>(b.results.begin_write(version, config_.slot_timeout));
    } catch (...) {
      b.snapshots.release(version);
      throw;
    }
    try {
      if (!config_.registry.deterministic) {
        std::lock_guard lock(mutex_);
        superseded = b.newest_submitted > version;
      }
      if (superseded) throw Superseded{};
      // One atomic load when no fault is armed.
      std::optional<Fault> fault;
      if (faults_armed_.load(std::memory_order_acquire)) fault = take_fault(id, version);
      if (fault) apply_fault(*fault, id, version);
      const bool poison = fault && fault->kind == FaultKind::kNonFinite;
      const std::size_t nn = static_cast<std::size_t>(b.n) * static_cast<std::size_t>(b.n);
      if (b.kind == RefreshKind::kInverseRoot && all_zero(input, nn)) {
        // A zero factor (its parameter has had no usable gradient yet) tells nothing: the identity, not
        // (eps I)^exponent, whose scale eps^exponent (10^3 per mode at eps 1e-12 and exponent -1/4)
        // would multiply the block's steps.
        write_identity(b.n, output);
        if (poison) output[0] = std::numeric_limits<float>::quiet_NaN();
        gate_result(id, version, output, nn);
      } else if (b.kind == RefreshKind::kInverseRoot) {
        outcome.used_float64 = linalg::inverse_root(b.n, input, b.n, output, b.n, spec).used_float64;
        if (poison) output[0] = std::numeric_limits<float>::quiet_NaN();
        gate_result(id, version, output, nn);
      } else {
        outcome = compute_eigenbasis(b, id, version, input, output, spec, skip_tol, poison);
      }
    } catch (...) {
      b.snapshots.release(version);
      b.results.fail(version);
      throw;
    }
    b.snapshots.release(version);
    b.results.publish(version);
  } catch (const Superseded&) {
    // Nothing computed: the buffers are free again, and the newer version is queued.
  } catch (const std::exception& e) {
    error = e.what();
    if (error.empty()) error = "unknown error";
  } catch (...) {
    error = "unknown non-standard exception";
  }
  if (superseded) {
    registry_.note_superseded(id, version);  // counted there (EngineStats reads it)
    return;
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - started).count();
  {
    std::lock_guard lock(mutex_);
    (error.empty() ? refreshes_ok_ : refreshes_failed_) += 1;
    float64_retries_ += outcome.used_float64 ? 1 : 0;
    refreshes_skipped_ += outcome.skipped ? 1 : 0;
    refresh_seconds_ += seconds;
  }
  registry_.note_finished(id, version, error.empty(), error);
}

RefreshEngine::JobOutcome RefreshEngine::compute_eigenbasis(Block& b, std::int64_t id, std::int64_t version,
                                                            const float* input, float* output,
                                                            const linalg::RootSpec& spec, double skip_tol,
                                                            bool poison) {
  const std::size_t nn = static_cast<std::size_t>(b.n) * static_cast<std::size_t>(b.n);
  float* q = output;
  float* estimates = output + nn;
  float* perm = estimates + b.n;
  JobOutcome outcome;
  std::lock_guard chain(b.chain_mutex);
  // No basis yet, or the identity of a zero factor (a block whose parameter had no gradient yet): the
  // full eigendecomposition, as at a block's first refresh.
  if (b.good_version == 0 || linalg::is_identity(b.n, b.good_basis.data())) {
    outcome.used_float64 = linalg::eigenbasis(b.n, input, q, estimates, spec.scale).used_float64;
    std::iota(perm, perm + b.n, 0.0f);
  } else {
    const linalg::BasisReport report =
        linalg::qr_refresh(b.n, input, b.good_basis.data(), q, estimates, perm, spec.scale, skip_tol);
    outcome.used_float64 = report.used_float64;
    outcome.skipped = report.skipped;
  }
  if (poison) q[0] = std::numeric_limits<float>::quiet_NaN();
  // The basis and its estimates; a rejected result never becomes the chain's good basis.
  gate_result(id, version, output, nn + static_cast<std::size_t>(b.n));
  b.good_basis.assign(q, q + nn);
  b.good_version = version;
  return outcome;
}

std::vector<coherence::Activation> RefreshEngine::activate(std::int64_t step, std::chrono::nanoseconds timeout) {
  if (closed()) throw CancelledError("[RefreshEngine::activate] the engine is closed");
  std::vector<coherence::Activation> changes = registry_.activate(step, timeout);
  std::lock_guard lock(mutex_);
  for (const auto& change : changes) {
    Block& b = block(change.block);
    b.results.acquire(change.version);
    if (b.kind == RefreshKind::kEigenbasis) compose_order(b, change.version);
    b.activated = change.version;
  }
  return changes;
}

float* RefreshEngine::order_row(Block& b, std::int64_t version) {
  const std::int64_t buffer = version % b.depth;
  return b.result_base + buffer * b.result_stride + static_cast<std::int64_t>(b.n) * (b.n + 1);
}

void RefreshEngine::compose_order(Block& b, std::int64_t version) {
  // Version v's order is relative to the newest good basis before it. When activation passes over
  // good versions (the newest finished one under the non-deterministic rule, or several versions due
  // at once), the caller's state is still in the order of the version it has: compose the skipped
  // versions' orders, newest last, so that the row says where each column comes from in that one.
  // Skipped versions stay published until release() retires them, and only this thread retires.
  if (b.activated == 0) return;
  float* composed = order_row(b, version);
  for (std::int64_t u = version - 1; u > b.activated; --u) {
    if (b.results.state(u) != store::SlotState::kPublished) continue;  // failed: not in the chain
    const float* order = order_row(b, u);
    for (int j = 0; j < b.n; ++j) composed[j] = order[static_cast<int>(composed[j])];
  }
}

void RefreshEngine::release(std::int64_t id, std::int64_t version) {
  Block& b = block(id);
  b.results.release(version);
  // The caller has its own copy of this version now; neither it nor anything older is needed again.
  b.results.retire_through(version);
}

void RefreshEngine::drain(std::chrono::nanoseconds timeout) {
  std::vector<JobHandle> jobs;
  {
    std::lock_guard lock(mutex_);
    jobs = in_flight_;
  }
  const auto deadline = deadline_after(timeout);
  for (const JobHandle& job : jobs) {
    try {
      job.wait(time_left(deadline));
    } catch (const CancelledError&) {
      // A cancelled job has ended; its block's registry entry already says so.
    }
  }
}

void RefreshEngine::close() {
  {
    std::lock_guard lock(mutex_);
    if (closed_) return;
    closed_ = true;
  }
  {
    // Hung and delayed jobs (fault injection) end now, so that shutdown() below can join them.
    std::lock_guard lock(fault_mutex_);
    closing_ = true;
  }
  fault_released_.notify_all();
  // Queued jobs are cancelled without running; their versions never activate, which is moot once
  // the engine is closed (activate() refuses from here on).
  pool_->shutdown();
  std::lock_guard lock(mutex_);
  in_flight_.clear();
}

bool RefreshEngine::closed() const {
  std::lock_guard lock(mutex_);
  return closed_;
}

coherence::BlockStatus RefreshEngine::status(std::int64_t id) const {
  block(id);
  return registry_.status(id);
}

EngineStats RefreshEngine::stats() const {
  EngineStats out;
  out.pool = pool_->stats();
  out.registry = registry_.stats();
  std::lock_guard lock(mutex_);
  out.refreshes_ok = refreshes_ok_;
  out.refreshes_failed = refreshes_failed_;
  out.float64_retries = float64_retries_;
  out.refreshes_skipped = refreshes_skipped_;
  out.refreshes_superseded = out.registry.superseded_versions;
  out.snapshot_waits = snapshot_waits_;
  out.snapshot_wait_seconds = snapshot_wait_seconds_;
  out.refresh_seconds = refresh_seconds_;
  std::lock_guard faults(fault_mutex_);
  out.faults_triggered = faults_triggered_;
  return out;
}

void RefreshEngine::gate_result(std::int64_t id, std::int64_t version, const float* result, std::size_t count) {
  if (!std::all_of(result, result + count, [](float x) { return std::isfinite(x); })) {
    throw NumericalError("[RefreshEngine] " + job_name(id, version) +
                         ": the result is not finite (quality gate); the previous version stays in use");
  }
}

void RefreshEngine::inject_fault(std::int64_t id, std::int64_t version, FaultKind kind,
                                 std::chrono::nanoseconds duration) {
  block(id);
  const std::string where = "[RefreshEngine::inject_fault] " + block_name(id) + ": ";
  if (version < 0) {
    throw InvalidArgument(where + "Invalid version=" + std::to_string(version) + ": must be >= 1, or " +
                          std::to_string(kAnyVersion) + " for every version");
  }
  switch (kind) {
    case FaultKind::kDelay:
      if (duration <= std::chrono::nanoseconds::zero()) {
        throw InvalidArgument(where + "Invalid duration=" + std::to_string(duration.count()) +
                              " ns: a delay must be > 0");
      }
      break;
    case FaultKind::kHang:
      if (duration < std::chrono::nanoseconds::zero()) {
        throw InvalidArgument(where + "Invalid duration=" + std::to_string(duration.count()) +
                              " ns: a hang's bound must be >= 0 (0: until close())");
      }
      break;
    case FaultKind::kThrow:
    case FaultKind::kNonFinite:
    case FaultKind::kPause:
      if (duration != std::chrono::nanoseconds::zero()) {
        throw InvalidArgument(where + "Invalid duration=" + std::to_string(duration.count()) + " ns: only kinds 'delay' and 'hang' take a duration, not '" + to_string(kind) + "'");
      }
      break;
    default:
      throw InvalidArgument(where + "Invalid kind=" + std::to_string(static_cast<int>(kind)));
  }
  std::lock_guard lock(fault_mutex_);
  faults_[{id, version}] = Fault{kind, duration};
  faults_armed_.store(true, std::memory_order_release);
}

void RefreshEngine::set_random_delay(std::chrono::nanoseconds max_delay, std::uint64_t seed) {
  if (max_delay < std::chrono::nanoseconds::zero()) {
    throw InvalidArgument("[RefreshEngine::set_random_delay] Invalid max_delay=" + std::to_string(max_delay.count()) +
                          " ns: must be >= 0 (0 turns the delay off)");
  }
  std::lock_guard lock(fault_mutex_);
  max_random_delay_ = max_delay;
  delay_seed_ = seed;
  faults_armed_.store(!faults_.empty() || max_random_delay_ > std::chrono::nanoseconds::zero(),
                      std::memory_order_release);
}

void RefreshEngine::clear_faults() {
  std::lock_guard lock(fault_mutex_);
  faults_.clear();
  max_random_delay_ = std::chrono::nanoseconds::zero();
  faults_armed_.store(false, std::memory_order_release);
}

std::optional<RefreshEngine::Fault> RefreshEngine::take_fault(std::int64_t id, std::int64_t version) {
  std::lock_guard lock(fault_mutex_);
  std::optional<Fault> fault;
  if (const auto exact = faults_.find({id, version}); exact != faults_.end()) {
    fault = exact->second;
    faults_.erase(exact);
  } else if (const auto any = faults_.find({id, kAnyVersion}); any != faults_.end()) {
    fault = any->second;
  } else if (max_random_delay_ > std::chrono::nanoseconds::zero()) {
    const std::uint64_t h = mix(delay_seed_ ^ mix(static_cast<std::uint64_t>(id) ^ mix(static_cast<std::uint64_t>(version))));
    // 53 random bits as a fraction in [0, 1).
    const double fraction = static_cast<double>(h >> 11) * 0x1.0p-53;
    fault = Fault{FaultKind::kDelay, std::chrono::nanoseconds(static_cast<std::int64_t>(
                                         fraction * static_cast<double>(max_random_delay_.count())))};
  }
  if (fault) faults_triggered_ += 1;
  faults_armed_.store(!faults_.empty() || max_random_delay_ > std::chrono::nanoseconds::zero(),
                      std::memory_order_release);
  return fault;
}

void RefreshEngine::apply_fault(const Fault& fault, std::int64_t id, std::int64_t version) {
  const std::string where = "[RefreshEngine] " + job_name(id, version) + ": ";
  switch (fault.kind) {
    case FaultKind::kThrow:
      throw Error(where + "injected worker exception (fault injection)");
    case FaultKind::kNonFinite:
      return;  // applied to the result, before the quality gate
    case FaultKind::kHang: {
      // A simulated genuine hang: nothing but close() (or the hang's own bound, if it has one) ends it.
      const auto started = Clock::now();
      const auto until = fault.duration > std::chrono::nanoseconds::zero() ? deadline_after(fault.duration)
                                                                            : deadline_after(std::chrono::nanoseconds::max());
      std::unique_lock lock(fault_mutex_);
      if (fault_released_.wait_until(lock, until, [this] { return closing_; })) {
        throw CancelledError(where + "injected hang ended by close() (fault injection)");
      }
      throw TimeoutError(where + "injected hang ended after " + format_seconds(seconds_since(started)) +
                         " (fault injection)");
    }
    case FaultKind::kDelay: {
      std::unique_lock lock(fault_mutex_);
      fault_released_.wait_until(lock, deadline_after(fault.duration), [this] { return closing_; });
      return;
    }
    case FaultKind::kPause: {
      std::unique_lock lock(fault_mutex_);
      const std::uint64_t generation = pause_generation_;
      paused_ += 1;
      fault_released_.notify_all();  // wakes wait_paused()
      fault_released_.wait(lock, [&] { return closing_ || pause_generation_ != generation; });
      if (pause_generation_ == generation) paused_ -= 1;  // else release_pauses() reset the count
      if (closing_) throw CancelledError(where + "paused job ended by close() (fault injection)");
      return;
    }
  }
}

void RefreshEngine::wait_paused(int count, std::chrono::nanoseconds timeout) {
  std::unique_lock lock(fault_mutex_);
  if (!fault_released_.wait_until(lock, deadline_after(timeout), [&] { return paused_ >= count; })) {
    throw TimeoutError("[RefreshEngine::wait_paused] " + std::to_string(paused_) + " jobs paused, not " +
                       std::to_string(count) + ", after " + format_seconds(std::chrono::duration<double>(timeout).count()));
  }
}

void RefreshEngine::release_pauses() {
  {
    std::lock_guard lock(fault_mutex_);
    pause_generation_ += 1;
    paused_ = 0;  // the released jobs no longer count, even before they wake
  }
  fault_released_.notify_all();
}

}  // namespace asteria::runtime
