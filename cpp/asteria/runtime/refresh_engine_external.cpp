// The refresh engine's external versions: refreshes computed outside it (the device lane), which the one
// coherence registry still schedules, bounds and counts as it does the workers' jobs.
#include <string>
#include <vector>

#include "asteria/common/errors.h"
#include "asteria/runtime/refresh_engine.h"
#include "asteria/runtime/refresh_engine_impl.h"

namespace asteria::runtime {

using detail::block_name;
using detail::job_name;

void RefreshEngine::note_external(const std::vector<std::int64_t>& blocks, std::int64_t version,
                                  std::int64_t activation_step) {
  if (activation_step < 0) {
    throw InvalidArgument("[RefreshEngine::note_external] Invalid activation_step=" + std::to_string(activation_step) +
                          ": must be a step >= 0");
  }
  std::lock_guard lock(mutex_);
  if (closed_) throw CancelledError("[RefreshEngine::note_external] the engine is closed");
  for (const std::int64_t id : blocks) {
    const Block& b = block(id);
    if (version <= b.newest_submitted || (b.kind == RefreshKind::kEigenbasis && activation_step < b.last_activation_step)) {
      // (only an eigenbasis chain orders its activation steps: a root block has none to name)
      const std::string step_rule = b.kind == RefreshKind::kEigenbasis
                                        ? " with an activation step >= " + std::to_string(b.last_activation_step)
                                        : "";
      throw InvalidArgument("[RefreshEngine::note_external] " + block_name(id) + ": version " + std::to_string(version) +
                            " (activation step " + std::to_string(activation_step) + ") must come after version " +
                            std::to_string(b.newest_submitted) + step_rule);
    }
    try {  // (its result ring skips it below: a version skipped or retired there already is refused here)
      b.results.check_open(version);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument("[RefreshEngine::note_external] " + block_name(id) + ": version " +
                            std::to_string(version) + " was deferred or is older than the block's start: " + e.what());
    }
  }
  for (const std::int64_t id : blocks) {
    Block& b = block(id);
    registry_.note_snapshot(id, version, activation_step);
    b.snapshots.retire_through(version);  // the ring never holds it: its buffer goes to the next version
    // Nor does the result ring, whose buffer the version `depth` later must not wait for: a failed external
    // version is never activated, so nothing would retire it, and that worker's job would wait for the buffer
    // while the training thread waits for the job.
    b.results.skip(version);
    b.external.emplace(version, false);
    b.newest_submitted = version;
    if (b.kind == RefreshKind::kEigenbasis) {
      b.last_version = version;
      b.last_activation_step = activation_step;
      b.chain_needs_basis = true;
    }
  }
  external_versions_ += 1;
}

void RefreshEngine::finish_external(const std::vector<std::int64_t>& blocks, std::int64_t version,
                                    const std::vector<bool>& ok, const std::string& error) {
  if (ok.size() != blocks.size()) {
    throw InvalidArgument("[RefreshEngine::finish_external] Invalid ok: " + std::to_string(ok.size()) + " flags for " +
                          std::to_string(blocks.size()) + " blocks");
  }
  {
    std::lock_guard lock(mutex_);
    for (const std::int64_t id : blocks) {
      if (!block(id).external.contains(version)) {
        throw InvalidArgument("[RefreshEngine::finish_external] " + job_name(id, version) +
                              " was not noted by note_external, or was released");
      }
    }
    for (const bool good : ok) (good ? refreshes_ok_ : refreshes_failed_) += 1;
    for (const std::int64_t id : blocks) {
      Block& b = block(id);
      if (version < b.released) {
        b.external.erase(version);  // passed over while it computed: nothing will release it
      } else {
        b.external[version] = true;
      }
    }
  }
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    registry_.note_finished(blocks[i], version, ok[i], ok[i] ? std::string() : error);
  }
}

}  // namespace asteria::runtime
