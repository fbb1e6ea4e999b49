// The refresh engine's fault injection (see RefreshEngine::inject_fault): for tests and the soak
// benchmark, acting inside the real worker jobs so that every failure path runs as for a genuine fault.
#include <chrono>
#include <cstdint>
#include <string>

#include "asteria/common/clock.h"
#include "asteria/common/errors.h"
#include "asteria/runtime/refresh_engine.h"
#include "asteria/runtime/refresh_engine_impl.h"

namespace asteria::runtime {

namespace {

// SplitMix64's finalizer: a well-mixed 64-bit hash, so that a job's random delay depends only on
// (seed, block, version) and not on which worker runs it or when.
std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

using detail::block_name;
using detail::job_name;

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
