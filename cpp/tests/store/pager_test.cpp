#include "asteria/store/pager.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <barrier>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <latch>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "asteria/common/errors.h"
#include "asteria/store/page_format.h"
#include "temp_dir.h"

namespace asteria::store {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

constexpr auto kWait = 30s;  // generous bound: a failure shows as a TimeoutError, never a hang

// Payload of version `version` of `key`: a pattern both depend on, so a mixed-up read cannot pass.
std::vector<std::byte> payload(std::uint64_t key, std::uint64_t version, std::size_t bytes) {
  std::vector<std::byte> out(bytes);
  for (std::size_t j = 0; j < bytes; ++j) {
    out[j] = static_cast<std::byte>((key * 131 + version * 31 + j * 7 + (j >> 8)) & 0xFF);
  }
  return out;
}

bool matches(const std::byte* data, std::uint64_t key, std::uint64_t version, std::size_t bytes) {
  const auto expected = payload(key, version, bytes);
  return std::memcmp(data, expected.data(), bytes) == 0;
}

// Flips one byte of `path` at `offset` through the page cache (and syncs it, so that an O_DIRECT
// read sees it).
void flip_byte(const std::string& path, std::uint64_t offset) {
  const int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << path;
  unsigned char b = 0;
  ASSERT_EQ(::pread(fd, &b, 1, static_cast<off_t>(offset)), 1);
  b ^= 0x5A;
  ASSERT_EQ(::pwrite(fd, &b, 1, static_cast<off_t>(offset)), 1);
  ASSERT_EQ(::fsync(fd), 0);
  ::close(fd);
}

class PagerTest : public ::testing::TestWithParam<IoModeRequest> {
 protected:

  std::unique_ptr<Pager> make(std::size_t record_bytes, std::size_t buffers, int io_threads = 2,
                              bool keep_files = false) {
    pool_.assign(buffers * record_bytes, std::byte{0});
    PagerConfig config;
    config.directory = dir_;
    config.record_bytes = record_bytes;
    config.io_threads = io_threads;
    config.mode = GetParam();
    config.keep_files = keep_files;
    return std::make_unique<Pager>(config, BufferPool{pool_.data(), buffers, record_bytes});
  }

  // Writes version `version` of `key` (record_bytes - key % 5 bytes) and waits for it.
  void put(Pager& pager, std::uint64_t key, std::uint64_t version) {
    const auto data = payload(key, version, pager.record_bytes() - key % 5);
    pager.wait(pager.write(key, version, data.data(), data.size()), kWait);
  }

  const std::byte* buffer(const Pager& pager, std::size_t index) const {
    return pool_.data() + index * pager.record_bytes();
  }

