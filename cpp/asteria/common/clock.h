// Time helpers shared by every bounded wait of the core.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

#include <time.h>

namespace asteria {

using Clock = std::chrono::steady_clock;

// A deadline `timeout` from now, clamped so that "forever" (nanoseconds::max()) does not overflow.
inline Clock::time_point deadline_after(std::chrono::nanoseconds timeout) {
  constexpr std::chrono::nanoseconds kForever = std::chrono::hours(24 * 365 * 100);
  return Clock::now() + std::min(timeout, kForever);
}

// Time left until `deadline`, never negative.
inline std::chrono::nanoseconds time_left(Clock::time_point deadline) {
  return std::max(std::chrono::nanoseconds::zero(),
                  std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - Clock::now()));
}

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The calling thread's CPU time in seconds (CLOCK_THREAD_CPUTIME_ID): what a job took of a core, whatever else
// shared that core meanwhile.
inline double thread_cpu_seconds() {
  timespec now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

// "1.234 s", for error messages.
inline std::string format_seconds(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.3f s", seconds);
  return text;
}

}  // namespace asteria
