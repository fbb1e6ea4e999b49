// Versioned host slots of one preconditioner block over memory the caller owns (in Asteria: pinned
// torch tensors handed over as DLPack arrays). Version v lives in buffer v % depth, so the buffers
// of many blocks can be laid out side by side and copied as one tensor per version.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace asteria::store {

enum class SlotState { kEmpty, kWriting, kPublished, kFailed };

const char* to_string(SlotState state) noexcept;

// A ring of `depth` equally sized buffers holding successive versions (v >= 1) of one block.
//
// Life of a version: begin_write(v) -> (fill the buffer) -> publish(v) or fail(v); readers then
// acquire(v) ... release(v). Version v is handed its buffer only when no one reads or writes the
// buffer and version v - depth, the one before it in that buffer, has been retired (retire_through)
// or has failed, so a reader never sees a torn buffer and versions claim a buffer in order even when
// their writers arrive out of order. A failed version needs no retirement: no one can read it, and
// retire_through, which retires all older versions too, could not free it alone.
//
// Thread safety: every method is safe to call concurrently.
class VersionedRing {
 public:
  // `base` points at buffer 0; buffer i starts at base + i * stride_bytes and spans buffer_bytes.
  // `name` appears in error messages (e.g. "block 12 results").
  VersionedRing(std::byte* base, std::size_t buffer_bytes, std::size_t stride_bytes, int depth, std::string name);

  VersionedRing(const VersionedRing&) = delete;
  VersionedRing& operator=(const VersionedRing&) = delete;

  // Claims buffer v % depth for writing version v and returns it. Waits up to `timeout` for the
  // buffer to become free; throws TimeoutError naming the ring, the version and what holds the
  // buffer. Throws InvalidArgument if v < 1, if v has been retired already, or if v was written
  // before (versions may arrive out of order: two workers may write v and v + 1 at once).
  // `waited`, when given, says whether the call had to block for the buffer.
  std::byte* begin_write(std::int64_t version, std::chrono::nanoseconds timeout, bool* waited = nullptr);
  // Gives back the buffer that begin_write(v) claimed, before anything was published from it: the buffer's
  // bookkeeping returns to what it was (the version it held, and that version's state), and v may be written
  // again. For an owner that claims several rings' buffers as one step and must undo the claims made before
  // one that failed. The bytes are not restored: the caller must not have written to the buffer. Throws
  // InvalidArgument unless v is being written.
  void abandon_write(std::int64_t version);
  // Makes version v visible to readers and wakes waiters. Throws InvalidArgument unless v is being written.
  void publish(std::int64_t version);
  // Marks version v as failed (its buffer holds nothing usable and is free for version v + depth)
  // and wakes waiters. Throws InvalidArgument unless v is being written.
  void fail(std::int64_t version);

  // Pins published version v for reading and returns its buffer. Throws InvalidArgument if v is not
  // the published version in its buffer.
  const std::byte* acquire(std::int64_t version);
  // Unpins version v. Throws InvalidArgument if v was not acquired.
  void release(std::int64_t version);

  // Allows every version <= v to be overwritten once unpinned.
  void retire_through(std::int64_t version);
  // Ends every wait in begin_write, at once and from then on, with CancelledError: the owner is closing
  // and the buffer waited for may never be freed (a step that failed mid-install holds it). Idempotent.
  void close();
  // Declares that version v (not yet written, nor retired) will never be written: the version after it in
  // its buffer may then claim the buffer once v's own predecessor there would have let v claim it, so the
  // buffer still goes to versions in order. Throws InvalidArgument for a version written or retired.
  void skip(std::int64_t version);
  // Throws InvalidArgument, as begin_write and skip would, unless version v can still be written or skipped
  // (not retired, written or skipped): an owner checks its rings before it changes any of them.
  void check_open(std::int64_t version) const;

  // State of version v (>= 1, else InvalidArgument): kEmpty if its buffer holds another version.
  SlotState state(std::int64_t version) const;
  // Newest published version, 0 if none.
  std::int64_t latest_published() const;
  int depth() const noexcept { return depth_; }
  std::size_t buffer_bytes() const noexcept { return buffer_bytes_; }
  const std::string& name() const noexcept { return name_; }

 private:
  struct Slot {
    std::int64_t version = 0;
    SlotState state = SlotState::kEmpty;
    int readers = 0;
    // What the buffer held before the version being written claimed it (for abandon_write).
    std::int64_t previous_version = 0;
    SlotState previous_state = SlotState::kEmpty;
  };
  // Index of the buffer of `version`; throws InvalidArgument, naming `method`, if version < 1.
  std::size_t index(std::int64_t version, const char* method) const;
  bool writable(std::int64_t version) const;  // requires mutex_
  // The slot of `version`, which must be being written (else InvalidArgument naming `method`). Requires mutex_.
  Slot& writing_slot(std::int64_t version, const char* method);
  // Whether `version`, the one before a writer in its buffer, is done with it. Requires mutex_.
  bool done_with_buffer(std::int64_t version) const;
  // Throws InvalidArgument if `version` may never be written. Requires mutex_.
  void check_writable_version(std::int64_t version) const;
  // What keeps `version` from its buffer, for the timeout message. Requires mutex_.
  std::string describe_holder(std::int64_t version) const;
  std::string where(const char* method) const;
  std::byte* buffer(std::int64_t version) const;

  std::byte* const base_;
  const std::size_t buffer_bytes_;
  const std::size_t stride_bytes_;
  const int depth_;
  const std::string name_;

  mutable std::mutex mutex_;
  std::condition_variable changed_;            // guarded by mutex_
  std::vector<Slot> slots_;                    // guarded by mutex_
  std::int64_t latest_published_ = 0;          // guarded by mutex_
  bool closed_ = false;                        // guarded by mutex_
  std::int64_t retired_through_ = 0;           // guarded by mutex_
  std::set<std::int64_t> skipped_;             // guarded by mutex_; skipped versions above retired_through_
};

}  // namespace asteria::store
