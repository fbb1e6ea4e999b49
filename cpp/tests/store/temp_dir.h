// A fresh folder under the system's temporary directory ($TMPDIR, else /tmp) for a store test, removed with
// everything in it when the test ends (also where an ASSERT ends it early).
#pragma once

#include <stdlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>

namespace asteria::store::test_support {

class TempDir {
 public:
  explicit TempDir(const std::string& prefix) {
    // mkdtemp replaces the trailing XXXXXX with a unique suffix, in place
    std::string tmpl = (std::filesystem::temp_directory_path() / (prefix + "_XXXXXX")).string();
    if (::mkdtemp(tmpl.data()) == nullptr) {
      throw std::runtime_error("mkdtemp(" + tmpl + ") failed: " + std::strerror(errno));
    }
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace asteria::store::test_support
