// NVMe pager: versioned records (key = block id, a version, a payload of up to record_bytes bytes) in
// page files under one directory, read and written off the caller's thread by a small pool of I/O
// threads with aligned O_DIRECT pread/pwrite (buffered I/O + fdatasync where the filesystem refuses
// O_DIRECT), and read ahead in schedule order into a bounded pool of caller-owned buffers.
//
// Files: one file per key, "<directory>/page-<key as 16 hex digits>.astp", holding two slots (A/B) of
// slot_bytes = round_up(64 + record_bytes, 4096) each. A page is a checksummed header + payload (see
// page_format.h).
//
// Atomic publish: a write goes to the slot that does not hold the key's live version, and only once the
// whole page is written (and, in buffered mode, fdatasync has returned) does its version become the one
// reads return. A failed or torn write marks its slot bad and never becomes visible; the previous
// version, in the other slot, stays readable. A page that fails validation on read (checksum, wrong
// key/version) is marked bad too, so later reads fall back to the other slot's version if it is good.
//
// Ordering: writes of one key run one at a time in submission order; a read (read_ahead entry or read())
// waits for every write of its key submitted before it, so it returns the newest version whose write
// succeeded by then. A write waits for reads still in flight on its target slot.
//
// Files rule: with keep_files=false (a scratch spill tier) the directory must not hold page files yet;
// the pager removes every file it created, and the directory if it created it and it is empty, at
// close(). With keep_files=true existing page files are recovered at construction (each key's newest
// page that validates becomes live) and nothing is removed at close. A lock file (".astp.lock", flock)
// keeps two pagers out of one directory.
//
// Errors surface at the caller's next wait()/acquire()/read() for the request concerned, as
// PagerIOError (errno, path, offset, size) or ChecksumError; waits are bounded (TimeoutError).
//
// Thread safety: every public method is safe to call concurrently.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace asteria::store {

enum class IoMode { kDirect, kBuffered };
const char* to_string(IoMode mode) noexcept;  // "o_direct" / "buffered"

enum class IoModeRequest { kAuto, kDirect, kBuffered };

// Whether `directory` accepts O_DIRECT: creates a probe file there, writes and reads one aligned block
// with O_DIRECT and removes it. On false, `why` (if given) says what failed.
bool probe_o_direct(const std::string& directory, std::string* why = nullptr);

struct PagerConfig {
  std::string directory;
  std::size_t record_bytes = 0;  // largest payload; >= 1
  int io_threads = 2;            // 1..64
  IoModeRequest mode = IoModeRequest::kAuto;
  bool keep_files = false;
};

// The caller's read-ahead buffers: `count` buffers of >= record_bytes bytes, buffer i at base + i * stride.
// They must outlive close().
struct BufferPool {
  std::byte* base = nullptr;
  std::size_t count = 0;
  std::size_t stride_bytes = 0;
};

struct PagerStats {
  IoMode mode = IoMode::kDirect;
  int io_threads = 0;
  std::size_t record_bytes = 0;
  std::size_t slot_bytes = 0;
  std::uint64_t keys = 0;
  std::uint64_t reads = 0;          // successful page reads (read-ahead and read())
  std::uint64_t writes = 0;         // successful page writes
  std::uint64_t bytes_read = 0;     // device bytes (whole slots)
  std::uint64_t bytes_written = 0;  // device bytes (whole slots)
  std::uint64_t read_errors = 0;    // I/O errors and checksum failures on read
  std::uint64_t write_errors = 0;
  std::uint64_t checksum_failures = 0;
  std::uint64_t read_ahead_hits = 0;    // acquire() found its buffer ready
  std::uint64_t read_ahead_misses = 0;  // acquire() had to wait
  std::uint64_t cancelled = 0;          // requests cancelled by close() or cancel_read_ahead()
  double read_seconds = 0.0;            // I/O time, summed over threads (open + pread + validation)
  double write_seconds = 0.0;           // (open + pwrite [+ fdatasync])
  double acquire_wait_seconds = 0.0;    // time callers spent blocked in acquire()
  std::uint64_t recovered_keys = 0;     // keep_files: keys with a valid page at construction
  std::uint64_t recovered_bad_pages = 0;
  std::size_t queued = 0;               // requests not yet finished
};

struct Acquired {
  std::size_t index = 0;   // buffer index in the pool
  std::uint64_t version = 0;
  std::size_t bytes = 0;   // payload bytes of that version
};

struct ReadResult {
  std::uint64_t version = 0;
  std::size_t bytes = 0;
};

class Pager {
 public:
  using Ticket = std::uint64_t;

  Pager(PagerConfig config, BufferPool buffers);
  ~Pager();  // close()

  Pager(const Pager&) = delete;
  Pager& operator=(const Pager&) = delete;

  // Queues a write of version `version` of `key` from src[0..bytes) (bytes <= record_bytes). `version`
  // must exceed the key's live version and every version of it still queued (else InvalidArgument).
  // src must stay valid and unchanged until wait(ticket) returns or close().
  Ticket write(std::uint64_t key, std::uint64_t version, const std::byte* src, std::size_t bytes);
  // Waits for a write; rethrows its error. The ticket is forgotten once it has finished (a second wait
  // is an InvalidArgument); on TimeoutError it stays valid.
  void wait(Ticket ticket, std::chrono::nanoseconds timeout);

