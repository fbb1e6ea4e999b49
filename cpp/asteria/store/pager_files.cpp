// The pager's work on its files: recovery of the pages a directory holds at open, and the I/O threads
// (which queued job may run, the writes and reads of page slots).
#include "asteria/store/pager_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>

#include "asteria/common/clock.h"
#include "asteria/common/errors.h"
#include "asteria/store/page_format.h"
#include "asteria/store/pager.h"

namespace asteria::store {

namespace detail {

AlignedBuffer aligned_buffer(std::size_t bytes) {
  void* p = std::aligned_alloc(kPageAlignment, round_up_to_page(std::max<std::size_t>(bytes, 1)));
  if (p == nullptr) throw std::bad_alloc();
  return AlignedBuffer(static_cast<std::byte*>(p));
}

std::string errno_text(int error_number) {
  return std::string(std::strerror(error_number)) + " (errno " + std::to_string(error_number) + ")";
}

FileLock lock_file(const std::string& path, const std::function<void()>& after_open) {
  // (Each retry follows a holder's release, which cannot repeat without end while this call waits on nothing.)
  constexpr int kTries = 64;
  for (int attempt = 1;; ++attempt) {
    FileLock lock;
    lock.fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    lock.created = lock.fd >= 0;
    if (lock.fd < 0 && errno == EEXIST) lock.fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (lock.fd < 0) {
      lock.error = errno;
      if (lock.error == ENOENT && attempt < kTries) continue;  // removed between the two opens
      return lock;
    }
    if (after_open) after_open();
    if (::flock(lock.fd, LOCK_EX | LOCK_NB) != 0) {
      lock.error = errno;
      lock.busy = lock.error == EWOULDBLOCK;
      ::close(lock.fd);
      lock.fd = -1;
      return lock;
    }
    struct stat held {}, named {};
    if (::fstat(lock.fd, &held) != 0) {
      lock.error = errno;
    } else if (::stat(path.c_str(), &named) != 0) {
      lock.error = errno == ENOENT ? 0 : errno;  // (ENOENT: the holder removed it; take the one made next)
    } else if (held.st_dev == named.st_dev && held.st_ino == named.st_ino) {
      return lock;
    }
    ::close(lock.fd);
    lock.fd = -1;
    if (lock.error != 0 || attempt >= kTries) {
      if (lock.error == 0) lock.error = ESTALE;
      return lock;
    }
  }
}

std::string page_file_name(std::uint64_t key) {
  char name[64];
  std::snprintf(name, sizeof(name), "page-%016llx.astp", static_cast<unsigned long long>(key));
  return name;
}

bool parse_page_file_name(const char* name, std::uint64_t* key) {
  const std::size_t n = std::strlen(name);
  if (n != 5 + 16 + 5 || std::strncmp(name, "page-", 5) != 0 || std::strcmp(name + 21, ".astp") != 0) return false;
  std::uint64_t v = 0;
  for (int i = 5; i < 21; ++i) {
    const char c = name[i];
    int d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else return false;
    v = (v << 4) | static_cast<std::uint64_t>(d);
  }
  *key = v;
  return true;
}

}  // namespace detail

using detail::AlignedBuffer;
using detail::aligned_buffer;
using detail::errno_text;
using detail::FdGuard;
using detail::parse_page_file_name;

namespace {

// Opens the page file `path` for a job's `op` ("write" or "read") of `bytes` at `offset`, or throws
// PagerIOError naming it (`prefix`: the Pager's where(op), `what`: the job's key and version).
int open_page(const std::string& path, int flags, const std::string& prefix, const char* op, std::uint64_t offset,
              std::size_t bytes, const std::string& what) {
  const int fd = ::open(path.c_str(), flags, 0600);
  if (fd >= 0) return fd;
  const int e = errno;
  const std::string cause = e == ENOENT ? "page file is missing (was it removed?)" : "cannot open page file";
  throw PagerIOError(prefix + cause + " " + path + " to " + op + " " + std::to_string(bytes) + " bytes at offset " +
                         std::to_string(offset) + what + ": " + errno_text(e),
                     path, offset, bytes, e);
}

}  // namespace

void Pager::recover() {
  std::vector<std::uint64_t> found;
  DIR* dir = ::opendir(config_.directory.c_str());
  if (dir == nullptr) {
    const int e = errno;
    throw PagerIOError(where("Pager") + "cannot list directory " + config_.directory + ": " + errno_text(e),
                       config_.directory, 0, 0, e);
  }
  while (const dirent* entry = ::readdir(dir)) {
    std::uint64_t key;
    if (parse_page_file_name(entry->d_name, &key)) found.push_back(key);
  }
  ::closedir(dir);
  if (found.empty()) return;
  if (!config_.keep_files) {
    throw InvalidArgument(where("Pager") + "directory=" + config_.directory + " already holds " +
                          std::to_string(found.size()) + " page file(s) (e.g. " + path_of(found.front()) +
                          "); pass keep_files=True to reopen them, or use an empty directory");
  }
  AlignedBuffer page = aligned_buffer(slot_bytes_);
  for (const std::uint64_t key : found) {
    const std::string path = path_of(key);
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (mode_ == IoMode::kDirect ? O_DIRECT : 0));
    if (fd < 0) {
      const int e = errno;
      throw PagerIOError(where("Pager") + "cannot open page file " + path + " for recovery: " + errno_text(e), path, 0,
                         0, e);
    }
    FdGuard guard{fd};
    KeyState state;
    state.file_exists = true;
    for (int s = 0; s < 2; ++s) {
      const std::uint64_t offset = static_cast<std::uint64_t>(s) * slot_bytes_;
      std::size_t got = 0;
      while (got < slot_bytes_) {
        const ssize_t n = ::pread(fd, page.get() + got, slot_bytes_ - got, static_cast<off_t>(offset + got));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
          const int e = errno;
          throw PagerIOError(where("Pager") + "pread of " + std::to_string(slot_bytes_) + " bytes at offset " +
                                 std::to_string(offset) + " of " + path + " failed during recovery: " + errno_text(e),
                             path, offset, slot_bytes_, e);
        }
        if (n == 0) break;
        got += static_cast<std::size_t>(n);
      }
      Slot& slot = state.slots[s];
      if (got == 0) continue;  // slot never written
      const bool zeros = std::all_of(page.get(), page.get() + std::min<std::size_t>(got, kPageHeaderBytes),
                                     [](std::byte b) { return b == std::byte{0}; });
      PageHeader header;
      if (parse_page_header({page.get(), got}, &header) == HeaderStatus::kOk &&
          (header.slot_bytes != slot_bytes_ || header.payload_bytes > config_.record_bytes)) {
        throw InvalidArgument(where("Pager") + "page file " + path + " holds a page of " +
                              std::to_string(header.payload_bytes) + " payload bytes in " +
                              std::to_string(header.slot_bytes) + "-byte slots; this pager has record_bytes=" +
                              std::to_string(config_.record_bytes) + " (" + std::to_string(slot_bytes_) +
                              "-byte slots): reopen it with the record_bytes it was written with");
      }
      if (got < slot_bytes_) {
        if (!zeros) {
          slot.state = SlotState::kBad;
          slot.failure =
              "torn page: only " + std::to_string(got) + " of " + std::to_string(slot_bytes_) + " bytes on disk";
          stats_.recovered_bad_pages += 1;
        }
        continue;
      }
      const PageCheck check = check_page({page.get(), slot_bytes_}, key, 0);
      if (check.status == PageStatus::kOk) {
        slot.state = SlotState::kGood;
        slot.version = check.header.version;
      } else if (!(zeros && check.header_status == HeaderStatus::kBadMagic)) {
        slot.state = SlotState::kBad;
        slot.failure = check.detail;
        stats_.recovered_bad_pages += 1;
      }
    }
    const int live = live_slot(state);
    if (live >= 0) {
      state.last_submitted_version = state.slots[live].version;
      stats_.recovered_keys += 1;
    }
    keys_.emplace(key, std::move(state));
  }
}

