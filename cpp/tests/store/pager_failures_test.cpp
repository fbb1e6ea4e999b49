// What a failed page write or a refused pager leaves on disk: no page of the failed version that a pager
// reopened over the same files could take for the live one, no lock file in a directory the caller owns, and an
// error that says which version stays readable.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "asteria/common/errors.h"
#include "asteria/store/pager.h"
#include "asteria/store/pager_files.h"
#include "temp_dir.h"

namespace asteria::store {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

constexpr auto kWait = 30s;

// A size limit on the files this process writes (EFBIG past it, SIGXFSZ ignored), lifted when it goes.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) : handler_(std::signal(SIGXFSZ, SIG_IGN)) {
    ::getrlimit(RLIMIT_FSIZE, &saved_);
    rlimit limited = saved_;
    limited.rlim_cur = bytes;
    ::setrlimit(RLIMIT_FSIZE, &limited);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &saved_);
    std::signal(SIGXFSZ, handler_);
  }

 private:
  rlimit saved_{};
  void (*handler_)(int);
};

class PagerFailures : public ::testing::TestWithParam<IoModeRequest> {
 protected:
  std::unique_ptr<Pager> make(bool keep_files, std::size_t record_bytes = 8000) {
    pool_.assign(record_bytes, std::byte{0});
    PagerConfig config;
    config.directory = dir_;
    config.record_bytes = record_bytes;
    config.io_threads = 1;
    config.mode = GetParam();
    config.keep_files = keep_files;
    return std::make_unique<Pager>(config, BufferPool{pool_.data(), 1, record_bytes});
  }
  // Writes `bytes` bytes of `fill` as `version` of `key`; returns the write's error message ("" if none).
  static std::string write(Pager& pager, std::uint64_t key, std::uint64_t version, std::byte fill, std::size_t bytes) {
    const std::vector<std::byte> data(bytes, fill);
    try {
      pager.wait(pager.write(key, version, data.data(), data.size()), kWait);
    } catch (const PagerIOError& e) {
      return e.what();
    }
    return "";
  }
  test_support::TempDir temp_{"asteria_pager_failures"};
  const std::string dir_ = temp_.path();
  std::vector<std::byte> pool_;
};

TEST_P(PagerFailures, AFailedWriteIsNeverRecoveredAsTheLiveVersion) {
  // 8192-byte slots; a 100-byte payload shares its block with the header. Versions 1-3 fill both slots, then the
  // limit lets version 4's first block into slot 1 and stops its second: written first, the header's block left
  // a whole page of version 4 over version 2's.
  {
    auto pager = make(/*keep_files=*/true);
    for (std::uint64_t version = 1; version <= 3; ++version) {
      ASSERT_EQ(write(*pager, 5, version, std::byte(version), 100), "");
    }
    {
      FileSizeLimit limit(8192 + 4096);
      EXPECT_NE(write(*pager, 5, 4, std::byte{4}, 100), "");
    }
    EXPECT_EQ(pager->version(5), 3u);
    pager->close();
  }
  auto pager = make(/*keep_files=*/true);
  EXPECT_EQ(pager->version(5), 3u);  // (before: 4, a version whose write had failed)
  std::vector<std::byte> out(100);
  EXPECT_EQ(pager->read(5, out.data(), out.size(), kWait).version, 3u);
  EXPECT_EQ(out[0], std::byte{3});
}

TEST_P(PagerFailures, TheErrorSaysWhetherAVersionStaysReadable) {
  auto pager = make(/*keep_files=*/false);
  {
    FileSizeLimit limit(4096);  // the first write's slot 0 is cut short: the key has no version
    const std::string first = write(*pager, 1, 1, std::byte{1}, 6000);
    EXPECT_NE(first.find("the key has no earlier version to read instead"), std::string::npos) << first;
    const std::string second = write(*pager, 1, 2, std::byte{2}, 6000);  // the file exists now, still no version
    EXPECT_NE(second.find("the key has no earlier version to read instead"), std::string::npos) << second;
  }
  EXPECT_FALSE(pager->version(1).has_value());
  ASSERT_EQ(write(*pager, 1, 3, std::byte{3}, 6000), "");
  FileSizeLimit limit(8192 + 4096);
  const std::string third = write(*pager, 1, 4, std::byte{4}, 6000);
  EXPECT_NE(third.find("the previous version stays live"), std::string::npos) << third;
}

TEST_P(PagerFailures, ARefusedPagerLeavesNoLockFileInTheCallersDirectory) {
  {
    auto pager = make(/*keep_files=*/true);
    ASSERT_EQ(write(*pager, 2, 1, std::byte{1}, 100), "");
    pager->close();
  }
  std::error_code ec;
  fs::remove(dir_ + "/.astp.lock", ec);
  EXPECT_THROW(make(/*keep_files=*/false), InvalidArgument);  // page files present: not a scratch directory
  EXPECT_THROW(make(/*keep_files=*/true, 20000), InvalidArgument);  // pages of another slot size
  EXPECT_FALSE(fs::exists(dir_ + "/.astp.lock"));
  EXPECT_TRUE(fs::exists(dir_));
  auto pager = make(/*keep_files=*/true);  // and the directory can be opened as before
  EXPECT_EQ(pager->version(2), 1u);
}

INSTANTIATE_TEST_SUITE_P(Modes, PagerFailures, ::testing::Values(IoModeRequest::kAuto, IoModeRequest::kBuffered),
                         [](const auto& info) { return info.param == IoModeRequest::kAuto ? "Auto" : "Buffered"; });

// A pager that closes removes its lock file while it holds it. A lock taken on the file as it was opened just
// before (here: removed and made anew between the open and the flock, as a closing pager and a new one would) must
// not count: the lock held is on the file the path names, and the next taker finds it busy.
TEST(PagerLock, ALockFileReplacedBeforeItIsLockedIsLockedAgain) {
  const test_support::TempDir dir("asteria_pager_lock");
  const std::string path = dir.path() + "/.astp.lock";
  int opens = 0;
  const detail::FileLock lock = detail::lock_file(path, [&] {
    if (++opens > 1) return;
    ASSERT_EQ(::unlink(path.c_str()), 0);
    const int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    ASSERT_GE(fd, 0);
    ::close(fd);
  });
  ASSERT_GE(lock.fd, 0) << detail::errno_text(lock.error);
  const detail::FdGuard held_lock{lock.fd};
  EXPECT_EQ(opens, 2);
  EXPECT_FALSE(lock.created);  // (the second open found the file the other taker made)
  struct stat held {}, named {};
  ASSERT_EQ(::fstat(lock.fd, &held), 0);
  ASSERT_EQ(::stat(path.c_str(), &named), 0);
  EXPECT_EQ(held.st_ino, named.st_ino);
  const detail::FileLock second = detail::lock_file(path);
  EXPECT_TRUE(second.busy);
  EXPECT_EQ(second.fd, -1);
}

}  // namespace
}  // namespace asteria::store
