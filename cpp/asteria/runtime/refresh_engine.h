// The refresh engine: ties the worker pool, the versioned host store, the numerics and the
// coherence registry together. The training thread snapshots factor matrices into a block's
// snapshot ring, submits refresh jobs, and at each step boundary asks which versions to use.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "asteria/coherence/registry.h"
#include "asteria/linalg/inverse_root.h"
#include "asteria/runtime/worker_pool.h"
#include "asteria/store/byte_extents.h"
#include "asteria/store/versioned_ring.h"

namespace asteria::runtime {

// The order in which the workers take queued jobs (see WorkerPool's JobClass).
enum class QueueOrder {
  kDeadline,  // every job by its activation step, the largest blocks first within one
  // Under the non-deterministic rule, the versions after the waited-for ones (sync_versions) run after
  // every waited-for job, the smallest blocks first: a block's newest version is used as soon as it is
  // done, so the mean delay to its use is shortest when cheap jobs never queue behind costly ones. The
  // deterministic rule waits for every version at its activation step and always runs by deadline.
  kShortest,
};

struct EngineConfig {
  int workers = 1;        // >= 1
  int blas_threads = 1;   // >= 1, per worker
  int worker_nice = 10;   // 0..19: the workers' CPU priority below the training thread's
  std::vector<int> worker_cpus;  // logical CPUs the workers run on (empty: not pinned); see WorkerPool
  coherence::RegistryConfig registry;
  QueueOrder queue_order = QueueOrder::kDeadline;
  // Express workers (see WorkerPool's ExpressWorkers) that take the jobs of blocks of at most
  // express_max_n, at the nice worker_nice / 2: a cheap block's version then never waits for a core behind
  // the large blocks' roots. 0: none.
  int express_workers = 0;
  int express_max_n = 0;  // >= 0
  std::chrono::nanoseconds slot_timeout = std::chrono::seconds(300);  // workers waiting for a result buffer
};

// What a block's jobs compute from its snapshot A.
enum class RefreshKind {
  kInverseRoot,  // (scale A + ...)^exponent, linalg::inverse_root
  kEigenbasis,   // SOAP's eigenbasis: linalg::eigenbasis first, then linalg::qr_refresh warm-started
};

// Where one block's memory lives. Both rings hold `depth` buffers, buffer i at base + i * stride
// (elements): snapshots n x n float32 (or, `packed`, the n (n + 1) / 2 elements of the lower triangle in
// row-major order, torch's tril_indices: the factors are symmetric, so half the host memory and half the
// device-to-host copy carry all of it); results n x n for kInverseRoot and (n + 2) x n for
// kEigenbasis (rows 0..n-1 the basis Q in torch's layout, Q[i * n + j] component i of vector j;
// row n the eigenvalue estimates, the eigenvalues for a block's first, full decomposition; row n + 1
// the permutation applied to the previous basis's order, as floats). The memory belongs to the
// caller and must stay valid until close().
struct BlockMemory {
  int n = 0;
  int depth = 1;
  float* snapshots = nullptr;
  std::int64_t snapshot_stride = 0;
  float* results = nullptr;
  std::int64_t result_stride = 0;
  RefreshKind kind = RefreshKind::kInverseRoot;
  bool packed = false;
  // kEigenbasis: a block's first basis (and any while its basis is a zero factor's identity) is one
  // qr_refresh step from the identity, as Distributed Shampoo's SOAP takes it, instead of a full
  // eigendecomposition; later ones warm-start from it either way.
  bool first_from_identity = false;
};

// Elements of one snapshot buffer: n x n, or the lower triangle of a packed one.
std::int64_t snapshot_elements(int n, bool packed);

// Faults the engine can inject into its own worker jobs (see RefreshEngine::inject_fault).
enum class FaultKind {
  kThrow,      // the job throws from inside its numerics: the version fails with that exception
  kNonFinite,  // the job's result is poisoned with a NaN after the numerics: the quality gate rejects it
  kHang,       // the job blocks until close() (then fails with CancelledError), or for `duration` if > 0
               // (then fails with TimeoutError); the training thread's bounded waits time out meanwhile
  kDelay,      // the job sleeps `duration` before its numerics (cut short by close()), then runs normally
  kPause,      // the job waits before its numerics until release_pauses() (or close()), then runs normally:
               // a latch for tests that need a worker held at a known point
};

const char* to_string(FaultKind kind) noexcept;

// inject_fault(block, kAnyVersion, ...): the fault hits every version of the block until clear_faults().
inline constexpr std::int64_t kAnyVersion = 0;

// The numerics time of the jobs of one block size (the executor's measure of the workers' throughput).
struct DimTiming {
  double seconds = 0.0;
  std::uint64_t jobs = 0;
};

struct EngineStats {
  PoolStats pool;
  coherence::RegistryStats registry;
  std::uint64_t refreshes_ok = 0;
  std::uint64_t refreshes_failed = 0;
  std::uint64_t float64_retries = 0;
  std::uint64_t refreshes_skipped = 0;  // eigenbasis refreshes that kept the previous basis (skip_tol)
  std::uint64_t snapshot_waits = 0;     // begin_snapshot() calls that blocked on a buffer still in use
  double snapshot_wait_seconds = 0.0;
  double refresh_seconds = 0.0;  // summed numerics time over jobs (CPU time with one BLAS thread: see run_job)
  std::uint64_t faults_triggered = 0;   // jobs that met an injected fault or random delay
  std::uint64_t refreshes_superseded = 0;  // jobs that did not compute: a newer version was queued
                                           // (the registry's superseded_versions)
  std::map<int, DimTiming> by_dim;         // per block size n, the jobs that computed
  std::uint64_t external_versions = 0;     // versions computed outside the engine (note_external)
};

// Thread safety: add_block() must not race with the other calls; everything else is safe to call
// concurrently, though Asteria calls it from the training thread only.
class RefreshEngine {
 public:
  explicit RefreshEngine(EngineConfig config);
  ~RefreshEngine();  // close()

