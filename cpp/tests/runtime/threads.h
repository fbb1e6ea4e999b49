// Thread helpers for the runtime's tests.
#pragma once

#include <filesystem>
#include <fstream>
#include <string>

namespace asteria::runtime::test_support {

// The threads of this process named `name` (their /proc/self/task/<tid>/comm).
inline int threads_named(const std::string& name) {
  int count = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string line;
    if (std::getline(comm, line) && line == name) ++count;
  }
  return count;
}

}  // namespace asteria::runtime::test_support
