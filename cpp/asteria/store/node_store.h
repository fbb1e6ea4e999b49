// The node-shared store: one host copy of the preconditioner versions for all local ranks of a node,
// in a POSIX shared-memory segment, with one version word per block (a lock-free std::atomic in the
// segment, written with release and read with acquire), so that a rank sees a version another
// local rank published without any message.
//
// Segment life: the node's leader create()s a uniquely named segment, every other local rank open()s
// it, and once all have mapped it (a barrier the caller provides) the name is unlink()ed: the mapping
// stays valid while the processes live, and nothing is left in /dev/shm even after a crash.
// private_memory() gives the same store over anonymous memory for a node with one rank.
//
// Per block: two data slots of `capacity` floats. A published version has a status: ok (its data is
// in the block's "good" slot), failed (no data; the previous good version stays) or skipped (no
// data: the refresh kept the previous good version bit for bit). An ok version is written into the
// slot that does not hold the current good version, so the good data stays intact while it is
// written. Writers of one block publish increasing versions; the caller makes sure that no local
// rank still reads a slot when it is written (mark_done / wait_done: each rank records the last
// step whose versions it has read).
//
// Every wait is bounded and also ends early, with PeerExited, when a local rank's process has exited.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "asteria/common/errors.h"

namespace asteria::store {

// A local rank's process exited while another waited for it.
class PeerExited : public Error {
 public:
  using Error::Error;
};

enum class VersionStatus : int { kNone = 0, kOk = 1, kFailed = 2, kSkipped = 3 };

const char* to_string(VersionStatus status) noexcept;

// What a block's version word says.
struct Published {
  std::int64_t version = 0;  // newest published version, 0: none
  VersionStatus status = VersionStatus::kNone;
  int good_slot = -1;        // slot holding the newest ok version's data, -1: none yet
};

struct NodeStoreStats {
  std::uint64_t waits = 0;          // wait calls that had to block
  double wait_seconds = 0.0;        // time blocked in them
  double max_wait_seconds = 0.0;
  std::uint64_t published = 0;      // versions published through this mapping
};

class NodeStore {
 public:
  // Creates the segment `name` ("/asteria-..."; must not exist) sized for `local_ranks` ranks and
  // blocks of `capacities[i]` floats per slot, and initializes it. Throws InvalidArgument for a bad
  // name, rank count or capacity, Error when the system refuses (the errno text is in the message).
  static std::unique_ptr<NodeStore> create(const std::string& name, int local_ranks,
                                           const std::vector<std::int64_t>& capacities);
  // Maps the existing segment `name`, checking that it was created with the same layout.
  static std::unique_ptr<NodeStore> open(const std::string& name, int local_ranks,
                                         const std::vector<std::int64_t>& capacities);
  // The same store over private anonymous memory, for one rank.
  static std::unique_ptr<NodeStore> private_memory(const std::vector<std::int64_t>& capacities);

  ~NodeStore();  // unmaps
  NodeStore(const NodeStore&) = delete;
  NodeStore& operator=(const NodeStore&) = delete;

  // Removes the segment's name (the mapping stays). Idempotent; a name already gone is fine.
  void unlink();
  // Whether a segment named `name` exists (for tests and diagnostics).
  static bool exists(const std::string& name);

  const std::string& name() const noexcept { return name_; }
  std::int64_t num_blocks() const noexcept { return num_blocks_; }
  int local_ranks() const noexcept { return local_ranks_; }
  std::size_t bytes() const noexcept { return bytes_; }
  std::int64_t capacity(std::int64_t block) const;
  // Slot `slot` (0 or 1) of `block`: `capacity(block)` floats in the segment.
  float* slot(std::int64_t block, int slot);
  // Offset in floats of a slot from data(), and the data region (all slots) with its size in floats.
  std::int64_t offset(std::int64_t block, int slot) const;
  float* data() noexcept { return data_; }
  std::int64_t data_floats() const noexcept { return data_floats_; }

  // Records this process as local rank `local_rank` (its pid, for the liveness checks of waits).
  void register_rank(int local_rank, std::int64_t pid);

  // The version word of `block` (acquire).
  Published published(std::int64_t block) const;
  // The slot an ok version of `block` is to be written into (the one not holding the good data).
  int write_slot(std::int64_t block) const;
  // Copies `count` floats from `source` to the start of slot `slot` of `block`, split over `threads`
  // threads, the caller's among them (the owner's publish of a result: one thread copies about
  // 5 GB/s). Throws InvalidArgument for a bad block, slot, count (0..capacity) or thread count (>= 1).
  void write(std::int64_t block, int slot, const float* source, std::int64_t count, int threads);
  // Publishes `version` of `block` with `status` (release). An ok version must have been written into
  // write_slot(block). Throws InvalidArgument unless version > the published one and status is not kNone.
  void publish(std::int64_t block, std::int64_t version, VersionStatus status);

  // Waits until every blocks[i] has published a version >= versions[i] and returns their words.
  // Throws TimeoutError naming the first block still missing, its version, what it has and the time
  // waited; PeerExited when a registered local rank's process has exited meanwhile.
  std::vector<Published> wait(const std::vector<std::int64_t>& blocks, const std::vector<std::int64_t>& versions,
                              std::chrono::nanoseconds timeout);

  // Local rank `local_rank` has read every version due up to `step`.
  void mark_done(int local_rank, std::int64_t step);
  std::int64_t done(int local_rank) const;
  // Waits until every local rank has marked `step` done (TimeoutError / PeerExited as wait()).
  void wait_done(std::int64_t step, std::chrono::nanoseconds timeout);

  NodeStoreStats stats() const;

 private:
  struct Header;
  struct RankArea;
  struct BlockControl;

  NodeStore(std::string name, void* base, std::size_t bytes, int local_ranks, std::int64_t num_blocks,
            bool shared);
  static std::size_t layout_bytes(int local_ranks, const std::vector<std::int64_t>& capacities);
  static void check_layout(const std::string& where, int local_ranks, const std::vector<std::int64_t>& capacities);
  void initialize(const std::vector<std::int64_t>& capacities);
  BlockControl& control(std::int64_t block, const char* method) const;
  RankArea& rank_area(int local_rank, const char* method) const;
  // Throws PeerExited naming the first registered local rank whose process is gone.
  void check_peers(const std::string& waiting_for) const;
  void record_wait(double seconds);

  std::string name_;
  void* base_ = nullptr;
  std::size_t bytes_ = 0;
  int local_ranks_ = 0;
  std::int64_t num_blocks_ = 0;
  bool shared_ = false;
  bool unlinked_ = false;
  Header* header_ = nullptr;
  RankArea* ranks_ = nullptr;
  BlockControl* blocks_ = nullptr;
  float* data_ = nullptr;
  std::int64_t data_floats_ = 0;

  // Telemetry of this mapping (this process), not shared.
  std::atomic<std::uint64_t> waits_{0};
  std::atomic<std::uint64_t> published_{0};
  std::atomic<std::int64_t> wait_nanos_{0};
  std::atomic<std::int64_t> max_wait_nanos_{0};
};

}  // namespace asteria::store
