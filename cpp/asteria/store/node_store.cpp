#include "asteria/store/node_store.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <new>
#include <system_error>
#include <thread>
#include <vector>

#include "asteria/common/clock.h"

namespace asteria::store {

namespace {

constexpr std::uint64_t kMagic = 0x4153544552494131ULL;  // "ASTERIA1"
constexpr std::size_t kAlign = 64;
constexpr int kMaxLocalRanks = 1 << 16;
// Floats per block slot, blocks and bytes of a whole store: far above any machine's memory, and low enough that
// the layout's sums (two 64-byte-aligned slots a block) cannot overflow size_t.
constexpr std::int64_t kMaxCapacity = std::int64_t{1} << 40;
constexpr std::size_t kMaxStoreBytes = std::size_t{1} << 56;
constexpr std::size_t kMaxBlocks = std::size_t{1} << 20;
// Liveness of local ranks is checked this often while waiting.
constexpr auto kPeerCheckInterval = std::chrono::milliseconds(20);

static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "the version words must be lock-free in shared memory");
static_assert(std::atomic<std::int64_t>::is_always_lock_free, "the rank words must be lock-free in shared memory");

std::size_t round_up(std::size_t value, std::size_t to) { return (value + to - 1) / to * to; }

std::string errno_text(int error) { return std::string(std::strerror(error)) + " (errno " + std::to_string(error) + ")"; }

// The version word: version << 8 | (good_slot + 1) << 2 | status.
std::uint64_t encode(const Published& p) {
  return (static_cast<std::uint64_t>(p.version) << 8) | (static_cast<std::uint64_t>(p.good_slot + 1) << 2) |
         static_cast<std::uint64_t>(p.status);
}

Published decode(std::uint64_t word) {
  Published p;
  p.version = static_cast<std::int64_t>(word >> 8);
  p.good_slot = static_cast<int>((word >> 2) & 3U) - 1;
  p.status = static_cast<VersionStatus>(word & 3U);
  return p;
}

std::uint64_t layout_hash(int local_ranks, const std::vector<std::int64_t>& capacities) {
  std::uint64_t hash = 1469598103934665603ULL;  // FNV-1a over the layout's numbers
  const auto mix = [&hash](std::uint64_t value) {
    for (int i = 0; i < 8; ++i) {
      hash ^= (value >> (8 * i)) & 0xFFU;
      hash *= 1099511628211ULL;
    }
  };
  mix(static_cast<std::uint64_t>(local_ranks));
  mix(capacities.size());
  for (const std::int64_t c : capacities) mix(static_cast<std::uint64_t>(c));
  return hash;
}

// Whether process `pid` has exited (gone, or a zombie not yet reaped by its parent).
bool process_gone(std::int64_t pid) {
  if (::kill(static_cast<pid_t>(pid), 0) == -1 && errno == ESRCH) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!stat || !std::getline(stat, text)) return false;
  const auto paren = text.rfind(')');
  if (paren == std::string::npos || paren + 2 >= text.size()) return false;
  const char state = text[paren + 2];
  return state == 'Z' || state == 'X';
}

// Spins briefly, then sleeps with a growing pause (at most 200 us) between polls.
class Backoff {
 public:
  void pause() {
    if (++rounds_ < 64) {
      std::this_thread::yield();
      return;
    }
    std::this_thread::sleep_for(sleep_);
    sleep_ = std::min(sleep_ * 2, std::chrono::microseconds(200));
  }

 private:
  int rounds_ = 0;
  std::chrono::microseconds sleep_{5};
};