  RefreshEngine(const RefreshEngine&) = delete;
  RefreshEngine& operator=(const RefreshEngine&) = delete;

  // Registers a block and returns its id (0, 1, 2, ... in call order).
  std::int64_t add_block(const BlockMemory& memory);
  std::int64_t num_blocks() const;
  int block_dim(std::int64_t block) const;
  int depth(std::int64_t block) const;

  // Declares that no version before `version` will ever be written for `blocks` (a run resumed from
  // a checkpoint starts its versions there), so that the rings hand out buffers from that version on.
  void start_at(const std::vector<std::int64_t>& blocks, std::int64_t version);
  // Version `version` of `blocks` will never be snapshotted (its refresh was deferred): their rings then hand
  // the buffers to the versions after it in order, as if it had come and gone. Throws InvalidArgument for a
  // version already written or retired.
  void skip(const std::vector<std::int64_t>& blocks, std::int64_t version);
  // A resumed run uses versions[i] of blocks[i]: the registry's activations and staleness count from
  // there (CoherenceRegistry::resume_at), not from version 0. Before anything is submitted for them.
  void resume_at(const std::vector<std::int64_t>& blocks, const std::vector<std::int64_t>& versions);
  // Claims the snapshot buffers of `version` for `blocks`, waiting up to `timeout` for jobs still
  // reading them, and returns nothing: the caller then fills buffer version % depth. All or nothing: where
  // one block's claim fails (a timeout, a bad id or version, a block listed twice, close()), the claims made
  // before it are given back and the call throws, so that the same call may be made again.
  void begin_snapshot(const std::vector<std::int64_t>& blocks, std::int64_t version, std::chrono::nanoseconds timeout);
  // Gives back the snapshot buffers that begin_snapshot claimed for `version` and that were not submitted
  // (the caller failed to fill them): the blocks' rings are as before the claim. Every block is checked
  // before any changes.
  void abandon_snapshot(const std::vector<std::int64_t>& blocks, std::int64_t version);
  // Publishes the filled snapshots of `version` and queues one job per block computing the root
  // `spec` into the block's result ring. The jobs are due at `activation_step` (their deadline); among
  // jobs of one deadline the pool starts those of the largest blocks first (cost n^3).
  // kEigenbasis blocks use spec.scale only (exponent and eps are neither used nor validated) and
  // `skip_tol` (>= 0, see linalg::qr_refresh). A block's eigenbasis jobs form a chain: job v starts
  // from the basis of the newest version before v that succeeded (or the one given to set_basis or
  // seed_basis),
  // and the block's first job, with none, decomposes fully. The chain needs each block's eigenbasis
  // versions submitted in increasing order with non-decreasing activation steps (so that the pool,
  // which gives all of a block's jobs one cost, starts them in that order); anything else throws
  // InvalidArgument before any block is touched.
  // Under the non-deterministic rule a job that starts when a newer version of its block has been
  // submitted does not compute (it is superseded: the newer version would be activated first anyway),
  // so that workers behind schedule catch up instead of computing versions no one will use; the newer
  // version's job then takes the queue place of the block's older job still queued (its deadline).
  void submit(const std::vector<std::int64_t>& blocks, std::int64_t version, std::int64_t activation_step,
              const linalg::RootSpec& spec, double skip_tol = 0.0);
  // Seeds a kEigenbasis block's chain with the good basis `basis` (n x n, torch layout, copied) of
  // `version` (>= 1): a run resumed from a checkpoint warm-starts its next job from the basis in use.
  // Throws InvalidArgument for an inverse-root block, a version not after the newest submitted one,
  // or a non-finite basis, CancelledError once the engine is closed. Must not race with submit() for the
  // same block.
  void set_basis(std::int64_t block, std::int64_t version, const float* basis);
  // set_basis for a caller that must not wait (a training thread): the basis of `version` is not passed but
  // lies in rows [0, n) of the result buffer of `next` (buffer next % depth), which the caller fills before it
  // submits `next`, the block's next version (submit() refuses any other). The block's next job takes it into
  // the chain when it starts, on its worker, so the caller neither copies n x n floats nor waits for the copy
  // that fills the buffer (a device's, ended by the submit). A basis found not finite there fails that job,
  // and the chain keeps its basis from before. Throws as set_basis does, and for `next` <= `version`.
  void seed_basis(std::int64_t block, std::int64_t version, std::int64_t next);
  // Whether the block's newest eigenbasis job has not ended yet (set_basis and seed_basis would refuse); false for
  // a root block.
  bool chain_busy(std::int64_t block) const;