long Pager::find_runnable() const {
  for (std::size_t i = 0; i < queue_.size(); ++i) {
    const Job& job = queue_[i];
    const KeyState& k = keys_.at(job.key);
    if (job.is_write) {
      if (job.write_seq != k.writes_done + 1) continue;
      const int live = live_slot(k);
      const int target = live == 0 ? 1 : 0;
      if (k.slots[target].readers == 0) return static_cast<long>(i);
    } else if (k.writes_done >= job.write_seq) {
      return static_cast<long>(i);
    }
  }
  return -1;
}

void Pager::io_loop(std::byte* bounce) {
  std::unique_lock lock(mutex_);
  for (;;) {
    long index = -1;
    work_.wait(lock, [&] { return stopping_ || (index = find_runnable()) >= 0; });
    if (stopping_) return;
    Job job = std::move(queue_[index]);
    queue_.erase(queue_.begin() + index);
    in_flight_ += 1;
    KeyState& k = keys_.at(job.key);
    if (job.is_write) {
      const int live = live_slot(k);
      job.slot = live == 0 ? 1 : 0;
      job.had_live = live >= 0;
      job.create = !k.file_exists;
      k.slots[job.slot] = {job.version, SlotState::kWriting, 0, {}};
    } else {
      job.slot = live_slot(k);
      if (job.slot >= 0) {
        k.slots[job.slot].readers += 1;
        job.version = k.slots[job.slot].version;
      } else {
        std::string why;
        for (int s = 0; s < 2; ++s) {
          why += std::string(s == 0 ? "" : "; ") + "slot " + std::to_string(s) + ": " +
                 (k.slots[s].state == SlotState::kBad ? "bad (" + k.slots[s].failure + ")"
                  : k.slots[s].state == SlotState::kWriting ? "being written"
                                                             : "empty");
        }
        job.failure = std::make_exception_ptr(
            NotFound(where("read") + "key " + std::to_string(job.key) + " has no readable version (" + why + ")"));
      }
    }
    lock.unlock();
    const auto started = Clock::now();
    if (!job.failure) {
      try {
        if (job.is_write) run_write(job, bounce);
        else run_read(job, bounce);
      } catch (...) {
        job.failure = std::current_exception();
      }
    }
    const double seconds = seconds_since(started);
    lock.lock();
    in_flight_ -= 1;
    KeyState& key_state = keys_.at(job.key);
    if (job.file_created) {
      key_state.file_exists = true;
      key_state.created_here = true;
    }
    if (job.is_write) {
      Slot& slot = key_state.slots[job.slot];
      key_state.writes_done += 1;
      stats_.write_seconds += seconds;
      if (job.failure) {
        slot.state = SlotState::kBad;
        slot.failure = "write of version " + std::to_string(job.version) + " failed";
        stats_.write_errors += 1;
      } else {
        slot.state = SlotState::kGood;
        stats_.writes += 1;
        stats_.bytes_written += slot_bytes_;
      }
    } else {
      stats_.read_seconds += seconds;
      if (job.slot >= 0) {
        Slot& slot = key_state.slots[job.slot];
        slot.readers -= 1;
        if (job.checksum_failed && slot.version == job.version && slot.state == SlotState::kGood) {
          slot.state = SlotState::kBad;
          slot.failure = "version " + std::to_string(job.version) + " failed validation";
        }
      }
      if (job.failure) {
        stats_.read_errors += 1;
        if (job.checksum_failed) stats_.checksum_failures += 1;
      } else {
        stats_.reads += 1;
        stats_.bytes_read += slot_bytes_;
      }
      if (job.buffer >= 0) {
        Buffer& b = buffers_[job.buffer];
        if (b.state == BufferState::kDropped) {
          b.state = BufferState::kFree;
          dispatch_locked();
        } else {
          b.state = job.failure ? BufferState::kFailed : BufferState::kReady;
          b.error = job.failure;
          b.result = job.result;
        }
      }
    }
    if (job.request) {
      job.request->error = job.failure;
      job.request->result = job.result;
      job.request->done = true;
    }
    changed_.notify_all();
    work_.notify_all();
  }
}