// Spins, with backoff, until ready(i) holds for every i < count in turn. While blocked it checks every
// kPeerCheckInterval that the peers are alive (check(what(i))) and past the deadline calls late(i, seconds),
// which throws. The time spent blocked is handed to record(seconds) once, also when something throws.
template <typename Ready, typename What, typename Late, typename Check, typename Record>
void spin_until(std::size_t count, std::chrono::nanoseconds timeout, Ready ready, What what, Late late, Check check,
                Record record) {
  const auto started = Clock::now();
  const auto deadline = deadline_after(timeout);
  auto next_check = started + kPeerCheckInterval;
  bool blocked = false;
  Backoff backoff;
  try {
    for (std::size_t i = 0; i < count;) {
      if (ready(i)) {
        ++i;
        continue;
      }
      blocked = true;
      const auto now = Clock::now();
      if (now >= deadline) late(i, seconds_since(started));
      if (now >= next_check) {
        check(what(i));
        next_check = now + kPeerCheckInterval;
      }
      backoff.pause();
    }
  } catch (...) {
    if (blocked) record(seconds_since(started));
    throw;
  }
  if (blocked) record(seconds_since(started));
}

}  // namespace

const char* to_string(VersionStatus status) noexcept {
  switch (status) {
    case VersionStatus::kNone: return "none";
    case VersionStatus::kOk: return "ok";
    case VersionStatus::kFailed: return "failed";
    case VersionStatus::kSkipped: return "skipped";
  }
  return "unknown";
}

struct alignas(kAlign) NodeStore::Header {
  std::atomic<std::uint64_t> magic;
  std::uint64_t layout_hash;
  std::int64_t num_blocks;
  std::int64_t local_ranks;
  std::uint64_t bytes;
};

struct alignas(kAlign) NodeStore::RankArea {
  std::atomic<std::int64_t> pid;   // 0: not registered
  std::atomic<std::int64_t> done;  // last step whose due versions this rank has read
};

struct alignas(kAlign) NodeStore::BlockControl {
  std::atomic<std::uint64_t> word;
  std::int64_t offset;    // floats from the data region to slot 0; slot 1 follows at offset + stride
  std::int64_t stride;    // floats between the two slots (capacity rounded up to 64 bytes)
  std::int64_t capacity;  // floats per slot
};

std::size_t NodeStore::layout_bytes(int local_ranks, const std::vector<std::int64_t>& capacities) {
  std::size_t bytes = sizeof(Header) + static_cast<std::size_t>(local_ranks) * sizeof(RankArea) +
                      capacities.size() * sizeof(BlockControl);
  for (const std::int64_t c : capacities) bytes += 2 * round_up(static_cast<std::size_t>(c) * sizeof(float), kAlign);
  return bytes;
}

void NodeStore::check_layout(const std::string& where, int local_ranks, const std::vector<std::int64_t>& capacities) {
  if (local_ranks < 1 || local_ranks > kMaxLocalRanks) {
    throw InvalidArgument(where + "Invalid local_ranks=" + std::to_string(local_ranks) + ": must be in [1, " +
                          std::to_string(kMaxLocalRanks) + "]");
  }
  for (std::size_t i = 0; i < capacities.size(); ++i) {
    if (capacities[i] < 1 || capacities[i] > kMaxCapacity) {
      throw InvalidArgument(where + "Invalid capacities[" + std::to_string(i) + "]=" + std::to_string(capacities[i]) +
                            ": must be >= 1 float and <= 2^40 floats");
    }
  }
  // A block takes under 2^44 bytes, so below 2^20 blocks layout_bytes cannot overflow.
  if (capacities.size() > kMaxBlocks || layout_bytes(local_ranks, capacities) > kMaxStoreBytes) {
    throw InvalidArgument(where + "Invalid capacities: " + std::to_string(capacities.size()) +
                          " blocks; a store holds at most 2^20 blocks and 2^56 bytes");
  }
}

namespace {

void check_name(const std::string& where, const std::string& name) {
  if (name.size() < 2 || name.size() > 250 || name[0] != '/' || name.find('/', 1) != std::string::npos) {
    throw InvalidArgument(where + "Invalid name='" + name +
                          "': must be '/' followed by 1 to 249 characters without another '/'");
  }
}

}  // namespace

