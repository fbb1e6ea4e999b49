#include "asteria/runtime/refresh_engine.h"
#include "asteria/runtime/refresh_engine_impl.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>
#include <set>
#include <string>
#include <utility>

#include "asteria/common/clock.h"
#include "asteria/common/errors.h"
#include "asteria/linalg/eigenbasis.h"

namespace asteria::runtime {

namespace {

// Thrown inside a job that finds a newer version of its block queued (see RefreshEngine::submit).
struct Superseded {};

bool all_zero(const float* x, std::size_t count) {
  return std::all_of(x, x + count, [](float v) { return v == 0.0f; });
}

// A packed snapshot (the lower triangle, row by row) written out as the full symmetric n x n matrix.
void unpack_lower(int n, const float* packed, float* out) {
  const std::size_t size = static_cast<std::size_t>(n);
  std::size_t k = 0;
  for (std::size_t i = 0; i < size; ++i) {
    for (std::size_t j = 0; j <= i; ++j, ++k) {
      out[i * size + j] = packed[k];
      out[j * size + i] = packed[k];
    }
  }
}

void write_identity(int n, float* out) {
  const std::size_t size = static_cast<std::size_t>(n);
  std::fill(out, out + size * size, 0.0f);
  for (std::size_t i = 0; i < size; ++i) out[i * size + i] = 1.0f;
}

}  // namespace

using detail::block_name;
using detail::listed_before;
using detail::job_name;
using detail::result_elements;

std::int64_t snapshot_elements(int n, bool packed) {
  const std::int64_t size = n;
  return packed ? size * (size + 1) / 2 : size * size;
}

RefreshEngine::RefreshEngine(EngineConfig config) : config_(config), registry_(config.registry) {
  if (config.slot_timeout <= std::chrono::nanoseconds::zero()) {
    throw InvalidArgument("Invalid slot_timeout=" + std::to_string(config.slot_timeout.count()) +
                          " ns: must be > 0");
  }
  if (config.express_workers < 0) {
    throw InvalidArgument("Invalid express_workers=" + std::to_string(config.express_workers) + ": must be >= 0");
  }
  if (config.express_max_n < 0) {
    throw InvalidArgument("Invalid express_max_n=" + std::to_string(config.express_max_n) + ": must be >= 0");
  }
  const double max_n = config.express_max_n;
  pool_ = std::make_unique<WorkerPool>(
      config.workers, config.blas_threads, config.worker_nice, config.worker_cpus,
      ExpressWorkers{config.express_workers, max_n * max_n * max_n, config.worker_nice / 2});
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
  const std::int64_t elems = snapshot_elements(memory.n, memory.packed);
  const std::int64_t result_elems = result_elements(memory.n, memory.kind);
  if (memory.depth > 1 && (memory.snapshot_stride < elems || memory.result_stride < result_elems)) {
    throw InvalidArgument("Invalid strides (snapshots " + std::to_string(memory.snapshot_stride) + ", results " +
                          std::to_string(memory.result_stride) + "): must be >= " +
                          (memory.packed ? "n*(n+1)/2 = " : "n*n = ") + std::to_string(elems) +
                          " and >= " + std::to_string(result_elems) +
                          (memory.kind == RefreshKind::kEigenbasis ? " = (n+2)*n" : " = n*n"));
  }
  if (memory.first_from_identity && memory.kind != RefreshKind::kEigenbasis) {
    throw InvalidArgument("Invalid first_from_identity=true: only an eigenbasis block takes its first basis by a QR "
                          "step from the identity");
  }
  if (memory.snapshots == nullptr || memory.results == nullptr) {
    throw InvalidArgument("Invalid block memory: snapshot and result buffers must not be null");
  }
  // Two blocks over the same bytes would read each other's snapshots and overwrite each other's results.
  const std::string name = block_name(num_blocks());
  std::vector<store::ByteExtents::Extent> extents;
  for (int i = 0; i < memory.depth; ++i) {
    extents.push_back({reinterpret_cast<const std::byte*>(memory.snapshots + i * memory.snapshot_stride),
                       static_cast<std::size_t>(elems) * sizeof(float),
                       name + "'s snapshot buffer " + std::to_string(i)});
    extents.push_back({reinterpret_cast<const std::byte*>(memory.results + i * memory.result_stride),
                       static_cast<std::size_t>(result_elems) * sizeof(float),
                       name + "'s result buffer " + std::to_string(i)});
  }
  memory_.add(extents);  // all or nothing, before the block exists
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

void RefreshEngine::skip(const std::vector<std::int64_t>& blocks, std::int64_t version) {
  // Every block is checked before any changes: a bad id, a version written or skipped before, a block listed twice.
  for (auto it = blocks.begin(); it != blocks.end(); ++it) {
    if (listed_before(blocks, it)) {
      throw InvalidArgument("[RefreshEngine::skip] Invalid blocks: " + block_name(*it) + " is listed twice");
    }
    block(*it).snapshots.check_open(version);
    block(*it).results.check_open(version);
  }
  for (const std::int64_t id : blocks) {
    block(id).snapshots.skip(version);
    block(id).results.skip(version);
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
  std::size_t claimed = 0;
  try {
    for (; claimed < blocks.size(); ++claimed) {
      bool waited = false;
      block(blocks[claimed]).snapshots.begin_write(version, time_left(deadline), &waited);
      any_waited = any_waited || waited;
    }
  } catch (...) {
    while (claimed > 0) block(blocks[--claimed]).snapshots.abandon_write(version);
    throw;
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

void RefreshEngine::abandon_snapshot(const std::vector<std::int64_t>& blocks, std::int64_t version) {
  for (auto it = blocks.begin(); it != blocks.end(); ++it) {
    const bool twice = listed_before(blocks, it);
    if (twice || block(*it).snapshots.state(version) != store::SlotState::kWriting) {
      throw InvalidArgument("[RefreshEngine::abandon_snapshot] " + block_name(*it) + ": Invalid version=" +
                            std::to_string(version) + (twice ? ": the block is listed twice"
                                                             : ": must be claimed by begin_snapshot and not submitted"));
    }
  }
  for (const std::int64_t id : blocks) block(id).snapshots.abandon_write(version);
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
  // Every block is checked before any changes: a refused call leaves no snapshot pinned or published.
  for (auto it = blocks.begin(); it != blocks.end(); ++it) {
    const std::int64_t newest = registry_.status(*it).newest_snapshot;
    const bool twice = listed_before(blocks, it);
    if (twice || version <= newest || block(*it).snapshots.state(version) != store::SlotState::kWriting) {
      throw InvalidArgument("[RefreshEngine::submit] " + block_name(*it) + ": Invalid version=" +
                            std::to_string(version) + (twice ? ": the block is listed twice" : ": must be > the newest "
                            "snapshot, version " + std::to_string(newest) + ", and written since begin_snapshot"));
    }
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
      if (b.seeded_next != 0 && version != b.seeded_next) {
        throw InvalidArgument("[RefreshEngine::submit] " + block_name(id) + ": eigenbasis version " +
                              std::to_string(version) + " submitted, but seed_basis left the basis for version " +
                              std::to_string(b.seeded_next) + " in that version's result buffer");
      }
      if (b.chain_needs_basis) {
        throw InvalidArgument("[RefreshEngine::submit] " + block_name(id) + ": eigenbasis version " +
                              std::to_string(b.last_version) + " was computed outside the engine; seed the "
                              "chain with its basis (set_basis or seed_basis) before submitting version " + std::to_string(version));
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
    // the last of the step's versions is then done sooner on several workers; background jobs (see
    // QueueOrder) run the smallest first. The cost must be the same for every job of a block, and a block's
    // background versions follow its due ones: the pool then keeps a block's jobs in (deadline, submission)
    // order, which the eigenbasis chain relies on (job v waits for job v - 1, which must have been dequeued
    // before it).
    const double cost = job_cost(b);
    const JobClass job_class = config_.queue_order == QueueOrder::kShortest && !config_.registry.deterministic &&
                                       version > config_.registry.sync_versions
                                   ? JobClass::kBackground
                                   : JobClass::kDue;
    JobHandle job;
    try {
      job = pool_->submit(deadline, [this, id, version, spec, skip_tol, previous] {
        run_job(id, version, spec, skip_tol, previous);
      }, cost, job_class);
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
      b.seeded_next = 0;
      b.last_activation_step = activation_step;
    }
    in_flight_.push_back(std::move(job));
  }
}

void RefreshEngine::run_job(std::int64_t id, std::int64_t version, const linalg::RootSpec& spec, double skip_tol,
                            const std::optional<JobHandle>& previous) {
  Block& b = block(id);
  // With one BLAS thread, the job's CPU time: beside express workers a costly job shares its core, and the
  // balancer compares these seconds with the cores' capacity. (More BLAS threads compute in OpenBLAS's own
  // threads, out of this thread's CPU time: then the wall time.)
  const bool on_this_thread = config_.blas_threads == 1;
  const auto wall_started = Clock::now();
  const double started = on_this_thread ? thread_cpu_seconds() : 0.0;
  double injected_seconds = 0.0;  // an injected delay stands for a slow job: it counts as the job's work
  JobOutcome outcome;
  std::string error;
  bool superseded = false;
  // Under the non-deterministic rule a job whose block has a newer version submitted does not compute: checked
  // before the job claims its result buffer (a newer version, the device lane's, may be in use already, which
  // retired this one there) and again after, since the claim may have waited.
  const auto drop_if_superseded = [&] {
    if (!config_.registry.deterministic) {
      std::lock_guard lock(mutex_);
      superseded = b.newest_submitted > version;
    }
    if (superseded) throw Superseded{};
  };
  try {
    // Same buffer that submit() pinned: acquiring again only reads its address.
    const auto* input = reinterpret_cast<const float*>(b.snapshots.acquire(version));
    b.snapshots.release(version);
    // A packed snapshot is unpacked into this worker's own buffer, where the numerics read the matrix.
    thread_local std::vector<float> unpacked;
    float* output = nullptr;
    try {
      // A seed lies in this job's own result buffer: taken before anything else, even by a job superseded
      // (the next one then warm-starts from it), and before the job claims that buffer.
      if (b.kind == RefreshKind::kEigenbasis) adopt_seed(b, id);
      drop_if_superseded();
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
      // The version never claimed its result buffer, so nothing would fail or retire it there: the version a
      // ring's depth later would wait for that buffer as this one did. (Already retired: nothing waits.)
      try {
        b.results.skip(version);
      } catch (const InvalidArgument&) {
      }
      throw;
    }
    try {
      drop_if_superseded();
      if (b.packed) {
        unpacked.resize(static_cast<std::size_t>(b.n) * static_cast<std::size_t>(b.n));
        unpack_lower(b.n, input, unpacked.data());
        input = unpacked.data();
      }
      // One atomic load when no fault is armed.
      std::optional<Fault> fault;
      if (faults_armed_.load(std::memory_order_acquire)) fault = take_fault(id, version);
      if (fault) apply_fault(*fault, id, version);
      if (fault && fault->kind == FaultKind::kDelay && on_this_thread) {
        injected_seconds = std::chrono::duration<double>(fault->duration).count();
      }
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
        if (outcome.passed_over) {
          // (the deterministic rule's jobs never skip their wait for the previous one: there it is a defect)
          if (config_.registry.deterministic) throw Error("the eigenbasis chain holds a newer version's basis");
          superseded = true;
          throw Superseded{};
        }
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
  const double seconds =
      on_this_thread ? thread_cpu_seconds() - started + injected_seconds : seconds_since(wall_started);
  {
    std::lock_guard lock(mutex_);
    (error.empty() ? refreshes_ok_ : refreshes_failed_) += 1;
    float64_retries_ += outcome.used_float64 ? 1 : 0;
    refreshes_skipped_ += outcome.skipped ? 1 : 0;
    refresh_seconds_ += seconds;
    DimTiming& timing = by_dim_[b.n];
    timing.seconds += seconds;
    timing.jobs += 1;
  }
  registry_.note_finished(id, version, error.empty(), error);
}

std::vector<coherence::Activation> RefreshEngine::activate(std::int64_t step, std::chrono::nanoseconds timeout) {
  // A closed engine's registry refuses (CancelledError), also a wait that close() ends.
  std::vector<coherence::Activation> changes = registry_.activate(step, timeout);
  std::lock_guard lock(mutex_);
  for (const auto& change : changes) {
    Block& b = block(change.block);
    if (!b.external.contains(change.version)) {
      b.results.acquire(change.version);
      if (b.kind == RefreshKind::kEigenbasis) compose_order(b, change.version);
    }
    b.activated = change.version;
  }
  return changes;
}

void RefreshEngine::release(std::int64_t id, std::int64_t version) {
  Block& b = block(id);
  const bool external = [&] {
    std::lock_guard lock(mutex_);
    return b.external.contains(version);
  }();
  if (!external) b.results.release(version);  // (a version never activated throws here, before any change)
  {
    std::lock_guard lock(mutex_);
    b.external.erase(version);
    // Older external versions that were passed over are not needed either; one still computing is dropped when
    // it ends (finish_external).
    std::erase_if(b.external, [version](const auto& entry) { return entry.first < version && entry.second; });
    b.released = std::max(b.released, version);
  }
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
  registry_.close();  // a step waiting for a version ends now, not after its timeout
  // So do waits for a ring buffer: a worker's for a result buffer that a step which failed mid-install still
  // holds, a step's for a snapshot buffer (shutdown() below joins the workers).
  for (auto& b : blocks_) {
    b->snapshots.close();
    b->results.close();
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
  out.by_dim = by_dim_;
  out.external_versions = external_versions_;
  std::lock_guard faults(fault_mutex_);
  out.faults_triggered = faults_triggered_;
  return out;
}

void RefreshEngine::gate_result(std::int64_t id, std::int64_t version, const float* result, std::size_t count) {
  if (!detail::all_finite(result, count)) {
    throw NumericalError("[RefreshEngine] " + job_name(id, version) +
                         ": the result is not finite (quality gate); the previous version stays in use");
  }
}

}  // namespace asteria::runtime
