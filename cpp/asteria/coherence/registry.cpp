#include "asteria/coherence/registry.h"

#include <algorithm>
#include <cstdio>

#include "asteria/common/clock.h"
#include "asteria/common/errors.h"

namespace asteria::coherence {

namespace {

std::string timeout_message(std::int64_t step, std::size_t block, std::int64_t awaited, double waited,
                            const BlockStatus& status, const RegistryConfig& config) {
  const std::string rule =
      config.deterministic ? "deterministic schedule" : "staleness bound S=" + std::to_string(config.staleness);
  return "[CoherenceRegistry::activate] step " + std::to_string(step) + ": block " + std::to_string(block) +
         " needs version " + std::to_string(awaited) + ", still running after waiting " + format_seconds(waited) +
         " (active " + std::to_string(status.active_version) + ", newest finished " +
         std::to_string(status.newest_finished) + ", newest ok " + std::to_string(status.newest_ok) + ", " + rule +
         ")";
}

}  // namespace

CoherenceRegistry::CoherenceRegistry(RegistryConfig config) : config_(config) {
  if (config_.staleness < 0) {
    throw InvalidArgument("[CoherenceRegistry] staleness=" + std::to_string(config_.staleness) + " must be >= 0");
  }
  if (config_.max_consecutive_failures < 1) {
    throw InvalidArgument("[CoherenceRegistry] max_consecutive_failures=" +
                          std::to_string(config_.max_consecutive_failures) + " must be >= 1");
  }
  if (config_.sync_versions < 0) {
    throw InvalidArgument("[CoherenceRegistry] sync_versions=" + std::to_string(config_.sync_versions) +
                          " must be >= 0");
  }
  // Bins 0..S, then one for everything beyond the budget.
  stats_.staleness_histogram.assign(static_cast<std::size_t>(config_.staleness) + 2, 0);
}

std::int64_t CoherenceRegistry::add_block() {
  std::lock_guard lock(mutex_);
  blocks_.emplace_back();
  return static_cast<std::int64_t>(blocks_.size()) - 1;
}

std::int64_t CoherenceRegistry::num_blocks() const {
  std::lock_guard lock(mutex_);
  return static_cast<std::int64_t>(blocks_.size());
}

void CoherenceRegistry::resume_at(const std::vector<std::int64_t>& blocks, const std::vector<std::int64_t>& versions) {
  std::lock_guard lock(mutex_);
  const std::string where = "[CoherenceRegistry::resume_at] ";
  if (blocks.size() != versions.size()) {
    throw InvalidArgument(where + "Invalid versions: " + std::to_string(versions.size()) + " for " +
                          std::to_string(blocks.size()) + " blocks; give one version per block");
  }
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const BlockStatus& status = blocks_[index(blocks[i], "resume_at")].status;
    const std::string block = "block " + std::to_string(blocks[i]) + ": ";
    if (versions[i] < 0) {
      throw InvalidArgument(where + block + "Invalid version=" + std::to_string(versions[i]) + ": must be >= 0");
    }
    if (status.newest_snapshot != 0 || status.active_version != 0 || status.newest_finished != 0) {
      throw InvalidArgument(where + block + "already at version " + std::to_string(status.active_version) +
                            " (newest snapshot " + std::to_string(status.newest_snapshot) +
                            "): only a block with nothing noted yet can be resumed");
    }
  }
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    BlockStatus& status = blocks_[static_cast<std::size_t>(blocks[i])].status;
    status.active_version = versions[i];
    status.newest_finished = versions[i];
    status.newest_ok = versions[i];
  }
}

void CoherenceRegistry::note_snapshot(std::int64_t block, std::int64_t version, std::int64_t activation_step) {
  std::lock_guard lock(mutex_);
  Block& b = blocks_[index(block, "note_snapshot")];
  if (version <= b.status.newest_snapshot) {
    throw InvalidArgument("[CoherenceRegistry::note_snapshot] block " + std::to_string(block) + ": version " +
                          std::to_string(version) + " must be > the newest snapshot, version " +
                          std::to_string(b.status.newest_snapshot) +
                          " (versions are noted in increasing order from 1)");
  }
  b.status.newest_snapshot = version;
  b.due.emplace(version, activation_step);
  b.running.insert(version);
}