NodeStore::NodeStore(std::string name, void* base, std::size_t bytes, int local_ranks, std::int64_t num_blocks,
                     bool shared)
    : name_(std::move(name)),
      base_(base),
      bytes_(bytes),
      local_ranks_(local_ranks),
      num_blocks_(num_blocks),
      shared_(shared),
      unlinked_(!shared) {
  auto* bytes_base = static_cast<std::byte*>(base);
  header_ = reinterpret_cast<Header*>(bytes_base);
  ranks_ = reinterpret_cast<RankArea*>(bytes_base + sizeof(Header));
  blocks_ = reinterpret_cast<BlockControl*>(bytes_base + sizeof(Header) +
                                            static_cast<std::size_t>(local_ranks) * sizeof(RankArea));
  auto* data = reinterpret_cast<std::byte*>(blocks_) + static_cast<std::size_t>(num_blocks) * sizeof(BlockControl);
  data_ = reinterpret_cast<float*>(data);
  data_floats_ = static_cast<std::int64_t>((bytes_base + bytes - data) / static_cast<std::ptrdiff_t>(sizeof(float)));
}

void NodeStore::initialize(const std::vector<std::int64_t>& capacities) {
  // Fresh memory from ftruncate/mmap is zero; the objects are constructed in place all the same.
  auto* header = new (header_) Header{};
  header->layout_hash = layout_hash(local_ranks_, capacities);
  header->num_blocks = num_blocks_;
  header->local_ranks = local_ranks_;
  header->bytes = bytes_;
  for (int r = 0; r < local_ranks_; ++r) {
    auto* area = new (&ranks_[r]) RankArea{};
    area->pid.store(0, std::memory_order_relaxed);
    area->done.store(0, std::memory_order_relaxed);
  }
  std::int64_t offset = 0;
  for (std::int64_t b = 0; b < num_blocks_; ++b) {
    auto* control = new (&blocks_[b]) BlockControl{};
    control->word.store(encode(Published{}), std::memory_order_relaxed);
    control->capacity = capacities[static_cast<std::size_t>(b)];
    control->stride = static_cast<std::int64_t>(
        round_up(static_cast<std::size_t>(control->capacity) * sizeof(float), kAlign) / sizeof(float));
    control->offset = offset;
    offset += 2 * control->stride;
  }
  // Written last: a mapping that sees the magic sees the whole initialized layout.
  header->magic.store(kMagic, std::memory_order_release);
}

std::unique_ptr<NodeStore> NodeStore::create(const std::string& name, int local_ranks,
                                             const std::vector<std::int64_t>& capacities) {
  const std::string where = "[NodeStore::create] ";
  check_name(where, name);
  check_layout(where, local_ranks, capacities);
  const std::size_t bytes = layout_bytes(local_ranks, capacities);
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    const int error = errno;
    throw Error(where + "shm_open('" + name + "') failed: " + errno_text(error) +
                (error == EEXIST ? "; a segment of that name exists already (run ids must be unique)" : ""));
  }
  void* base = MAP_FAILED;
  if (::ftruncate(fd, static_cast<off_t>(bytes)) == 0) {
    base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  const int error = errno;
  ::close(fd);
  if (base == MAP_FAILED) {
    ::shm_unlink(name.c_str());
    throw Error(where + "sizing or mapping '" + name + "' (" + std::to_string(bytes) +
                " bytes) failed: " + errno_text(error));
  }
  std::unique_ptr<NodeStore> store(
      new NodeStore(name, base, bytes, local_ranks, static_cast<std::int64_t>(capacities.size()), true));
  store->initialize(capacities);
  return store;
}

