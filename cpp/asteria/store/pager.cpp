#include "asteria/store/pager.h"

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
#include "asteria/store/pager_files.h"

namespace asteria::store {

namespace {

using detail::AlignedBuffer;
using detail::aligned_buffer;
using detail::errno_text;
using detail::FdGuard;
using detail::page_file_name;

constexpr const char* kLockName = ".astp.lock";
constexpr std::size_t kMaxRecordBytes = std::size_t{1} << 40;
constexpr int kMaxIoThreads = 64;

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
  const std::string lock_path = config_.directory + "/" + kLockName;
  bool created_lock = false, locked = false;  // (a refused construction removes the lock file it made)
  try {
    const detail::FileLock lock = detail::lock_file(lock_path);
    if (lock.busy) {
      throw InvalidArgument(where("Pager") + "directory=" + config_.directory +
                            " is in use by another pager (lock file " + lock_path + ": " + errno_text(lock.error) +
                            ")");
    }
    if (lock.fd < 0) {
      throw PagerIOError(where("Pager") + "cannot lock lock file " + lock_path + ": " + errno_text(lock.error),
                         lock_path, 0, 0, lock.error);
    }
    lock_fd_ = lock.fd;
    created_lock = lock.created;
    locked = true;
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
      threads_.emplace_back([this, bounce = std::shared_ptr<std::byte>(bounces[i].release(), detail::FreeDeleter{})] {
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
    // The lock file goes as close() would take it (and where this call made it), only while this pager holds it.
    if (locked && (created_lock || !config_.keep_files || created_directory_)) ::unlink(lock_path.c_str());
    if (lock_fd_ >= 0) ::close(lock_fd_);
    lock_fd_ = -1;
    if (created_directory_) ::rmdir(config_.directory.c_str());
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