  test_support::TempDir temp_{"asteria_pager_test"};
  const std::string root_ = temp_.path();
  const std::string dir_ = root_ + "/pages";  // the pager creates it, so it also removes it
  std::vector<std::byte> pool_;
};

TEST_P(PagerTest, RoundTripsManyRecords) {
  constexpr std::size_t kRecord = 10000;  // not a multiple of 4096: slots are 12288 bytes
  auto pager = make(kRecord, 4);
  const bool direct = GetParam() == IoModeRequest::kAuto && probe_o_direct(root_);
  EXPECT_EQ(pager->mode(), direct ? IoMode::kDirect : IoMode::kBuffered);
  EXPECT_EQ(pager->stats().mode, pager->mode());
  constexpr std::uint64_t kKeys = 48;
  std::vector<std::vector<std::byte>> sources;
  std::vector<Pager::Ticket> tickets;
  for (std::uint64_t key = 0; key < kKeys; ++key) {
    sources.push_back(payload(key * 1000003, 1, kRecord - key % 5));
    tickets.push_back(pager->write(key * 1000003, 1, sources.back().data(), sources.back().size()));
  }
  for (const auto t : tickets) pager->wait(t, kWait);
  std::vector<std::byte> dst(kRecord);
  for (std::uint64_t key = 0; key < kKeys; ++key) {
    const ReadResult r = pager->read(key * 1000003, dst.data(), dst.size(), kWait);
    EXPECT_EQ(r.version, 1u);
    ASSERT_EQ(r.bytes, kRecord - key % 5);
    EXPECT_TRUE(matches(dst.data(), key * 1000003, 1, r.bytes)) << key;
  }
  std::vector<std::uint64_t> order;
  for (std::uint64_t key = kKeys; key-- > 0;) order.push_back(key * 1000003);
  pager->read_ahead(order);
  for (const std::uint64_t key : order) {
    const Acquired a = pager->acquire(key, kWait);
    EXPECT_EQ(a.version, 1u);
    EXPECT_TRUE(matches(buffer(*pager, a.index), key, 1, a.bytes)) << key;
    pager->release(a.index);
  }
  const PagerStats s = pager->stats();
  EXPECT_EQ(s.writes, kKeys);
  EXPECT_EQ(s.reads, 2 * kKeys);
  EXPECT_EQ(s.bytes_written, kKeys * 12288);
  EXPECT_EQ(s.bytes_read, 2 * kKeys * 12288);
  EXPECT_EQ(s.read_ahead_hits + s.read_ahead_misses, kKeys);
  EXPECT_EQ(s.keys, kKeys);
  EXPECT_EQ(s.read_errors + s.write_errors + s.checksum_failures, 0u);
  EXPECT_GT(s.write_seconds, 0.0);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_), fs::directory_iterator()), static_cast<long>(kKeys) + 1);
  pager->close();
  EXPECT_FALSE(fs::exists(dir_)) << "close() removes the files and the directory it created";
}

TEST_P(PagerTest, VersionsAreMonotonicAndReadsSeeTheNewest) {
  auto pager = make(3000, 2);
  for (std::uint64_t v = 1; v <= 5; ++v) put(*pager, 8, v);
  EXPECT_EQ(pager->version(8), 5u);
  EXPECT_FALSE(pager->version(9).has_value());
  std::vector<std::byte> dst(3000);
  EXPECT_EQ(pager->read(8, dst.data(), dst.size(), kWait).version, 5u);
  EXPECT_TRUE(matches(dst.data(), 8, 5, 3000 - 3));
  const auto data = payload(8, 5, 10);
  EXPECT_THROW(pager->write(8, 5, data.data(), data.size()), InvalidArgument);
  EXPECT_THROW(pager->write(8, 2, data.data(), data.size()), InvalidArgument);
  // Queued versions count too; a read issued after queued writes returns the last of them.
  std::vector<std::vector<std::byte>> sources;
  std::vector<Pager::Ticket> tickets;
  for (std::uint64_t v = 6; v <= 12; ++v) {
    sources.push_back(payload(8, v, 2000));
    tickets.push_back(pager->write(8, v, sources.back().data(), 2000));
  }
  EXPECT_THROW(pager->write(8, 12, data.data(), data.size()), InvalidArgument);
  const ReadResult r = pager->read(8, dst.data(), dst.size(), kWait);
  EXPECT_EQ(r.version, 12u);
  EXPECT_EQ(r.bytes, 2000u);
  EXPECT_TRUE(matches(dst.data(), 8, 12, 2000));
  for (const auto t : tickets) pager->wait(t, kWait);
  EXPECT_THROW(pager->wait(tickets.front(), kWait), InvalidArgument);  // already waited for
}