std::unique_ptr<NodeStore> NodeStore::open(const std::string& name, int local_ranks,
                                           const std::vector<std::int64_t>& capacities) {
  const std::string where = "[NodeStore::open] ";
  check_name(where, name);
  check_layout(where, local_ranks, capacities);
  const std::size_t bytes = layout_bytes(local_ranks, capacities);
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) {
    const int error = errno;
    throw Error(where + "shm_open('" + name + "') failed: " + errno_text(error) +
                (error == ENOENT ? "; the node leader has not created it, or has unlinked it already" : ""));
  }
  struct stat info {};
  if (::fstat(fd, &info) != 0 || static_cast<std::size_t>(info.st_size) != bytes) {
    const auto size = static_cast<long long>(info.st_size);
    ::close(fd);
    throw InvalidArgument(where + "segment '" + name + "' has " + std::to_string(size) + " bytes, this layout needs " +
                          std::to_string(bytes) + ": the local ranks disagree on the blocks");
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int error = errno;
  ::close(fd);
  if (base == MAP_FAILED) throw Error(where + "mmap of '" + name + "' failed: " + errno_text(error));
  std::unique_ptr<NodeStore> store(
      new NodeStore(name, base, bytes, local_ranks, static_cast<std::int64_t>(capacities.size()), true));
  store->unlinked_ = false;
  if (store->header_->magic.load(std::memory_order_acquire) != kMagic) {
    throw InvalidArgument(where + "segment '" + name + "' is not initialized (no Asteria magic)");
  }
  if (store->header_->layout_hash != layout_hash(local_ranks, capacities)) {
    throw InvalidArgument(where + "segment '" + name + "' was created for another layout (" +
                          std::to_string(store->header_->local_ranks) + " local ranks, " +
                          std::to_string(store->header_->num_blocks) + " blocks) than this rank's (" +
                          std::to_string(local_ranks) + " local ranks, " + std::to_string(capacities.size()) +
                          " blocks): the local ranks disagree on the blocks");
  }
  return store;
}

std::unique_ptr<NodeStore> NodeStore::private_memory(const std::vector<std::int64_t>& capacities) {
  const std::string where = "[NodeStore::private_memory] ";
  check_layout(where, 1, capacities);
  const std::size_t bytes = layout_bytes(1, capacities);
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) {
    throw Error(where + "mmap of " + std::to_string(bytes) + " bytes failed: " + errno_text(errno));
  }
  std::unique_ptr<NodeStore> store(
      new NodeStore("", base, bytes, 1, static_cast<std::int64_t>(capacities.size()), false));
  store->initialize(capacities);
  return store;
}

NodeStore::~NodeStore() {
  if (base_ != nullptr) ::munmap(base_, bytes_);
}

void NodeStore::unlink() {
  if (!shared_ || unlinked_) return;
  if (::shm_unlink(name_.c_str()) != 0 && errno != ENOENT) {
    throw Error("[NodeStore::unlink] shm_unlink('" + name_ + "') failed: " + errno_text(errno));
  }
  unlinked_ = true;
}