  // Chooses the versions in use at `step` (CoherenceRegistry::activate) and pins the result buffer
  // of every block whose version changes; the caller copies it and then calls release(). For an
  // eigenbasis block that passes over good versions, the returned version's order row is rewritten
  // to be relative to the version activated before it (the orders of the versions in between
  // composed), so that state kept in eigen-coordinates can follow in one permutation.
  std::vector<coherence::Activation> activate(std::int64_t step, std::chrono::nanoseconds timeout);
  // Unpins a version returned by activate() and lets the ring reuse it and every older version.
  void release(std::int64_t block, std::int64_t version);

  // ---- Versions computed outside the engine (by the caller, e.g. on a GPU) ----------------------
  // The registry tracks them as it tracks the workers' own, so that the activation rule, the staleness
  // bound and its bounded wait, and the failure count hold across both; the rings never hold them, and
  // activate() returns them unpinned (release() only retires them).
  //
  // Version `version` of `blocks` was snapshotted outside the engine, due at `activation_step`. The
  // versions of a block must increase across both kinds. An eigenbasis block's chain then no longer holds
  // its newest basis: its next submit() throws InvalidArgument until set_basis() or seed_basis() seeds it. Throws
  // InvalidArgument, before any block is touched, for an unknown block, a version not after the block's
  // newest, one deferred (skip) or before the block's start (start_at), or an eigenbasis activation step before
  // its last. The version holds no buffer of the block's rings.
  void note_external(const std::vector<std::int64_t>& blocks, std::int64_t version, std::int64_t activation_step);
  // The external version of `blocks` ended: ok[i] says whether blocks[i]'s result is usable; `error`
  // names the cause of the failures.
  void finish_external(const std::vector<std::int64_t>& blocks, std::int64_t version, const std::vector<bool>& ok,
                       const std::string& error);

  // Blocks until every submitted job has ended, up to `timeout`.
  void drain(std::chrono::nanoseconds timeout);
  // Cancels queued jobs, waits for running ones, stops the workers. Idempotent.
  void close();
  bool closed() const;

  // ---- Fault injection: for tests and the soak benchmark, not for production use. ----------
  // The faults act inside the real worker jobs, so that every failure path (exception capture,
  // result buffer failed, last good version kept, failure counted, BlockFailure past the bound,
  // timeouts, close() during a job) runs exactly as it would for a genuine fault. When nothing is
  // armed a job pays one atomic load.
  //
  // Arms `kind` for the job of (`block`, `version`); with version == kAnyVersion for every job of
  // the block until clear_faults(). A specific version's fault fires once and takes precedence over
  // an any-version fault. `duration` is the sleep of kDelay (> 0) or the bound of kHang (0: until
  // close()), and must be zero for the others.
  // Throws InvalidArgument for an unknown block, a version < 0 or a bad duration.
  void inject_fault(std::int64_t block, std::int64_t version, FaultKind kind,
                    std::chrono::nanoseconds duration = std::chrono::nanoseconds::zero());
  // Every job without an armed fault sleeps a pseudo-random time in [0, max_delay) before its
  // numerics, a function of (seed, block, version) only; max_delay == 0 turns it off.
  void set_random_delay(std::chrono::nanoseconds max_delay, std::uint64_t seed);
  // Disarms every fault and the random delay (jobs already sleeping or hanging are not woken).
  void clear_faults();
  // Blocks until at least `count` jobs paused since the last release_pauses() wait in their kPause
  // fault (TimeoutError after `timeout`); jobs released before but not yet awake do not count.
  void wait_paused(int count, std::chrono::nanoseconds timeout);
  // Lets every job waiting in a kPause fault go on.
  void release_pauses();