void Pager::run_write(Job& job, std::byte* bounce) {
  const std::string path = path_of(job.key);
  const std::uint64_t offset = static_cast<std::uint64_t>(job.slot) * slot_bytes_;
  const std::string what = " (key " + std::to_string(job.key) + ", version " + std::to_string(job.version) + ")";
  encode_page(job.key, job.version, {job.src, job.bytes}, {bounce, slot_bytes_});
  // What a failed write leaves readable: nothing where the key has no version yet (its first write, or every
  // write so far failed).
  const std::string kept = job.had_live ? "; the previous version stays live"
                                        : "; the key has no earlier version to read instead";
  int flags = O_WRONLY | O_CLOEXEC | (mode_ == IoMode::kDirect ? O_DIRECT : 0);
  if (job.create) flags |= O_CREAT | (config_.keep_files ? 0 : O_EXCL);
  const int fd = open_page(path, flags, where("write"), "write", offset, slot_bytes_, what);
  if (job.create) job.file_created = true;
  FdGuard guard{fd};
  // The header's block goes last: a write that fails leaves no valid header of its version on disk, which a
  // pager reopened with keep_files would otherwise recover as the live version (a small payload shares the
  // header's block, so a failure after that block alone left a complete page behind). In buffered mode the rest
  // is made durable before the header is written.
  const auto write_range = [&](std::size_t begin, std::size_t end) {
    for (std::size_t done = begin; done < end;) {
      const ssize_t n = ::pwrite(fd, bounce + done, end - done, static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int e = n < 0 ? errno : EIO;
        throw PagerIOError(where("write") + "pwrite of bytes [" + std::to_string(begin) + ", " + std::to_string(end) +
                               ") of the " + std::to_string(slot_bytes_) + "-byte page at offset " +
                               std::to_string(offset) + " of " + path + " failed after " + std::to_string(done - begin) +
                               " bytes" + what + ": " + errno_text(e) + kept,
                           path, offset, slot_bytes_, e);
      }
      done += static_cast<std::size_t>(n);
    }
  };
  const auto sync = [&](const char* after) {
    if (mode_ != IoMode::kBuffered || ::fdatasync(fd) == 0) return;
    const int e = errno;
    throw PagerIOError(where("write") + "fdatasync after writing " + after + " of the " + std::to_string(slot_bytes_) +
                           "-byte page at offset " + std::to_string(offset) + " of " + path + " failed" + what + ": " +
                           errno_text(e) + kept,
                       path, offset, slot_bytes_, e);
  };
  write_range(kPageAlignment, slot_bytes_);
  if (slot_bytes_ > kPageAlignment) sync("its payload");
  try {
    write_range(0, kPageAlignment);
    sync("its header");
  } catch (const PagerIOError&) {
    // The header may have reached the disk whole: best effort, put a block of zeros (no page) in its place.
    std::memset(bounce, 0, kPageAlignment);
    if (::pwrite(fd, bounce, kPageAlignment, static_cast<off_t>(offset)) == static_cast<ssize_t>(kPageAlignment) &&
        mode_ == IoMode::kBuffered) {
      (void)::fdatasync(fd);
    }
    throw;
  }
  guard.fd = -1;
  if (::close(fd) != 0) {
    const int e = errno;
    throw PagerIOError(where("write") + "close of " + path + " after writing " + std::to_string(slot_bytes_) +
                           " bytes at offset " + std::to_string(offset) + " failed" + what + ": " + errno_text(e),
                       path, offset, slot_bytes_, e);
  }
}