bool NodeStore::exists(const std::string& name) {
  check_name("[NodeStore::exists] ", name);
  const int fd = ::shm_open(name.c_str(), O_RDONLY, 0600);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

NodeStore::BlockControl& NodeStore::control(std::int64_t block, const char* method) const {
  if (block < 0 || block >= num_blocks_) {
    throw InvalidArgument(std::string("[NodeStore::") + method + "] Invalid block=" + std::to_string(block) +
                          ": the store has " + std::to_string(num_blocks_) + " blocks");
  }
  return blocks_[block];
}

NodeStore::RankArea& NodeStore::rank_area(int local_rank, const char* method) const {
  if (local_rank < 0 || local_rank >= local_ranks_) {
    throw InvalidArgument(std::string("[NodeStore::") + method + "] Invalid local_rank=" + std::to_string(local_rank) +
                          ": must be in [0, " + std::to_string(local_ranks_) + ")");
  }
  return ranks_[local_rank];
}

std::int64_t NodeStore::capacity(std::int64_t block) const { return control(block, "capacity").capacity; }

std::int64_t NodeStore::offset(std::int64_t block, int slot) const {
  const BlockControl& c = control(block, "offset");
  if (slot != 0 && slot != 1) {
    throw InvalidArgument("[NodeStore::offset] Invalid slot=" + std::to_string(slot) + ": must be 0 or 1");
  }
  return c.offset + slot * c.stride;
}

float* NodeStore::slot(std::int64_t block, int slot) { return data_ + offset(block, slot); }

void NodeStore::register_rank(int local_rank, std::int64_t pid) {
  if (pid < 1) throw InvalidArgument("[NodeStore::register_rank] Invalid pid=" + std::to_string(pid) + ": must be >= 1");
  rank_area(local_rank, "register_rank").pid.store(pid, std::memory_order_release);
}

Published NodeStore::published(std::int64_t block) const {
  return decode(control(block, "published").word.load(std::memory_order_acquire));
}

int NodeStore::write_slot(std::int64_t block) const {
  const Published p = published(block);
  return p.good_slot == 0 ? 1 : 0;
}

void NodeStore::write(std::int64_t block, int slot, const float* source, std::int64_t count, int threads) {
  const std::int64_t capacity = control(block, "write").capacity;
  float* target = data_ + offset(block, slot);
  if (count < 0 || count > capacity) {
    throw InvalidArgument("[NodeStore::write] Invalid count=" + std::to_string(count) + ": must be in [0, " +
                          std::to_string(capacity) + "], block " + std::to_string(block) + "'s capacity");
  }
  if (threads < 1) {
    throw InvalidArgument("[NodeStore::write] Invalid threads=" + std::to_string(threads) + ": must be >= 1");
  }
  if (count > 0 && source == nullptr) throw InvalidArgument("[NodeStore::write] Invalid source=null");
  // Chunks of whole cache lines, at least 1 MiB each: a thread costs tens of microseconds to start.
  constexpr std::int64_t kLine = 16, kMinChunk = (1 << 20) / sizeof(float);
  const std::int64_t chunk = std::max(kMinChunk, (count / threads + kLine - 1) / kLine * kLine);
  auto copy = [&](std::int64_t begin) {
    const auto floats = static_cast<std::size_t>(std::min(chunk, count - begin));
    std::memcpy(target + begin, source + begin, floats * sizeof(float));
  };
  std::vector<std::thread> helpers;
  std::int64_t begin = chunk;
  for (; begin < count; begin += chunk) {
    try {
      helpers.emplace_back(copy, begin);
    } catch (const std::system_error&) {
      break;  // no thread to be had: the caller copies the rest itself
    }
  }
  for (std::int64_t rest = begin; rest < count; rest += chunk) copy(rest);
  if (count > 0) copy(0);
  for (std::thread& helper : helpers) helper.join();
}

void NodeStore::publish(std::int64_t block, std::int64_t version, VersionStatus status) {
  BlockControl& c = control(block, "publish");
  if (status != VersionStatus::kOk && status != VersionStatus::kFailed && status != VersionStatus::kSkipped) {
    throw InvalidArgument("[NodeStore::publish] Invalid status=" + std::to_string(static_cast<int>(status)) +
                          ": must be ok, failed or skipped");
  }
  const Published now = decode(c.word.load(std::memory_order_acquire));
  if (version <= now.version || version >= (std::int64_t{1} << 54)) {
    throw InvalidArgument("[NodeStore::publish] block " + std::to_string(block) + ": Invalid version=" +
                          std::to_string(version) + ": must be newer than the published version " +
                          std::to_string(now.version) + " (one writer per block, versions in increasing order) "
                          "and below 2^54");
  }
  Published next{version, status, now.good_slot};
  if (status == VersionStatus::kOk) next.good_slot = now.good_slot == 0 ? 1 : 0;
  // Release: the slot's data written before this call is visible to whoever acquires the word.
  c.word.store(encode(next), std::memory_order_release);
  published_.fetch_add(1, std::memory_order_relaxed);
}

void NodeStore::check_peers(const std::string& waiting_for) const {
  const std::int64_t self = ::getpid();
  for (int r = 0; r < local_ranks_; ++r) {
    const std::int64_t pid = ranks_[r].pid.load(std::memory_order_acquire);
    if (pid > 0 && pid != self && process_gone(pid)) {
      throw PeerExited("[NodeStore] local rank " + std::to_string(r) + " (pid " + std::to_string(pid) +
                       ") has exited while this rank waited for " + waiting_for);
    }
  }
}

void NodeStore::record_wait(double seconds) {
  const auto nanos = static_cast<std::int64_t>(seconds * 1e9);
  waits_.fetch_add(1, std::memory_order_relaxed);
  wait_nanos_.fetch_add(nanos, std::memory_order_relaxed);
  std::int64_t max = max_wait_nanos_.load(std::memory_order_relaxed);
  while (nanos > max && !max_wait_nanos_.compare_exchange_weak(max, nanos, std::memory_order_relaxed)) {
  }
}

std::vector<Published> NodeStore::wait(const std::vector<std::int64_t>& blocks,
                                       const std::vector<std::int64_t>& versions, std::chrono::nanoseconds timeout) {
  if (blocks.size() != versions.size()) {
    throw InvalidArgument("[NodeStore::wait] Invalid versions: " + std::to_string(versions.size()) + " for " +
                          std::to_string(blocks.size()) + " blocks");
  }
  for (const std::int64_t b : blocks) control(b, "wait");
  std::vector<Published> out(blocks.size());
  const auto what = [&](std::size_t i) {
    return "block " + std::to_string(blocks[i]) + " version " + std::to_string(versions[i]);
  };
  spin_until(
      blocks.size(), timeout,
      [&](std::size_t i) {
        out[i] = published(blocks[i]);
        return out[i].version >= versions[i];
      },
      what,
      [&](std::size_t i, double seconds) {
        throw TimeoutError("[NodeStore::wait] " + what(i) + " was not published within " + format_seconds(seconds) +
                           " (the store holds version " + std::to_string(out[i].version) +
                           "): the rank that owns it, or the node leader that receives it, is late, stalled or gone");
      },
      [this](const std::string& waiting_for) { check_peers(waiting_for); },
      [this](double seconds) { record_wait(seconds); });
  return out;
}

void NodeStore::mark_done(int local_rank, std::int64_t step) {
  rank_area(local_rank, "mark_done").done.store(step, std::memory_order_release);
}

std::int64_t NodeStore::done(int local_rank) const {
  return rank_area(local_rank, "done").done.load(std::memory_order_acquire);
}

void NodeStore::wait_done(std::int64_t step, std::chrono::nanoseconds timeout) {
  const auto done_by = [this](std::size_t r) { return ranks_[r].done.load(std::memory_order_acquire); };
  const auto what = [&](std::size_t r) {
    return "local rank " + std::to_string(r) + " to finish step " + std::to_string(step);
  };
  spin_until(
      static_cast<std::size_t>(local_ranks_), timeout, [&](std::size_t r) { return done_by(r) >= step; }, what,
      [&](std::size_t r, double seconds) {
        throw TimeoutError("[NodeStore::wait_done] waited " + format_seconds(seconds) + " for " + what(r) +
                           " (it has finished step " + std::to_string(done_by(r)) + "): it is late, stalled or gone");
      },
      [this](const std::string& waiting_for) { check_peers(waiting_for); },
      [this](double seconds) { record_wait(seconds); });
}

NodeStoreStats NodeStore::stats() const {
  NodeStoreStats s;
  s.waits = waits_.load(std::memory_order_relaxed);
  s.wait_seconds = static_cast<double>(wait_nanos_.load(std::memory_order_relaxed)) / 1e9;
  s.max_wait_seconds = static_cast<double>(max_wait_nanos_.load(std::memory_order_relaxed)) / 1e9;
  s.published = published_.load(std::memory_order_relaxed);
  return s;
}

}  // namespace asteria::store