  // Appends `keys`, in the order they will be needed, to the read-ahead schedule: free buffers are filled
  // in that order in the background. Every key must have been written (or have a write queued), else
  // NotFound and nothing is scheduled.
  void read_ahead(const std::vector<std::uint64_t>& keys);
  // Waits for the earliest scheduled read of `key` and hands its buffer over until release(). A key not
  // in the schedule is scheduled at its front (a miss). Rethrows that read's error (its buffer is freed).
  Acquired acquire(std::uint64_t key, std::chrono::nanoseconds timeout);
  // Returns buffer `index` (held by acquire()) to the read-ahead pool.
  void release(std::size_t index);
  // Drops the schedule and frees every buffer that is loaded but not acquired; loads in flight are
  // dropped when they finish. Buffers held by the caller stay held.
  void cancel_read_ahead();

  // Reads the newest version of `key` into dst[0..dst_bytes) (dst_bytes >= the payload), bypassing the pool.
  ReadResult read(std::uint64_t key, std::byte* dst, std::size_t dst_bytes, std::chrono::nanoseconds timeout);

  // Waits until every queued request has finished (errors stay with their tickets/buffers).
  void drain(std::chrono::nanoseconds timeout);
  // Cancels queued requests (their waiters get CancelledError), waits for the ones in flight, stops
  // the threads and applies the files rule. Idempotent.
  void close();
  bool closed() const;

  // Live (readable) version of `key`, if any.
  std::optional<std::uint64_t> version(std::uint64_t key) const;
  std::vector<std::uint64_t> keys() const;
  std::string path_of(std::uint64_t key) const;
  IoMode mode() const noexcept { return mode_; }
  std::size_t record_bytes() const noexcept { return config_.record_bytes; }
  std::size_t slot_bytes() const noexcept { return slot_bytes_; }
  std::size_t buffer_count() const noexcept { return pool_.count; }
  const std::string& directory() const noexcept { return config_.directory; }
  PagerStats stats() const;

 private:
  enum class SlotState { kEmpty, kGood, kBad, kWriting };
  struct Slot {
    std::uint64_t version = 0;
    SlotState state = SlotState::kEmpty;
    int readers = 0;
    std::string failure;  // why it is bad
  };
  struct KeyState {
    Slot slots[2];
    std::uint64_t writes_submitted = 0;
    std::uint64_t writes_done = 0;
    std::uint64_t last_submitted_version = 0;
    bool file_exists = false;  // created by this pager or recovered
    bool created_here = false;
  };
  struct Request {  // completion of a write or a read(); fields guarded by mutex_ except as noted
    std::uint64_t key = 0;
    std::uint64_t version = 0;
    bool done = false;
    std::exception_ptr error;
    ReadResult result;
    std::mutex copy_mutex;   // read(): held while copying into the caller's dst
    bool abandoned = false;  // read(): the caller timed out; guarded by copy_mutex
  };
  enum class BufferState { kFree, kLoading, kReady, kFailed, kHeld, kDropped };
  struct Buffer {
    BufferState state = BufferState::kFree;
    std::uint64_t key = 0;
    std::uint64_t order = 0;  // schedule order of the read it holds
    ReadResult result;
    std::exception_ptr error;
  };
  struct Job {
    bool is_write = false;
    std::uint64_t key = 0;
    std::uint64_t write_seq = 0;  // write: its per-key sequence; read: writes of the key it waits for
    std::uint64_t version = 0;
    const std::byte* src = nullptr;
    std::size_t bytes = 0;
    std::byte* dst = nullptr;  // read(): caller's memory
    std::size_t dst_bytes = 0;
    long buffer = -1;          // read-ahead: pool buffer index
    std::shared_ptr<Request> request;
    // Set when an I/O thread takes the job.
    int slot = -1;                 // slot written or read
    bool create = false;           // write: the file does not exist yet
    bool had_live = false;         // write: the key had a live version when the write began
    bool file_created = false;     // write: this job created the file
    bool checksum_failed = false;  // read: the page failed validation
    std::exception_ptr failure;
    ReadResult result;
  };
  struct ScheduleEntry {
    std::uint64_t key = 0;
    std::uint64_t after_writes = 0;
    std::uint64_t order = 0;
  };

  void io_loop(std::byte* bounce);  // bounce: this thread's aligned slot-sized buffer
  // Index of the first runnable job in queue_, or -1. Requires mutex_.
  long find_runnable() const;
  void run_write(Job& job, std::byte* bounce);
  void run_read(Job& job, std::byte* bounce);
  // Fills free buffers from the schedule. Requires mutex_.
  void dispatch_locked();
  static int live_slot(const KeyState& k);  // slot index of the live version, -1 if none
  void check_open(const char* method) const;  // requires mutex_
  std::string where(const char* method) const;
  void recover();
  void remove_files();

  PagerConfig config_;
  BufferPool pool_;
  std::size_t slot_bytes_ = 0;
  IoMode mode_ = IoMode::kDirect;
  int lock_fd_ = -1;
  bool created_directory_ = false;

  mutable std::mutex mutex_;
  std::condition_variable work_;     // I/O threads wait for runnable jobs
  std::condition_variable changed_;  // callers wait for completions
  std::unordered_map<std::uint64_t, KeyState> keys_;
  std::deque<Job> queue_;
  std::size_t in_flight_ = 0;
  std::deque<ScheduleEntry> schedule_;
  std::uint64_t next_order_ = 1;
  std::vector<Buffer> buffers_;
  std::unordered_map<Ticket, std::shared_ptr<Request>> tickets_;
  Ticket next_ticket_ = 1;
  bool stopping_ = false;
  bool closed_ = false;
  PagerStats stats_;
  std::vector<std::thread> threads_;
  std::mutex close_mutex_;  // serializes close()
};

}  // namespace asteria::store