void Pager::run_read(Job& job, std::byte* bounce) {
  const std::string path = path_of(job.key);
  const std::uint64_t offset = static_cast<std::uint64_t>(job.slot) * slot_bytes_;
  const std::string what = " (key " + std::to_string(job.key) + ", version " + std::to_string(job.version) + ")";
  const int fd = open_page(path, O_RDONLY | O_CLOEXEC | (mode_ == IoMode::kDirect ? O_DIRECT : 0), where("read"),
                           "read", offset, slot_bytes_, what);
  FdGuard guard{fd};
  std::size_t got = 0;
  while (got < slot_bytes_) {
    const ssize_t n = ::pread(fd, bounce + got, slot_bytes_ - got, static_cast<off_t>(offset + got));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int e = errno;
      throw PagerIOError(where("read") + "pread of " + std::to_string(slot_bytes_) + " bytes at offset " +
                             std::to_string(offset) + " of " + path + " failed after " + std::to_string(got) +
                             " bytes" + what + ": " + errno_text(e),
                         path, offset, slot_bytes_, e);
    }
    if (n == 0) {
      throw PagerIOError(where("read") + "short read of " + path + ": " + std::to_string(got) + " of " +
                             std::to_string(slot_bytes_) + " bytes at offset " + std::to_string(offset) +
                             " (the file ends at byte " + std::to_string(offset + got) + ")" + what,
                         path, offset, slot_bytes_, EIO);
    }
    got += static_cast<std::size_t>(n);
  }
  const PageCheck check = check_page({bounce, slot_bytes_}, job.key, job.version);
  if (check.status != PageStatus::kOk) {
    job.checksum_failed = true;
    throw ChecksumError(where("read") + "corrupt page in " + path + " at offset " + std::to_string(offset) + ", " +
                            std::to_string(slot_bytes_) + " bytes" + what + ": " + check.detail,
                        path, offset, slot_bytes_, EBADMSG);
  }
  const std::size_t payload = check.header.payload_bytes;
  const std::size_t capacity = job.buffer >= 0 ? config_.record_bytes : job.dst_bytes;
  if (payload > capacity) {
    throw InvalidArgument(where("read") + "key " + std::to_string(job.key) + " version " + std::to_string(job.version) +
                          " holds " + std::to_string(payload) + " bytes; the destination holds only " +
                          std::to_string(capacity));
  }
  job.result = {job.version, payload};
  if (job.buffer >= 0) {
    std::byte* row = pool_.base + static_cast<std::size_t>(job.buffer) * pool_.stride_bytes;
    std::memcpy(row, bounce + kPageHeaderBytes, payload);
  } else {
    std::lock_guard copy(job.request->copy_mutex);
    if (!job.request->abandoned) std::memcpy(job.dst, bounce + kPageHeaderBytes, payload);
  }
}

}  // namespace asteria::store