  coherence::BlockStatus status(std::int64_t block) const;
  EngineStats stats() const;
  const EngineConfig& config() const noexcept { return config_; }

 private:
  struct Block;
  // What a job computed, for the counters.
  struct JobOutcome {
    bool used_float64 = false;
    bool skipped = false;
    bool passed_over = false;  // an eigenbasis job that found a newer version's basis in the chain: not computed
  };
  struct Fault {
    FaultKind kind;
    std::chrono::nanoseconds duration;
  };
  // The fault (if any) that the job of (id, version) meets; consumes a one-shot fault.
  std::optional<Fault> take_fault(std::int64_t id, std::int64_t version);
  // Runs the part of `fault` that happens before the numerics (throw, hang, delay).
  void apply_fault(const Fault& fault, std::int64_t id, std::int64_t version);
  // Throws NumericalError unless the `count` floats of a job's result are finite (quality gate).
  static void gate_result(std::int64_t id, std::int64_t version, const float* result, std::size_t count);
  // `previous` is the block's previous eigenbasis job (empty for inverse roots and a chain's first).
  void run_job(std::int64_t id, std::int64_t version, const linalg::RootSpec& spec, double skip_tol,
               const std::optional<JobHandle>& previous);
  // `poison`: an injected kNonFinite fault, applied before the quality gate.
  JobOutcome compute_eigenbasis(Block& b, std::int64_t id, std::int64_t version, const float* input, float* output,
                                const linalg::RootSpec& spec, double skip_tol, bool poison);
  // The pool's cost of any job of `b`: n^3, a function of the block alone (see submit()).
  static double job_cost(const Block& b);
  Block& block(std::int64_t id);
  const Block& block(std::int64_t id) const;
  // The result buffer of `version` (its first float).
  static float* result_buffer(Block& b, std::int64_t version);
  // The column-order row of `version`'s result buffer (kEigenbasis blocks).
  static float* order_row(Block& b, std::int64_t version);
  // What set_basis and seed_basis check and record about the chain's seed `version`. Requires mutex_.
  void claim_seed(Block& b, std::int64_t version, const std::string& where);
  // A job's start: the chain takes the basis seed_basis left in a result buffer, if any. Takes chain_mutex.
  static void adopt_seed(Block& b, std::int64_t id);
  // Rewrites `version`'s order relative to b.activated (see activate()). Requires mutex_.
  static void compose_order(Block& b, std::int64_t version);

  const EngineConfig config_;
  coherence::CoherenceRegistry registry_;
  std::vector<std::unique_ptr<Block>> blocks_;
  store::ByteExtents memory_;  // every block's snapshot and result buffers, which add_block keeps disjoint
  mutable std::mutex mutex_;
  std::vector<JobHandle> in_flight_;          // guarded by mutex_
  std::uint64_t refreshes_ok_ = 0;            // guarded by mutex_
  std::uint64_t refreshes_failed_ = 0;        // guarded by mutex_
  std::uint64_t float64_retries_ = 0;         // guarded by mutex_
  std::uint64_t refreshes_skipped_ = 0;       // guarded by mutex_
  std::map<int, DimTiming> by_dim_;           // guarded by mutex_
  std::uint64_t external_versions_ = 0;       // guarded by mutex_
  std::uint64_t snapshot_waits_ = 0;          // guarded by mutex_
  double snapshot_wait_seconds_ = 0.0;        // guarded by mutex_
  double refresh_seconds_ = 0.0;              // guarded by mutex_
  bool closed_ = false;                       // guarded by mutex_
  std::unique_ptr<WorkerPool> pool_;

  // Fault injection. faults_armed_ is the one check a job makes when nothing is armed.
  std::atomic<bool> faults_armed_{false};
  mutable std::mutex fault_mutex_;
  std::condition_variable fault_released_;                     // guarded by fault_mutex_
  std::map<std::pair<std::int64_t, std::int64_t>, Fault> faults_;  // guarded by fault_mutex_
  std::chrono::nanoseconds max_random_delay_{0};               // guarded by fault_mutex_
  std::uint64_t delay_seed_ = 0;                               // guarded by fault_mutex_
  std::uint64_t faults_triggered_ = 0;                         // guarded by fault_mutex_
  int paused_ = 0;                                             // guarded by fault_mutex_
  std::uint64_t pause_generation_ = 0;                         // guarded by fault_mutex_
  bool closing_ = false;                                       // guarded by fault_mutex_; wakes hangs and delays
};

}  // namespace asteria::runtime