// A write that fails (EFBIG under RLIMIT_FSIZE: the second slot lies past the size limit) leaves the
// previous version live; a retry of the same version succeeds once the limit is lifted.
TEST_P(PagerTest, FailedWriteLeavesPreviousVersionReadable) {
  constexpr std::size_t kRecord = 8000;  // 8192-byte slots: slot 1 spans [8192, 16384)
  auto pager = make(kRecord, 1);
  put(*pager, 3, 1);
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit limited = saved;
  limited.rlim_cur = 8192;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limited), 0);
  const auto data = payload(3, 2, kRecord);
  const auto ticket = pager->write(3, 2, data.data(), data.size());
  bool thrown = false;
  try {
    pager->wait(ticket, kWait);
  } catch (const PagerIOError& e) {
    thrown = true;
    EXPECT_EQ(e.error_number(), EFBIG);
    EXPECT_EQ(e.path(), pager->path_of(3));
    EXPECT_EQ(e.offset(), 8192u);
    EXPECT_EQ(e.size(), 8192u);
    const std::string what = e.what();
    EXPECT_NE(what.find(pager->path_of(3)), std::string::npos) << what;
    EXPECT_NE(what.find("offset 8192"), std::string::npos) << what;
    EXPECT_NE(what.find(std::strerror(EFBIG)), std::string::npos) << what;
    EXPECT_NE(what.find("previous version stays live"), std::string::npos) << what;
  }
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &saved), 0);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_TRUE(thrown);
  EXPECT_EQ(pager->version(3), 1u);
  std::vector<std::byte> dst(kRecord);
  EXPECT_EQ(pager->read(3, dst.data(), dst.size(), kWait).version, 1u);
  EXPECT_TRUE(matches(dst.data(), 3, 1, kRecord - 3));
  EXPECT_EQ(pager->stats().write_errors, 1u);
  put(*pager, 3, 2);  // the failed version may be written again
  EXPECT_EQ(pager->read(3, dst.data(), dst.size(), kWait).version, 2u);
  EXPECT_TRUE(matches(dst.data(), 3, 2, kRecord - 3));
}

TEST_P(PagerTest, CorruptPayloadRaisesChecksumErrorAndFallsBackToTheOtherSlot) {
  constexpr std::size_t kRecord = 8000;
  auto pager = make(kRecord, 2);
  put(*pager, 5, 1);  // slot 0
  put(*pager, 5, 2);  // slot 1, live
  flip_byte(pager->path_of(5), 8192 + 64 + 777);
  pager->read_ahead({5});
  try {
    pager->acquire(5, kWait);
    ADD_FAILURE() << "no ChecksumError";
  } catch (const ChecksumError& e) {
    EXPECT_EQ(e.path(), pager->path_of(5));
    EXPECT_EQ(e.offset(), 8192u);
    EXPECT_EQ(e.size(), 8192u);
    EXPECT_EQ(e.error_number(), EBADMSG);
    const std::string what = e.what();
    EXPECT_NE(what.find("payload CRC32C"), std::string::npos) << what;
    EXPECT_NE(what.find("version 2"), std::string::npos) << what;
  }
  EXPECT_EQ(pager->stats().checksum_failures, 1u);
  EXPECT_EQ(pager->version(5), 1u) << "the corrupt version is dropped; the previous one is live";
  pager->read_ahead({5});
  const Acquired a = pager->acquire(5, kWait);  // the failed read's buffer was freed
  EXPECT_EQ(a.version, 1u);
  EXPECT_TRUE(matches(buffer(*pager, a.index), 5, 1, kRecord - 0));
  pager->release(a.index);
  // The next write goes to the bad slot and becomes live.
  put(*pager, 5, 3);
  std::vector<std::byte> dst(kRecord);
  EXPECT_EQ(pager->read(5, dst.data(), dst.size(), kWait).version, 3u);
  EXPECT_TRUE(matches(dst.data(), 5, 3, kRecord));
}