void CoherenceRegistry::note_finished(std::int64_t block, std::int64_t version, bool ok, const std::string& error) {
  {
    std::lock_guard lock(mutex_);
    Block& b = blocks_[index(block, "note_finished")];
    if (b.running.erase(version) == 0) {
      throw InvalidArgument("[CoherenceRegistry::note_finished] block " + std::to_string(block) + ": version " +
                            std::to_string(version) + " is not running (newest snapshot " +
                            std::to_string(b.status.newest_snapshot) + "); it finished already or was never noted");
    }
    BlockStatus& status = b.status;
    status.newest_finished = std::max(status.newest_finished, version);
    if (ok) {
      status.newest_ok = std::max(status.newest_ok, version);
      status.consecutive_failures = 0;
    } else {
      status.consecutive_failures += 1;
      status.total_failures += 1;
      status.last_error = error.empty() ? "no error message given" : error;
      b.last_failed_version = version;
      stats_.failures += 1;
    }
    if (version > status.active_version) {
      b.finished.emplace(version, ok);
    } else if (ok) {
      // A newer version became active while this one ran: it will never be used.
      stats_.skipped_versions += 1;
    }
  }
  finished_.notify_all();
}

std::vector<Activation> CoherenceRegistry::activate(std::int64_t step, std::chrono::nanoseconds timeout) {
  const auto started = Clock::now();
  const auto deadline = deadline_after(timeout);
  std::unique_lock lock(mutex_);
  const std::size_t n = blocks_.size();
  std::vector<std::int64_t> targets(n);
  bool blocked = false;
  double blocked_seconds = 0.0;
  // Wait time is telemetry: it is recorded even when the call then throws.
  const auto record_wait = [&] {
    if (!blocked) return;
    stats_.wait_seconds += blocked_seconds;
    stats_.max_wait_seconds = std::max(stats_.max_wait_seconds, blocked_seconds);
  };
  try {
    if (closed_) {
      throw CancelledError("[CoherenceRegistry::activate] the engine is closed: step " + std::to_string(step) +
                           " activates nothing");
    }
    throw_if_failing();
    for (std::size_t id = 0; id < n; ++id) {
      for (;;) {
        // Re-planned after every wake-up: any finished version may change the answer.
        const Plan wanted = plan(blocks_[id], step);
        if (wanted.awaited == 0) {
          targets[id] = wanted.target;
          break;
        }
        if (!blocked) {
          blocked = true;
          // Counted as the wait starts, so that the count shows a call that is blocked right now.
          stats_.waits += 1;
        }
        if (Clock::now() >= deadline) {
          throw BlockTimeout(
              static_cast<std::int64_t>(id), wanted.awaited,
              timeout_message(step, id, wanted.awaited, seconds_since(started), blocks_[id].status, config_));
        }
        const auto wait_started = Clock::now();
        finished_.wait_until(lock, deadline);
        blocked_seconds += seconds_since(wait_started);
        // closed_ changes only while the lock is released, in this wait (it was checked on entry). Closing ends
        // a wait even where the version it waited for ended meanwhile: close() also ends the jobs still running
        // (as failures), and a step that then went on with the version before would complete on a closed engine.
        if (closed_) {
          throw CancelledError("[CoherenceRegistry::activate] the engine was closed while step " +
                               std::to_string(step) + " waited for block " + std::to_string(id) + " version " +
                               std::to_string(wanted.awaited));
        }
        throw_if_failing();
      }
    }
  } catch (...) {
    record_wait();
    throw;
  }
  record_wait();

  std::vector<Activation> changes;
  const bool again = step == recorded_step_;
  if (again) {
    stats_.max_staleness_seen = max_staleness_before_;
  } else {
    recorded_step_ = step;
    max_staleness_before_ = stats_.max_staleness_seen;
    recorded_bins_.assign(n, kNoBin);
  }
  recorded_bins_.resize(n, kNoBin);
  for (std::size_t id = 0; id < n; ++id) {
    Block& b = blocks_[id];
    BlockStatus& status = b.status;
    if (targets[id] > status.active_version) {
      // `finished` only holds versions newer than the active one: those below the target are jumped over.
      stats_.skipped_versions += static_cast<std::uint64_t>(std::count_if(
          b.finished.begin(), b.finished.lower_bound(targets[id]), [](const auto& entry) { return entry.second; }));
      status.active_version = targets[id];
      b.due.erase(b.due.begin(), b.due.upper_bound(status.active_version));
      b.finished.erase(b.finished.begin(), b.finished.upper_bound(status.active_version));
      changes.push_back(Activation{static_cast<std::int64_t>(id), status.active_version});
    }
    if (status.newest_snapshot > 0) {
      // Never negative: after resume_at a block may use a version newer than the newest snapshot noted.
      const std::int64_t staleness = std::max<std::int64_t>(0, status.newest_snapshot - status.active_version);
      const std::size_t bin =
          static_cast<std::size_t>(std::min<std::int64_t>(staleness, config_.staleness + 1));
      if (recorded_bins_[id] != kNoBin) stats_.staleness_histogram[recorded_bins_[id]] -= 1;
      stats_.staleness_histogram[bin] += 1;
      recorded_bins_[id] = bin;
      stats_.max_staleness_seen = std::max(stats_.max_staleness_seen, staleness);
    }
  }
  stats_.activations += changes.size();
  return changes;
}

