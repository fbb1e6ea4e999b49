#include "asteria/store/pager.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <span>

#include "asteria/common/clock.h"
#include "asteria/common/errors.h"
#include "asteria/store/page_format.h"

namespace asteria::store {

namespace {

constexpr const char* kLockName = ".astp.lock";
constexpr std::size_t kMaxRecordBytes = std::size_t{1} << 40;
constexpr int kMaxIoThreads = 64;

struct FreeDeleter {
  void operator()(std::byte* p) const noexcept { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<std::byte, FreeDeleter>;

AlignedBuffer aligned_buffer(std::size_t bytes) {
  void* p = std::aligned_alloc(kPageAlignment, round_up_to_page(std::max<std::size_t>(bytes, 1)));
  if (p == nullptr) throw std::bad_alloc();
  return AlignedBuffer(static_cast<std::byte*>(p));
}

std::string errno_text(int error_number) {
  return std::string(std::strerror(error_number)) + " (errno " + std::to_string(error_number) + ")";
}

// Closes `fd` on scope exit (errors of close() on a read-only or already-synced fd carry no data).
struct FdGuard {
  int fd = -1;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

std::string page_file_name(std::uint64_t key) {
  char name[64];
  std::snprintf(name, sizeof(name), "page-%016llx.astp", static_cast<unsigned long long>(key));
  return name;
}

// Parses "page-<16 hex>.astp"; returns false for any other name.
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

std::atomic<std::uint64_t> g_probe_counter{0};

}  // namespace

const char* to_string(IoMode mode) noexcept { return mode == IoMode::kDirect ? "o_direct" : "buffered"; }

bool probe_o_direct(const std::string& directory, std::string* why) {
  const std::string path = directory + "/.astp.probe." + std::to_string(::getpid()) + "." +
                           std::to_string(g_probe_counter.fetch_add(1));
  const int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_RDWR | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int e = errno;
    if (e == EINVAL) {
      if (why != nullptr) *why = "open(O_DIRECT) of " + path + " failed: " + errno_text(e);
      return false;
    }
    throw PagerIOError("[Pager] cannot create a file in directory " + directory + " (" + path + "): " + errno_text(e),
                       path, 0, 0, e);
  }
  FdGuard guard{fd};
  AlignedBuffer block = aligned_buffer(kPageAlignment);
  std::memset(block.get(), 0xA5, kPageAlignment);
  bool ok = true;
  if (::pwrite(fd, block.get(), kPageAlignment, 0) != static_cast<ssize_t>(kPageAlignment)) {
    if (why != nullptr) *why = "pwrite(O_DIRECT) of 4096 aligned bytes to " + path + " failed: " + errno_text(errno);
    ok = false;
  } else if (::pread(fd, block.get(), kPageAlignment, 0) != static_cast<ssize_t>(kPageAlignment)) {
    if (why != nullptr) *why = "pread(O_DIRECT) of 4096 aligned bytes from " + path + " failed: " + errno_text(errno);
    ok = false;
  }
  ::unlink(path.c_str());
  return ok;
}

Pager::Pager(PagerConfig config, BufferPool buffers) : config_(std::move(config)), pool_(buffers) {
  if (config_.directory.empty()) {
    throw InvalidArgument(where("Pager") + "Invalid directory='': a directory path is required");
  }
  if (config_.record_bytes < 1 || config_.record_bytes > kMaxRecordBytes) {
    throw InvalidArgument(where("Pager") + "Invalid record_bytes=" + std::to_string(config_.record_bytes) +
                          ": must be in [1, 2^40]");
  }
  if (config_.io_threads < 1 || config_.io_threads > kMaxIoThreads) {
    throw InvalidArgument(where("Pager") + "Invalid io_threads=" + std::to_string(config_.io_threads) +
                          ": must be in [1, " + std::to_string(kMaxIoThreads) + "]");
  }
  if (pool_.base == nullptr) throw InvalidArgument(where("Pager") + "buffer pool base is null");
  if (pool_.count < 1) throw InvalidArgument(where("Pager") + "Invalid buffer count=0: must be >= 1");
  if (pool_.count > 1 && pool_.stride_bytes < config_.record_bytes) {
    throw InvalidArgument(where("Pager") + "Invalid buffer stride=" + std::to_string(pool_.stride_bytes) +
                          " bytes: smaller than record_bytes=" + std::to_string(config_.record_bytes) +
                          ": buffers would overlap");
  }
  slot_bytes_ = slot_bytes_for(config_.record_bytes);
  stats_.io_threads = config_.io_threads;
  stats_.record_bytes = config_.record_bytes;
  stats_.slot_bytes = slot_bytes_;

  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(config_.directory, ec)) {
    created_directory_ = fs::create_directories(config_.directory, ec);
    if (ec) {
      throw PagerIOError(where("Pager") + "cannot create directory " + config_.directory + ": " + ec.message(),
                         config_.directory, 0, 0, ec.value());
    }
  } else if (!fs::is_directory(config_.directory, ec)) {
    throw InvalidArgument(where("Pager") + "Invalid directory='" + config_.directory +
                          "': exists and is not a directory");
  }
  try {
    const std::string lock_path = config_.directory + "/" + kLockName;
    lock_fd_ = ::open(lock_path.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600);
    if (lock_fd_ < 0) {
      const int e = errno;
      throw PagerIOError(where("Pager") + "cannot open lock file " + lock_path + ": " + errno_text(e), lock_path, 0, 0,
                         e);
    }
    if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
      const int e = errno;
      throw InvalidArgument(where("Pager") + "directory=" + config_.directory +
                            " is in use by another pager (lock file " + lock_path + ": " + errno_text(e) + ")");
    }
    std::string why;
    switch (config_.mode) {
      case IoModeRequest::kBuffered: mode_ = IoMode::kBuffered; break;
      case IoModeRequest::kAuto:
        mode_ = probe_o_direct(config_.directory, &why) ? IoMode::kDirect : IoMode::kBuffered;
        break;
      case IoModeRequest::kDirect:
        if (!probe_o_direct(config_.directory, &why)) {
          throw PagerIOError(where("Pager") + "o_direct was requested but directory " + config_.directory +
                                 " refuses O_DIRECT: " + why,
                             config_.directory, 0, kPageAlignment, EINVAL);
        }
        mode_ = IoMode::kDirect;
        break;
    }
    stats_.mode = mode_;
    recover();
    buffers_.resize(pool_.count);
    std::vector<AlignedBuffer> bounces;
    for (int i = 0; i < config_.io_threads; ++i) bounces.push_back(aligned_buffer(slot_bytes_));
    for (int i = 0; i < config_.io_threads; ++i) {
      threads_.emplace_back([this, bounce = std::shared_ptr<std::byte>(bounces[i].release(), FreeDeleter{})] {
        io_loop(bounce.get());
      });
    }
  } catch (...) {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    work_.notify_all();
    for (auto& t : threads_) t.join();
    if (lock_fd_ >= 0) ::close(lock_fd_);
    lock_fd_ = -1;
    if (created_directory_) {
      ::unlink((config_.directory + "/" + kLockName).c_str());
      ::rmdir(config_.directory.c_str());
    }
    throw;
  }
}

Pager::~Pager() { close(); }

std::string Pager::where(const char* method) const { return std::string("[Pager::") + method + "] "; }

std::string Pager::path_of(std::uint64_t key) const { return config_.directory + "/" + page_file_name(key); }

void Pager::check_open(const char* method) const {
  if (stopping_) throw CancelledError(where(method) + "the pager (directory " + config_.directory + ") is closed");
}

int Pager::live_slot(const KeyState& k) {
  int best = -1;
  for (int s = 0; s < 2; ++s) {
    if (k.slots[s].state == SlotState::kGood && (best < 0 || k.slots[s].version > k.slots[best].version)) best = s;
  }
  return best;
}

void Pager::recover() {
  namespace fs = std::filesystem;
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

Pager::Ticket Pager::write(std::uint64_t key, std::uint64_t version, const std::byte* src, std::size_t bytes) {
  if (bytes > config_.record_bytes) {
    throw InvalidArgument(where("write") + "key " + std::to_string(key) + ": Invalid bytes=" + std::to_string(bytes) +
                          ": exceeds record_bytes=" + std::to_string(config_.record_bytes));
  }
  if (src == nullptr && bytes > 0) throw InvalidArgument(where("write") + "src is null");
  if (version < 1) {
    throw InvalidArgument(where("write") + "key " + std::to_string(key) + ": Invalid version=0: must be >= 1");
  }
  std::unique_lock lock(mutex_);
  check_open("write");
  const auto existing = keys_.find(key);
  if (existing != keys_.end()) {
    const KeyState& k = existing->second;
    const int live = live_slot(k);
    const std::uint64_t live_version = live >= 0 ? k.slots[live].version : 0;
    const bool pending = k.writes_submitted > k.writes_done;
    if (version <= live_version || (pending && version <= k.last_submitted_version)) {
      throw InvalidArgument(where("write") + "key " + std::to_string(key) + ": Invalid version=" +
                            std::to_string(version) + ": must exceed the live version " + std::to_string(live_version) +
                            (pending ? " and the queued version " + std::to_string(k.last_submitted_version) : ""));
    }
  }
  KeyState& k = keys_[key];
  k.writes_submitted += 1;
  k.last_submitted_version = version;
  auto request = std::make_shared<Request>();
  request->key = key;
  request->version = version;
  Job job;
  job.is_write = true;
  job.key = key;
  job.write_seq = k.writes_submitted;
  job.version = version;
  job.src = src;
  job.bytes = bytes;
  job.request = request;
  queue_.push_back(std::move(job));
  const Ticket ticket = next_ticket_++;
  tickets_.emplace(ticket, std::move(request));
  lock.unlock();
  work_.notify_one();
  return ticket;
}

void Pager::wait(Ticket ticket, std::chrono::nanoseconds timeout) {
  const auto started = Clock::now();
  const auto deadline = deadline_after(timeout);
  std::unique_lock lock(mutex_);
  const auto it = tickets_.find(ticket);
  if (it == tickets_.end()) {
    throw InvalidArgument(where("wait") + "ticket " + std::to_string(ticket) +
                          " is unknown or was already waited for (a finished ticket is forgotten)");
  }
  const std::shared_ptr<Request> request = it->second;
  if (!changed_.wait_until(lock, deadline, [&] { return request->done; })) {
    throw TimeoutError(where("wait") + "write of key " + std::to_string(request->key) + " version " +
                       std::to_string(request->version) + " (ticket " + std::to_string(ticket) +
                       ") did not finish within " + format_seconds(seconds_since(started)) + "; " +
                       std::to_string(queue_.size()) + " request(s) queued, " + std::to_string(in_flight_) +
                       " in flight");
  }
  tickets_.erase(ticket);
  if (request->error) std::rethrow_exception(request->error);
}

void Pager::read_ahead(const std::vector<std::uint64_t>& keys) {
  std::unique_lock lock(mutex_);
  check_open("read_ahead");
  for (const std::uint64_t key : keys) {
    if (keys_.find(key) == keys_.end()) {
      throw NotFound(where("read_ahead") + "key " + std::to_string(key) +
                     " was never written; nothing of this call was scheduled");
    }
  }
  for (const std::uint64_t key : keys) schedule_.push_back({key, keys_[key].writes_submitted, next_order_++});
  dispatch_locked();
  lock.unlock();
  work_.notify_all();
}

void Pager::dispatch_locked() {
  if (stopping_) return;
  std::size_t next_free = 0;
  while (!schedule_.empty()) {
    while (next_free < buffers_.size() && buffers_[next_free].state != BufferState::kFree) ++next_free;
    if (next_free == buffers_.size()) return;
    const ScheduleEntry entry = schedule_.front();
    schedule_.pop_front();
    Buffer& b = buffers_[next_free];
    b.state = BufferState::kLoading;
    b.key = entry.key;
    b.order = entry.order;
    b.result = {};
    b.error = nullptr;
    Job job;
    job.key = entry.key;
    job.write_seq = entry.after_writes;
    job.buffer = static_cast<long>(next_free);
    queue_.push_back(std::move(job));
  }
}

Acquired Pager::acquire(std::uint64_t key, std::chrono::nanoseconds timeout) {
  const auto started = Clock::now();
  const auto deadline = deadline_after(timeout);
  std::unique_lock lock(mutex_);
  check_open("acquire");
  if (keys_.find(key) == keys_.end()) {
    throw NotFound(where("acquire") + "key " + std::to_string(key) + " was never written");
  }
  bool first = true;
  for (;;) {
    check_open("acquire");
    long best = -1;
    for (std::size_t i = 0; i < buffers_.size(); ++i) {
      const Buffer& b = buffers_[i];
      const bool loaded = b.state == BufferState::kLoading || b.state == BufferState::kReady ||
                          b.state == BufferState::kFailed;
      if (loaded && b.key == key && (best < 0 || b.order < buffers_[best].order)) best = static_cast<long>(i);
    }
    const auto is_key = [&](const ScheduleEntry& e) { return e.key == key; };
    const auto queued = std::find_if(schedule_.begin(), schedule_.end(), is_key);
    const bool queued_first = queued != schedule_.end() && (best < 0 || queued->order < buffers_[best].order);
    if (best >= 0 && !queued_first) {
      Buffer& b = buffers_[best];
      if (b.state == BufferState::kReady) {
        b.state = BufferState::kHeld;
        if (first) stats_.read_ahead_hits += 1;
        else stats_.read_ahead_misses += 1;
        stats_.acquire_wait_seconds += seconds_since(started);
        return {static_cast<std::size_t>(best), b.result.version, b.result.bytes};
      }
      if (b.state == BufferState::kFailed) {
        const std::exception_ptr error = b.error;
        b.state = BufferState::kFree;
        b.error = nullptr;
        stats_.read_ahead_misses += 1;
        stats_.acquire_wait_seconds += seconds_since(started);
        dispatch_locked();
        lock.unlock();
        work_.notify_all();
        std::rethrow_exception(error);
      }
    } else if (best < 0 && queued == schedule_.end()) {
      // Not scheduled: read it next.
      schedule_.push_front({key, keys_[key].writes_submitted, next_order_++});
      dispatch_locked();
      work_.notify_all();
    }
    first = false;
    if (changed_.wait_until(lock, deadline) == std::cv_status::timeout) {
      std::size_t counts[6] = {};
      for (const Buffer& b : buffers_) counts[static_cast<int>(b.state)] += 1;
      std::string state;
      if (best >= 0 && !queued_first) {
        state = "its read into buffer " + std::to_string(best) + " is still in flight";
      } else {
        const auto position =
            std::distance(schedule_.begin(), std::find_if(schedule_.begin(), schedule_.end(), is_key));
        state = "it is at position " + std::to_string(position) + " of the schedule, waiting for a free buffer (" +
                std::to_string(counts[static_cast<int>(BufferState::kReady)]) + " loaded but not acquired, " +
                std::to_string(counts[static_cast<int>(BufferState::kHeld)]) +
                " held by the caller: acquire the keys scheduled before it and release() their buffers)";
      }
      throw TimeoutError(where("acquire") + "key " + std::to_string(key) + " was not ready within " +
                         format_seconds(seconds_since(started)) + ": " + state + "; " +
                         std::to_string(buffers_.size()) + " buffers: " +
                         std::to_string(counts[static_cast<int>(BufferState::kFree)]) + " free, " +
                         std::to_string(counts[static_cast<int>(BufferState::kLoading)]) + " loading");
    }
  }
}

void Pager::release(std::size_t index) {
  {
    std::lock_guard lock(mutex_);
    if (index >= buffers_.size() || buffers_[index].state != BufferState::kHeld) {
      throw InvalidArgument(where("release") + "Invalid index=" + std::to_string(index) + ":" +
                            (index >= buffers_.size()
                                 ? " is out of range [0, " + std::to_string(buffers_.size()) + ")"
                                 : " is not held (acquire() hands buffers out)"));
    }
    buffers_[index].state = BufferState::kFree;
    dispatch_locked();
  }
  work_.notify_all();
  changed_.notify_all();
}

void Pager::cancel_read_ahead() {
  {
    std::lock_guard lock(mutex_);
    stats_.cancelled += schedule_.size();
    schedule_.clear();
    // Loads not started yet leave the queue; loads in flight are dropped when they finish.
    std::erase_if(queue_, [&](const Job& job) {
      if (job.buffer < 0) return false;
      buffers_[job.buffer].state = BufferState::kFree;
      stats_.cancelled += 1;
      return true;
    });
    for (Buffer& b : buffers_) {
      if (b.state == BufferState::kReady || b.state == BufferState::kFailed) b.state = BufferState::kFree;
      else if (b.state == BufferState::kLoading) b.state = BufferState::kDropped;
      b.error = nullptr;
    }
  }
  changed_.notify_all();
}

ReadResult Pager::read(std::uint64_t key, std::byte* dst, std::size_t dst_bytes, std::chrono::nanoseconds timeout) {
  if (dst == nullptr) throw InvalidArgument(where("read") + "dst is null");
  const auto started = Clock::now();
  const auto deadline = deadline_after(timeout);
  std::unique_lock lock(mutex_);
  check_open("read");
  const auto it = keys_.find(key);
  if (it == keys_.end()) throw NotFound(where("read") + "key " + std::to_string(key) + " was never written");
  auto request = std::make_shared<Request>();
  request->key = key;
  Job job;
  job.key = key;
  job.write_seq = it->second.writes_submitted;
  job.dst = dst;
  job.dst_bytes = dst_bytes;
  job.request = request;
  queue_.push_back(std::move(job));
  work_.notify_one();
  if (!changed_.wait_until(lock, deadline, [&] { return request->done; })) {
    const auto queued = std::find_if(queue_.begin(), queue_.end(), [&](const Job& j) { return j.request == request; });
    const bool still_queued = queued != queue_.end();
    if (still_queued) {
      queue_.erase(queued);
    } else {
      // In flight: make sure the I/O thread does not copy into dst after we return.
      lock.unlock();
      std::lock_guard copy(request->copy_mutex);
      request->abandoned = true;
    }
    throw TimeoutError(where("read") + "key " + std::to_string(key) + " was not read within " +
                       format_seconds(seconds_since(started)) + " (" + (still_queued ? "still queued" : "in flight") +
                       ")");
  }
  if (request->error) std::rethrow_exception(request->error);
  return request->result;
}

void Pager::drain(std::chrono::nanoseconds timeout) {
  const auto started = Clock::now();
  std::unique_lock lock(mutex_);
  if (!changed_.wait_until(lock, deadline_after(timeout), [&] { return queue_.empty() && in_flight_ == 0; })) {
    throw TimeoutError(where("drain") + "requests still pending after " + format_seconds(seconds_since(started)) +
                       ": " + std::to_string(queue_.size()) + " queued, " + std::to_string(in_flight_) + " in flight");
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
  // What a failed write leaves readable: the key's first write has nothing before it.
  const std::string kept = job.create ? "; the key has no earlier version to read instead"
                                      : "; the previous version stays live";
  int flags = O_WRONLY | O_CLOEXEC | (mode_ == IoMode::kDirect ? O_DIRECT : 0);
  if (job.create) flags |= O_CREAT | (config_.keep_files ? 0 : O_EXCL);
  const int fd = ::open(path.c_str(), flags, 0600);
  if (fd < 0) {
    const int e = errno;
    const std::string cause = e == ENOENT ? "page file is missing (was it removed?)" : "cannot open page file";
    throw PagerIOError(where("write") + cause + " " + path + " to write " + std::to_string(slot_bytes_) +
                           " bytes at offset " + std::to_string(offset) + what + ": " + errno_text(e),
                       path, offset, slot_bytes_, e);
  }
  if (job.create) job.file_created = true;
  FdGuard guard{fd};
  std::size_t done = 0;
  while (done < slot_bytes_) {
    const ssize_t n = ::pwrite(fd, bounce + done, slot_bytes_ - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int e = n < 0 ? errno : EIO;
      throw PagerIOError(where("write") + "pwrite of " + std::to_string(slot_bytes_) + " bytes at offset " +
                             std::to_string(offset) + " of " + path + " failed after " + std::to_string(done) +
                             " bytes" + what + ": " + errno_text(e) + kept,
                         path, offset, slot_bytes_, e);
    }
    done += static_cast<std::size_t>(n);
  }
  if (mode_ == IoMode::kBuffered && ::fdatasync(fd) != 0) {
    const int e = errno;
    throw PagerIOError(where("write") + "fdatasync after writing " + std::to_string(slot_bytes_) + " bytes at offset " +
                           std::to_string(offset) + " of " + path + " failed" + what + ": " + errno_text(e) + kept,
                       path, offset, slot_bytes_, e);
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
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (mode_ == IoMode::kDirect ? O_DIRECT : 0));
  if (fd < 0) {
    const int e = errno;
    const std::string cause = e == ENOENT ? "page file is missing (was it removed?)" : "cannot open page file";
    throw PagerIOError(where("read") + cause + " " + path + " to read " + std::to_string(slot_bytes_) +
                           " bytes at offset " + std::to_string(offset) + what + ": " + errno_text(e),
                       path, offset, slot_bytes_, e);
  }
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

void Pager::close() {
  std::lock_guard serial(close_mutex_);
  {
    std::lock_guard lock(mutex_);
    if (closed_) return;
    stopping_ = true;
    for (Job& job : queue_) {
      stats_.cancelled += 1;
      if (job.request) {
        job.request->error = std::make_exception_ptr(
            CancelledError(where("close") + (job.is_write ? "write of key " : "read of key ") +
                           std::to_string(job.key) + " was cancelled: the pager closed before it ran"));
        job.request->done = true;
      }
      if (job.buffer >= 0) buffers_[job.buffer].state = BufferState::kFree;
    }
    queue_.clear();
    stats_.cancelled += schedule_.size();
    schedule_.clear();
  }
  work_.notify_all();
  changed_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
  {
    std::lock_guard lock(mutex_);
    closed_ = true;
  }
  if (!config_.keep_files) remove_files();
  if (lock_fd_ >= 0) ::close(lock_fd_);
  lock_fd_ = -1;
  if (!config_.keep_files && created_directory_) ::rmdir(config_.directory.c_str());
}

void Pager::remove_files() {
  std::vector<std::string> paths;
  {
    std::lock_guard lock(mutex_);
    for (const auto& [key, state] : keys_) {
      if (state.created_here) paths.push_back(path_of(key));
    }
  }
  for (const std::string& path : paths) ::unlink(path.c_str());
  ::unlink((config_.directory + "/" + kLockName).c_str());
}

bool Pager::closed() const {
  std::lock_guard lock(mutex_);
  return stopping_;
}

std::optional<std::uint64_t> Pager::version(std::uint64_t key) const {
  std::lock_guard lock(mutex_);
  const auto it = keys_.find(key);
  if (it == keys_.end()) return std::nullopt;
  const int live = live_slot(it->second);
  if (live < 0) return std::nullopt;
  return it->second.slots[live].version;
}

std::vector<std::uint64_t> Pager::keys() const {
  std::lock_guard lock(mutex_);
  std::vector<std::uint64_t> out;
  out.reserve(keys_.size());
  for (const auto& entry : keys_) out.push_back(entry.first);
  std::sort(out.begin(), out.end());
  return out;
}

PagerStats Pager::stats() const {
  std::lock_guard lock(mutex_);
  PagerStats s = stats_;
  s.keys = keys_.size();
  s.queued = queue_.size() + in_flight_ + schedule_.size();
  return s;
}

}  // namespace asteria::store