TEST_P(PagerTest, CorruptHeaderWithNoFallbackIsReportedThenNotFound) {
  auto pager = make(100, 1);
  put(*pager, 6, 1);
  flip_byte(pager->path_of(6), 20);  // inside the header of slot 0, the only version
  std::vector<std::byte> dst(100);
  try {
    pager->read(6, dst.data(), dst.size(), kWait);
    ADD_FAILURE() << "no ChecksumError";
  } catch (const ChecksumError& e) {
    EXPECT_EQ(e.offset(), 0u);
    EXPECT_EQ(e.size(), 4096u);
    EXPECT_NE(std::string(e.what()).find("header checksum"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(pager->version(6).has_value());
  try {
    pager->read(6, dst.data(), dst.size(), kWait);
    ADD_FAILURE() << "no NotFound";
  } catch (const NotFound& e) {
    EXPECT_NE(std::string(e.what()).find("no readable version"), std::string::npos) << e.what();
  }
}

TEST_P(PagerTest, RemovedFileGivesAClearError) {
  auto pager = make(5000, 1);
  put(*pager, 11, 1);
  ASSERT_EQ(::unlink(pager->path_of(11).c_str()), 0);
  std::vector<std::byte> dst(5000);
  try {
    pager->read(11, dst.data(), dst.size(), kWait);
    ADD_FAILURE() << "no PagerIOError";
  } catch (const PagerIOError& e) {
    EXPECT_EQ(e.error_number(), ENOENT);
    EXPECT_EQ(e.path(), pager->path_of(11));
    EXPECT_NE(std::string(e.what()).find("missing (was it removed?)"), std::string::npos) << e.what();
  }
  const auto data = payload(11, 2, 10);
  try {
    pager->wait(pager->write(11, 2, data.data(), data.size()), kWait);
    ADD_FAILURE() << "no PagerIOError";
  } catch (const PagerIOError& e) {
    EXPECT_EQ(e.error_number(), ENOENT);
  }
  EXPECT_FALSE(fs::exists(pager->path_of(11))) << "the pager never recreates a removed file silently";
}

TEST_P(PagerTest, ShortFileGivesAShortReadError) {
  auto pager = make(5000, 1);
  put(*pager, 2, 1);
  put(*pager, 2, 2);  // slot 1 at offset 8192
  ASSERT_EQ(::truncate(pager->path_of(2).c_str(), 8192 + 4096), 0);
  std::vector<std::byte> dst(5000);
  try {
    pager->read(2, dst.data(), dst.size(), kWait);
    ADD_FAILURE() << "no PagerIOError";
  } catch (const PagerIOError& e) {
    EXPECT_EQ(e.error_number(), EIO);
    EXPECT_NE(std::string(e.what()).find("short read"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("4096 of 8192 bytes at offset 8192"), std::string::npos) << e.what();
  }
}

// Read-ahead fills free buffers in schedule order and never holds more than the pool.
TEST_P(PagerTest, ReadAheadFollowsTheScheduleWithinTheBufferBound) {
  constexpr std::size_t kBuffers = 3;
  auto pager = make(4096, kBuffers, /*io_threads=*/2);
  for (std::uint64_t key = 0; key < 10; ++key) put(*pager, key, key + 1);
  const std::vector<std::uint64_t> schedule = {7, 2, 9, 0, 4, 1, 8, 3, 6, 5};
  pager->read_ahead(schedule);
  pager->drain(kWait);
  EXPECT_EQ(pager->stats().reads, kBuffers) << "only as many loads as buffers";
  // Out of order: key 5 waits behind the loaded buffers; a bounded wait explains why.
  try {
    pager->acquire(5, 50ms);
    ADD_FAILURE() << "no TimeoutError";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("waiting for a free buffer"), std::string::npos) << e.what();
  }
  std::vector<std::size_t> held;
  for (std::size_t i = 0; i < schedule.size(); ++i) {
    const Acquired a = pager->acquire(schedule[i], kWait);
    EXPECT_EQ(a.version, schedule[i] + 1);
    EXPECT_TRUE(matches(buffer(*pager, a.index), schedule[i], schedule[i] + 1, 4096 - schedule[i] % 5));
    pager->release(a.index);
    pager->drain(kWait);  // the freed buffer takes the next key of the schedule
    EXPECT_EQ(pager->stats().reads, std::min(schedule.size(), kBuffers + i + 1));
  }
  // Every acquire after the first three found its buffer loaded (the drain made sure), so all hit.
  EXPECT_EQ(pager->stats().read_ahead_hits, schedule.size());
  EXPECT_EQ(pager->stats().read_ahead_misses, 0u);
  // A key that was not scheduled is read on demand (a miss).
  const Acquired a = pager->acquire(4, kWait);
  EXPECT_EQ(a.version, 5u);
  EXPECT_EQ(pager->stats().read_ahead_misses, 1u);
  EXPECT_THROW(pager->release(a.index + 1 == kBuffers ? 0 : a.index + 1), InvalidArgument);  // not held
  pager->release(a.index);
  EXPECT_THROW(pager->release(a.index), InvalidArgument);
  EXPECT_THROW(pager->release(kBuffers), InvalidArgument);
  // cancel_read_ahead frees loaded buffers and drops the rest of the schedule.
  pager->read_ahead({1, 2, 3, 4, 5, 6});
  pager->drain(kWait);
  pager->cancel_read_ahead();
  pager->read_ahead({9});
  const Acquired b = pager->acquire(9, kWait);
  EXPECT_EQ(b.version, 10u);
  pager->release(b.index);
  EXPECT_THROW(pager->read_ahead({1, 99}), NotFound);
  EXPECT_THROW(pager->acquire(99, kWait), NotFound);
}

// A read-ahead issued after a write waits for that write (reads see their own writes). With a buffer
// per entry every read is queued right behind its write, ahead of the next write, so each returns
// exactly the version written before it.
TEST_P(PagerTest, ReadAheadSeesEarlierWrites) {
  auto pager = make(6000, 5);
  put(*pager, 1, 1);
  std::vector<std::vector<std::byte>> sources;
  std::vector<Pager::Ticket> tickets;
  for (std::uint64_t v = 2; v <= 6; ++v) {
    sources.push_back(payload(1, v, 6000));
    tickets.push_back(pager->write(1, v, sources.back().data(), 6000));
    pager->read_ahead({1});
  }
  for (std::uint64_t v = 2; v <= 6; ++v) {
    const Acquired a = pager->acquire(1, kWait);
    EXPECT_EQ(a.version, v);
    EXPECT_TRUE(matches(buffer(*pager, a.index), 1, v, 6000));
    pager->release(a.index);
  }
  for (const auto t : tickets) pager->wait(t, kWait);
}

TEST_P(PagerTest, ConcurrentWritersAndReaders) {
  constexpr std::size_t kRecord = 12000;
  constexpr int kWriters = 3, kReaders = 2, kVersions = 12;
  constexpr std::uint64_t kKeysPerWriter = 4;
  auto pager = make(kRecord, 2, /*io_threads=*/3);
  for (int w = 0; w < kWriters; ++w) {
    for (std::uint64_t i = 0; i < kKeysPerWriter; ++i) put(*pager, w * 100 + i, 1);
  }
  std::latch start(kWriters + kReaders);
  std::vector<std::thread> threads;
  std::vector<std::string> failures(kWriters + kReaders);
  for (int w = 0; w < kWriters; ++w) {
    threads.emplace_back([&, w] {
      start.arrive_and_wait();
      try {
        for (std::uint64_t v = 2; v <= kVersions; ++v) {
          std::vector<std::vector<std::byte>> sources;
          std::vector<Pager::Ticket> tickets;
          for (std::uint64_t i = 0; i < kKeysPerWriter; ++i) {
            sources.push_back(payload(w * 100 + i, v, kRecord - (w * 100 + i) % 5));
            tickets.push_back(pager->write(w * 100 + i, v, sources.back().data(), sources.back().size()));
          }
          for (const auto t : tickets) pager->wait(t, kWait);
        }
      } catch (const std::exception& e) {
        failures[w] = e.what();
      }
    });
  }
  for (int r = 0; r < kReaders; ++r) {
    threads.emplace_back([&, r] {
      std::mt19937 rng(r);
      std::vector<std::byte> dst(kRecord);
      start.arrive_and_wait();
      try {
        for (int n = 0; n < 60; ++n) {
          const std::uint64_t key = (rng() % kWriters) * 100 + rng() % kKeysPerWriter;
          const ReadResult got = pager->read(key, dst.data(), dst.size(), kWait);
          if (got.version < 1 || got.version > kVersions || !matches(dst.data(), key, got.version, got.bytes)) {
            failures[kWriters + r] =
                "key " + std::to_string(key) + " version " + std::to_string(got.version) + " is torn";
            return;
          }
        }
      } catch (const std::exception& e) {
        failures[kWriters + r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& f : failures) EXPECT_EQ(f, "");
  for (int w = 0; w < kWriters; ++w) {
    for (std::uint64_t i = 0; i < kKeysPerWriter; ++i) EXPECT_EQ(pager->version(w * 100 + i), std::uint64_t{kVersions});
  }
  EXPECT_EQ(pager->stats().checksum_failures, 0u);
}

TEST_P(PagerTest, KeepFilesRecoversTheNewestValidPage) {
  {
    auto pager = make(3000, 1, 1, /*keep_files=*/true);
    put(*pager, 1, 1);
    put(*pager, 1, 2);
    put(*pager, 2, 7);
    put(*pager, 3, 1);
    pager->close();
  }
  ASSERT_TRUE(fs::exists(dir_ + "/" + "page-0000000000000001.astp"));
  flip_byte(dir_ + "/page-0000000000000001.astp", 4096 + 64 + 5);  // version 2 of key 1 (slot 1)
  ASSERT_EQ(::truncate((dir_ + "/page-0000000000000003.astp").c_str(), 100), 0);  // torn
  EXPECT_THROW(make(3000, 1, 1, /*keep_files=*/false), InvalidArgument) << "page files present";
  EXPECT_THROW(make(9000, 1, 1, /*keep_files=*/true), InvalidArgument) << "another slot size";
  auto pager = make(3000, 1, 1, /*keep_files=*/true);
  const PagerStats s = pager->stats();
  EXPECT_EQ(s.recovered_keys, 2u);
  EXPECT_EQ(s.recovered_bad_pages, 2u);
  EXPECT_EQ(pager->version(1), 1u);
  EXPECT_EQ(pager->version(2), 7u);
  EXPECT_FALSE(pager->version(3).has_value());
  std::vector<std::byte> dst(3000);
  EXPECT_EQ(pager->read(2, dst.data(), dst.size(), kWait).version, 7u);
  EXPECT_TRUE(matches(dst.data(), 2, 7, 3000 - 2));
  put(*pager, 1, 2);
  pager->close();
  EXPECT_TRUE(fs::exists(dir_ + "/page-0000000000000002.astp")) << "keep_files leaves the files";
}

TEST_P(PagerTest, CloseCancelsQueuedWorkAndRefusesNewWork) {
  auto pager = make(64 * 1024, 2, 1);
  std::vector<std::vector<std::byte>> sources;
  std::vector<Pager::Ticket> tickets;
  for (std::uint64_t key = 0; key < 32; ++key) {
    sources.push_back(payload(key, 1, 64 * 1024));
    tickets.push_back(pager->write(key, 1, sources.back().data(), sources.back().size()));
  }
  pager->close();
  pager->close();  // idempotent
  int ok = 0, cancelled = 0;
  for (const auto t : tickets) {
    try {
      pager->wait(t, kWait);
      ++ok;
    } catch (const CancelledError&) {
      ++cancelled;
    }
  }
  EXPECT_EQ(ok + cancelled, 32);
  EXPECT_EQ(pager->stats().cancelled, static_cast<std::uint64_t>(cancelled));
  EXPECT_THROW(pager->write(1, 2, sources[0].data(), 10), CancelledError);
  EXPECT_THROW(pager->read_ahead({0}), CancelledError);
  EXPECT_FALSE(fs::exists(dir_));
}

TEST_P(PagerTest, RejectsBadArguments) {
  std::vector<std::byte> memory(8192);
  PagerConfig config;
  config.directory = dir_;
  config.record_bytes = 4096;
  config.mode = GetParam();
  const BufferPool pool{memory.data(), 2, 4096};
  auto with = [&](auto edit) {
    PagerConfig c = config;
    BufferPool p = pool;
    edit(c, p);
    return [c, p] { Pager pager(c, p); };
  };
  EXPECT_THROW(with([](PagerConfig& c, BufferPool&) { c.record_bytes = 0; })(), InvalidArgument);
  EXPECT_THROW(with([](PagerConfig& c, BufferPool&) { c.io_threads = 0; })(), InvalidArgument);
  EXPECT_THROW(with([](PagerConfig& c, BufferPool&) { c.io_threads = 65; })(), InvalidArgument);
  EXPECT_THROW(with([](PagerConfig& c, BufferPool&) { c.directory = ""; })(), InvalidArgument);
  EXPECT_THROW(with([](PagerConfig&, BufferPool& p) { p.base = nullptr; })(), InvalidArgument);
  EXPECT_THROW(with([](PagerConfig&, BufferPool& p) { p.count = 0; })(), InvalidArgument);
  EXPECT_THROW(with([](PagerConfig&, BufferPool& p) { p.stride_bytes = 4095; })(), InvalidArgument);
  std::FILE* f = std::fopen((root_ + "/file").c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fclose(f);
  try {
    with([&](PagerConfig& c, BufferPool&) { c.directory = root_ + "/file"; })();
    ADD_FAILURE() << "a file is not a directory";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("not a directory"), std::string::npos) << e.what();
  }

  Pager pager(config, pool);
  try {
    Pager second(config, pool);
    ADD_FAILURE() << "two pagers in one directory";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("in use by another pager"), std::string::npos) << e.what();
  }
  std::vector<std::byte> big(4097);
  EXPECT_THROW(pager.write(1, 1, big.data(), big.size()), InvalidArgument);
  EXPECT_THROW(pager.write(1, 0, big.data(), 10), InvalidArgument);
  EXPECT_THROW(pager.write(1, 1, nullptr, 10), InvalidArgument);
  EXPECT_THROW(pager.wait(12345, kWait), InvalidArgument);
  EXPECT_THROW(pager.read(1, big.data(), big.size(), kWait), NotFound);
  EXPECT_THROW(pager.read(1, nullptr, 10, kWait), InvalidArgument);
  pager.wait(pager.write(1, 1, big.data(), 4000), kWait);
  std::vector<std::byte> small(100);
  try {
    pager.read(1, small.data(), small.size(), kWait);
    ADD_FAILURE() << "destination too small";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("holds only 100"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(pager.keys().empty());
}

INSTANTIATE_TEST_SUITE_P(Modes, PagerTest, ::testing::Values(IoModeRequest::kAuto, IoModeRequest::kBuffered),
                         [](const auto& info) { return info.param == IoModeRequest::kAuto ? "Auto" : "Buffered"; });

TEST(PagerProbe, ReportsWhetherTheDirectoryTakesODirect) {
  std::string why;
  const bool direct = probe_o_direct("/tmp", &why);
  if (!direct) EXPECT_FALSE(why.empty());
  EXPECT_THROW(probe_o_direct("/nonexistent/asteria", &why), PagerIOError);
  EXPECT_STREQ(to_string(IoMode::kDirect), "o_direct");
  EXPECT_STREQ(to_string(IoMode::kBuffered), "buffered");
}

}  // namespace
}  // namespace asteria::store
