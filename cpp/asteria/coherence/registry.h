// The CoherenceRegistry: per preconditioner block, which version is in use, which is the newest
// snapshot and the newest finished, the staleness budget S, the activation schedule, and a bounded
// wait for versions the schedule requires. The timeline it enforces (each version's snapshot step,
// activation step and staleness deadline) is defined in one place, python/asteria/pipeline/timeline.py;
// the activation steps passed to note_snapshot() come from there.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace asteria::coherence {

struct RegistryConfig {
  int staleness = 5;                  // S >= 0: most refresh intervals a block may lag its newest snapshot
  bool deterministic = true;          // activation by schedule only, never by worker timing
  int max_consecutive_failures = 3;   // >= 1: failures in a row before activate() raises BlockFailure
  // >= 0: a block's versions 1..sync_versions are waited for from their activation step under the
  // non-deterministic rule too (the schedule makes them due at their own snapshot step: the bootstrap
  // and the first refreshes, when a late basis costs the most).
  int sync_versions = 1;
};

// A version chosen for use at a step.
struct Activation {
  std::int64_t block;
  std::int64_t version;
};

struct BlockStatus {
  std::int64_t active_version = 0;     // 0: none yet
  std::int64_t newest_snapshot = 0;    // newest version submitted
  std::int64_t newest_finished = 0;    // newest version whose job ended (ok or failed)
  std::int64_t newest_ok = 0;          // newest version that succeeded
  std::int64_t consecutive_failures = 0;
  std::int64_t total_failures = 0;
  std::string last_error;
};

struct RegistryStats {
  std::uint64_t activations = 0;       // version changes applied
  std::uint64_t waits = 0;             // activate() calls that had to block (one per call, however many blocks)
  double wait_seconds = 0.0;           // total time blocked, including waits that timed out
  double max_wait_seconds = 0.0;
  std::uint64_t failures = 0;          // failed versions, all blocks
  // Versions that succeeded but were never activated because a newer one was activated first
  // (mostly non-deterministic; under the schedule only when several versions fall due at once).
  std::uint64_t skipped_versions = 0;
  // Versions whose job found a newer snapshot of its block queued when it started, and so did not
  // compute (non-deterministic rule only; see RefreshEngine): neither used nor counted as failures.
  std::uint64_t superseded_versions = 0;
  // staleness_histogram[s]: block-steps that used a version s intervals behind its newest snapshot;
  // the last bin gathers everything >= its index.
  std::vector<std::uint64_t> staleness_histogram;
  std::int64_t max_staleness_seen = 0;
};

// Activation rule at step t for each block (versions count refresh intervals):
// - deterministic: the newest version v with activation_step(v) <= t; if v's job has not finished,
//   wait for it (bounded barrier); if it failed, keep the newest good version before it, waiting
//   for the due versions in between as for v, so that failures do not make the choice timing-dependent.
// - non-deterministic: the newest version that finished well; if that would leave the block more
//   than S versions behind its newest snapshot, wait for version (newest_snapshot - S) first (or,
//   once it has failed, for the next newer version still running; failed versions count as finished).
//   Until some version has finished well, and for versions <= sync_versions newer than any that has,
//   a version whose activation step has come is waited for, as under the schedule (so the first
//   refreshes, due at their own step, are used from that step).
// A block whose versions failed `max_consecutive_failures` times in a row makes activate() throw
// BlockFailure naming it; nothing else is changed by that call.
//
// Thread safety: every method is safe to call concurrently; note_finished() is called by workers.
class CoherenceRegistry {
 public:
  explicit CoherenceRegistry(RegistryConfig config);

  std::int64_t add_block();
  std::int64_t num_blocks() const;
  const RegistryConfig& config() const noexcept { return config_; }

  // A run resumed from a checkpoint uses versions[i] (>= 0) of blocks[i]: their activations and
  // staleness count from there (the versions it snapshots next may be older than that for some blocks
  // of a set under the non-deterministic rule; they are then never activated). Only for blocks with
  // nothing noted yet; anything else throws InvalidArgument before any block is changed.
  void resume_at(const std::vector<std::int64_t>& blocks, const std::vector<std::int64_t>& versions);
  // A job for `version` of `block` was submitted; under the deterministic rule it becomes due at
  // `activation_step`. Versions of one block must be noted in increasing order (InvalidArgument).
  void note_snapshot(std::int64_t block, std::int64_t version, std::int64_t activation_step);
  // The job of `version` ended; `ok` false records `error` as the block's last error.
  void note_finished(std::int64_t block, std::int64_t version, bool ok, const std::string& error = {});
  // The job of `version` ended without computing because a newer version of the block was already
  // submitted: the version counts as finished and never becomes active, but not as a failure.
  // Throws InvalidArgument under the deterministic rule, where every due version must be used.
  void note_superseded(std::int64_t block, std::int64_t version);

  // Decides the versions in use at `step` for every block (see the rule above), waiting up to
  // `timeout` in total for versions the rule requires; throws TimeoutError naming the block, the
  // version and the time waited. Returns only the blocks whose version changes. Records the
  // staleness of every block at this step; a second call for the same step (the non-deterministic
  // rule then picks up versions finished since the first) replaces that step's record.
  std::vector<Activation> activate(std::int64_t step, std::chrono::nanoseconds timeout);

  BlockStatus status(std::int64_t block) const;
  RegistryStats stats() const;

  // Ends every wait in activate(), at once and from then on, with CancelledError (the engine is closing:
  // the versions waited for will never finish). Idempotent.
  void close();

 private:
  struct Block {
    BlockStatus status;
    std::map<std::int64_t, std::int64_t> due;        // version -> activation step, for versions > active
    std::map<std::int64_t, bool> finished;           // version -> ok, for finished versions > active
    std::set<std::int64_t> running;                  // noted versions whose job has not ended
    std::int64_t last_failed_version = 0;            // the version that left status.last_error
  };
  // What the rule wants for a block at a step: the version to use, or the version that must finish
  // before the rule can tell (awaited > 0).
  struct Plan {
    std::int64_t target;
    std::int64_t awaited;
  };
  Plan plan(const Block& block, std::int64_t step) const;  // requires mutex_
  // Index of `block` in blocks_; throws InvalidArgument naming `method` if there is no such block.
  std::size_t index(std::int64_t block, const char* method) const;  // requires mutex_
  // Throws BlockFailure for the lowest block at its failure bound. Requires mutex_.
  void throw_if_failing() const;

  const RegistryConfig config_;
  mutable std::mutex mutex_;
  std::condition_variable finished_;    // guarded by mutex_
  std::vector<Block> blocks_;           // guarded by mutex_
  RegistryStats stats_;                 // guarded by mutex_
  bool closed_ = false;                 // guarded by mutex_
  // The step last recorded, each block's histogram bin there (kNoBin: none) and the largest
  // staleness seen before it, so that a repeated activation of a step replaces its record.
  static constexpr std::size_t kNoBin = static_cast<std::size_t>(-1);
  std::int64_t recorded_step_ = -1;     // guarded by mutex_
  std::vector<std::size_t> recorded_bins_;  // guarded by mutex_
  std::int64_t max_staleness_before_ = 0;   // guarded by mutex_
};

}  // namespace asteria::coherence
