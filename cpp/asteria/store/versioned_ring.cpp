#include "asteria/store/versioned_ring.h"

#include <algorithm>
#include <cstdio>

#include "asteria/common/clock.h"
#include "asteria/common/errors.h"

namespace asteria::store {

namespace {

}  // namespace

const char* to_string(SlotState state) noexcept {
  switch (state) {
    case SlotState::kEmpty: return "empty";
    case SlotState::kWriting: return "writing";
    case SlotState::kPublished: return "published";
    case SlotState::kFailed: return "failed";
  }
  return "unknown";
}

VersionedRing::VersionedRing(std::byte* base, std::size_t buffer_bytes, std::size_t stride_bytes, int depth,
                             std::string name)
    : base_(base),
      buffer_bytes_(buffer_bytes),
      stride_bytes_(stride_bytes),
      depth_(depth),
      name_(std::move(name)) {
  if (base_ == nullptr) throw InvalidArgument(where("VersionedRing") + "base is null; a buffer address is required");
  if (depth_ < 1) throw InvalidArgument(where("VersionedRing") + "depth=" + std::to_string(depth_) + " must be >= 1");
  if (depth_ > 1 && buffer_bytes_ > stride_bytes_) {
    throw InvalidArgument(where("VersionedRing") + "buffer_bytes=" + std::to_string(buffer_bytes_) +
                          " exceeds stride_bytes=" + std::to_string(stride_bytes_) +
                          ": buffers would overlap (allowed only with depth 1)");
  }
  slots_.resize(static_cast<std::size_t>(depth_));
}

std::byte* VersionedRing::begin_write(std::int64_t version, std::chrono::nanoseconds timeout, bool* waited) {
  const auto started = Clock::now();
  const auto deadline = deadline_after(timeout);
  std::unique_lock lock(mutex_);
  bool timed_out = false;
  if (waited != nullptr) *waited = false;
  // Re-checked after every wake-up: the version may be retired while its writer waits.
  for (check_writable_version(version); !writable(version); check_writable_version(version)) {
    if (closed_) {
      throw CancelledError(where("begin_write") + "version " + std::to_string(version) +
                           ": the ring was closed while it waited for buffer " + std::to_string(version % depth_));
    }
    if (timed_out) {
      throw TimeoutError(where("begin_write") + "version " + std::to_string(version) + " waited " +
                         format_seconds(std::chrono::duration<double>(Clock::now() - started).count()) +
                         " for buffer " + std::to_string(version % depth_) + ", " + describe_holder(version));
    }
    if (waited != nullptr) *waited = true;
    timed_out = changed_.wait_until(lock, deadline) == std::cv_status::timeout;
  }
  Slot& target = slots_[index(version, "begin_write")];
  target.previous_version = target.version;
  target.previous_state = target.state;
  target.version = version;
  target.state = SlotState::kWriting;
  return buffer(version);
}

void VersionedRing::abandon_write(std::int64_t version) {
  {
    std::lock_guard lock(mutex_);
    Slot& target = writing_slot(version, "abandon_write");
    target.version = target.previous_version;
    target.state = target.previous_state;
  }
  changed_.notify_all();  // (a writer of the next version in this buffer waits for this one to end)
}

void VersionedRing::close() {
  {
    std::lock_guard lock(mutex_);
    closed_ = true;
  }
  changed_.notify_all();
}

void VersionedRing::publish(std::int64_t version) {
  {
    std::lock_guard lock(mutex_);
    Slot& target = writing_slot(version, "publish");
    target.state = SlotState::kPublished;
    latest_published_ = std::max(latest_published_, version);
  }
  changed_.notify_all();
}

void VersionedRing::fail(std::int64_t version) {
  {
    std::lock_guard lock(mutex_);
    Slot& target = writing_slot(version, "fail");
    target.state = SlotState::kFailed;
  }
  changed_.notify_all();
}

VersionedRing::Slot& VersionedRing::writing_slot(std::int64_t version, const char* method) {
  Slot& target = slots_[index(version, method)];
  if (target.version != version || target.state != SlotState::kWriting) {
    throw InvalidArgument(where(method) + "version " + std::to_string(version) +
                          " is not being written (its buffer holds version " + std::to_string(target.version) +
                          ", " + to_string(target.state) + ")");
  }
  return target;
}

const std::byte* VersionedRing::acquire(std::int64_t version) {
  std::lock_guard lock(mutex_);
  Slot& target = slots_[index(version, "acquire")];
  if (target.version != version || target.state != SlotState::kPublished) {
    throw InvalidArgument(where("acquire") + "version " + std::to_string(version) +
                          " is not published (its buffer holds version " + std::to_string(target.version) + ", " +
                          to_string(target.state) + ")");
  }
  target.readers += 1;
  return buffer(version);
}

void VersionedRing::release(std::int64_t version) {
  {
    std::lock_guard lock(mutex_);
    Slot& target = slots_[index(version, "release")];
    if (target.version != version || target.readers == 0) {
      throw InvalidArgument(where("release") + "version " + std::to_string(version) +
                            " is not acquired (its buffer holds version " + std::to_string(target.version) + ", " +
                            to_string(target.state) + ", " + std::to_string(target.readers) + " readers)");
    }
    target.readers -= 1;
  }
  changed_.notify_all();
}

void VersionedRing::retire_through(std::int64_t version) {
  {
    std::lock_guard lock(mutex_);
    if (version <= retired_through_) return;
    retired_through_ = version;
    skipped_.erase(skipped_.begin(), skipped_.upper_bound(version));
  }
  changed_.notify_all();
}

void VersionedRing::skip(std::int64_t version) {
  {
    std::lock_guard lock(mutex_);
    check_writable_version(version);
    skipped_.insert(version);
  }
  changed_.notify_all();
}

void VersionedRing::check_open(std::int64_t version) const {
  std::lock_guard lock(mutex_);
  check_writable_version(version);
}

SlotState VersionedRing::state(std::int64_t version) const {
  std::lock_guard lock(mutex_);
  const Slot& held = slots_[index(version, "state")];
  return held.version == version ? held.state : SlotState::kEmpty;
}

std::int64_t VersionedRing::latest_published() const {
  std::lock_guard lock(mutex_);
  return latest_published_;
}

std::size_t VersionedRing::index(std::int64_t version, const char* method) const {
  if (version < 1) {
    throw InvalidArgument(where(method) + "version " + std::to_string(version) + " must be >= 1");
  }
  return static_cast<std::size_t>(version % depth_);
}

bool VersionedRing::writable(std::int64_t version) const {
  const Slot& held = slots_[index(version, "begin_write")];
  return held.state != SlotState::kWriting && held.readers == 0 && done_with_buffer(version - depth_);
}

bool VersionedRing::done_with_buffer(std::int64_t version) const {
  const Slot& held = slots_[static_cast<std::size_t>(((version % depth_) + depth_) % depth_)];
  // A skipped version never held the buffer: it is done when the version before it there is.
  for (; skipped_.contains(version); version -= depth_) {
  }
  return version <= retired_through_ || (held.version == version && held.state == SlotState::kFailed);
}

void VersionedRing::check_writable_version(std::int64_t version) const {
  const Slot& held = slots_[index(version, "begin_write")];
  if (version <= retired_through_) {
    throw InvalidArgument(where("begin_write") + "version " + std::to_string(version) +
                          " is retired (retired through " + std::to_string(retired_through_) +
                          "); only newer versions can be written");
  }
  if (held.version == version) {
    throw InvalidArgument(where("begin_write") + "version " + std::to_string(version) + " was written before (" +
                          to_string(held.state) + ")");
  }
  if (skipped_.contains(version)) {
    throw InvalidArgument(where("begin_write") + "version " + std::to_string(version) + " was skipped");
  }
  // Only a retired or failed version gives way to the next one in its buffer (see writable()), so a
  // newer version there means this one is past writing.
  if (held.version > version) {
    throw InvalidArgument(where("begin_write") + "version " + std::to_string(version) + " is older than version " +
                          std::to_string(held.version) + " in its buffer; it was written before or retired");
  }
}

std::string VersionedRing::describe_holder(std::int64_t version) const {
  const Slot& held = slots_[index(version, "begin_write")];
  std::string text = held.state == SlotState::kEmpty
                         ? std::string("which is empty")
                         : "held by version " + std::to_string(held.version) + " (" + to_string(held.state) + ", " +
                               std::to_string(held.readers) + (held.readers == 1 ? " reader)" : " readers)");
  text += "; retired through " + std::to_string(retired_through_) + ", needs version " +
          std::to_string(version - depth_) + " retired or failed, no reader and no writer";
  return text;
}

std::string VersionedRing::where(const char* method) const {
  return std::string("[VersionedRing::") + method + "] " + name_ + ": ";
}

std::byte* VersionedRing::buffer(std::int64_t version) const {
  return base_ + static_cast<std::size_t>(version % depth_) * stride_bytes_;
}

}  // namespace asteria::store