void CoherenceRegistry::note_superseded(std::int64_t block, std::int64_t version) {
  {
    std::lock_guard lock(mutex_);
    const std::string where = "[CoherenceRegistry::note_superseded] block " + std::to_string(block) + ": ";
    if (config_.deterministic) throw InvalidArgument(where + "the deterministic schedule uses every due version");
    Block& b = blocks_[index(block, "note_superseded")];
    if (b.running.erase(version) == 0) {
      throw InvalidArgument(where + "version " + std::to_string(version) + " is not running");
    }
    b.status.newest_finished = std::max(b.status.newest_finished, version);
    if (version > b.status.active_version) b.finished.emplace(version, false);
    stats_.superseded_versions += 1;
  }
  finished_.notify_all();
}

BlockStatus CoherenceRegistry::status(std::int64_t block) const {
  std::lock_guard lock(mutex_);
  return blocks_[index(block, "status")].status;
}

RegistryStats CoherenceRegistry::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

CoherenceRegistry::Plan CoherenceRegistry::plan(const Block& block, std::int64_t step) const {
  const std::int64_t active = block.status.active_version;
  if (config_.deterministic) {
    // Newest due version first; a failed one gives way to the due version before it.
    for (auto it = block.due.rbegin(); it != block.due.rend() && it->first > active; ++it) {
      const auto [version, activation_step] = *it;
      if (activation_step > step) continue;
      if (block.running.contains(version)) return Plan{active, version};
      if (block.finished.at(version)) return Plan{version, 0};
    }
    return Plan{active, 0};
  }
  // Nothing usable yet, or one of the first sync_versions versions and none newer done: a version whose
  // activation step has come is waited for, as under the schedule (the first refreshes are due at their
  // own step).
  const std::int64_t ok = block.status.newest_ok;
  for (const auto& [version, activation_step] : block.due) {
    if (activation_step > step) break;
    if (version > ok && (ok == 0 || version <= config_.sync_versions) && block.running.contains(version)) {
      return Plan{active, version};
    }
  }
  const std::int64_t needed = block.status.newest_snapshot - config_.staleness;
  if (block.status.newest_ok < needed) {
    const auto pending = block.running.lower_bound(needed);
    if (pending != block.running.end()) return Plan{active, *pending};
  }
  return Plan{std::max(active, block.status.newest_ok), 0};
}

std::size_t CoherenceRegistry::index(std::int64_t block, const char* method) const {
  if (block < 0 || block >= static_cast<std::int64_t>(blocks_.size())) {
    throw InvalidArgument(std::string("[CoherenceRegistry::") + method + "] block " + std::to_string(block) +
                          " does not exist (" + std::to_string(blocks_.size()) + " blocks)");
  }
  return static_cast<std::size_t>(block);
}

void CoherenceRegistry::throw_if_failing() const {
  for (std::size_t id = 0; id < blocks_.size(); ++id) {
    const Block& b = blocks_[id];
    if (b.status.consecutive_failures >= config_.max_consecutive_failures) {
      throw BlockFailure(static_cast<std::int64_t>(id), b.last_failed_version,
                         b.status.last_error + " (" + std::to_string(b.status.consecutive_failures) +
                             " failures in a row; max_consecutive_failures=" +
                             std::to_string(config_.max_consecutive_failures) + ")");
    }
  }
}

void CoherenceRegistry::close() {
  {
    std::lock_guard lock(mutex_);
    closed_ = true;
  }
  finished_.notify_all();
}

}  // namespace asteria::coherence
