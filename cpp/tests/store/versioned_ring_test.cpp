#include "asteria/store/versioned_ring.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <future>
#include <latch>
#include <vector>

#include "asteria/common/errors.h"

namespace asteria::store {
namespace {

using std::chrono::milliseconds;
using std::chrono::nanoseconds;
using std::chrono::seconds;
using ::testing::IsSubstring;

constexpr auto kLongWait = seconds(30);  // only hit if the code under test hangs

// `depth` buffers of `elements` int64 values each, packed with no gap.
struct Buffers {
  Buffers(int depth, std::size_t elements) : elements(elements), data(static_cast<std::size_t>(depth) * elements) {}
  std::byte* base() { return reinterpret_cast<std::byte*>(data.data()); }
  std::size_t bytes() const { return elements * sizeof(std::int64_t); }
  std::size_t elements;
  std::vector<std::int64_t> data;
};

void fill(std::byte* buffer, std::size_t elements, std::int64_t value) {
  std::fill_n(reinterpret_cast<std::int64_t*>(buffer), elements, value);
}

TEST(VersionedRingTest, VersionsLiveInBufferVersionModuloDepth) {
  Buffers memory(3, 4);
  VersionedRing ring(memory.base(), memory.bytes(), memory.bytes(), 3, "block 0 results");
  EXPECT_EQ(ring.depth(), 3);
  EXPECT_EQ(ring.buffer_bytes(), memory.bytes());
  EXPECT_EQ(ring.name(), "block 0 results");
  EXPECT_EQ(ring.latest_published(), 0);

  for (std::int64_t v = 1; v <= 3; ++v) {
    bool waited = true;
    std::byte* buffer = ring.begin_write(v, nanoseconds(0), &waited);
    EXPECT_FALSE(waited);  // a free buffer is handed over at once
    EXPECT_EQ(buffer, memory.base() + (v % 3) * memory.bytes());
    EXPECT_EQ(ring.state(v), SlotState::kWriting);
    fill(buffer, memory.elements, v);
    ring.publish(v);
    EXPECT_EQ(ring.state(v), SlotState::kPublished);
  }
  EXPECT_EQ(ring.latest_published(), 3);
  const auto* read = reinterpret_cast<const std::int64_t*>(ring.acquire(2));
  EXPECT_EQ(read, memory.data.data() + 2 * memory.elements);
  EXPECT_EQ(read[3], 2);
  ring.release(2);

  // Version 4 takes version 1's buffer once version 1 is retired.
  EXPECT_EQ(ring.state(4), SlotState::kEmpty);
  ring.retire_through(1);
  EXPECT_EQ(ring.begin_write(4, nanoseconds(0)), memory.base() + memory.bytes());
  EXPECT_EQ(ring.state(1), SlotState::kEmpty);
  EXPECT_EQ(ring.state(4), SlotState::kWriting);
}

TEST(VersionedRingTest, ConcurrentReadersNeverSeeATornBuffer) {
  constexpr std::int64_t kVersions = 2000;
  constexpr int kReaders = 3;
  constexpr int kDepth = 3;
  Buffers memory(kDepth, 64);
  VersionedRing ring(memory.base(), memory.bytes(), memory.bytes(), kDepth, "block 1 results");
  std::atomic<bool> writer_done{false};
  std::latch start(kReaders + 1);

  // Reads the newest version. It may be retired and overwritten between latest_published() and
  // acquire(); acquire() then refuses it and the reader tries again.
  const auto read_latest = [&ring, &memory](std::int64_t& torn) {
    const std::int64_t version = ring.latest_published();
    if (version == 0) return false;
    const std::int64_t* values = nullptr;
    try {
      values = reinterpret_cast<const std::int64_t*>(ring.acquire(version));
    } catch (const InvalidArgument&) {
      return false;
    }
    torn += std::count_if(values, values + memory.elements, [version](std::int64_t x) { return x != version; });
    ring.release(version);
    return true;
  };

  std::vector<std::future<std::pair<std::int64_t, std::int64_t>>> readers;  // (reads, torn values)
  for (int r = 0; r < kReaders; ++r) {
    readers.push_back(std::async(std::launch::async, [&] {
      std::int64_t reads = 0;
      std::int64_t torn = 0;
      start.arrive_and_wait();
      while (!writer_done.load()) reads += read_latest(torn) ? 1 : 0;
      // The newest version is never retired, so this read always succeeds.
      reads += read_latest(torn) ? 1 : 0;
      return std::pair{reads, torn};
    }));
  }
  start.arrive_and_wait();
  for (std::int64_t v = 1; v <= kVersions; ++v) {
    fill(ring.begin_write(v, kLongWait), memory.elements, v);
    ring.publish(v);
    ring.retire_through(v - 1);
  }
  writer_done = true;
  for (auto& reader : readers) {
    const auto [reads, torn] = reader.get();
    EXPECT_GE(reads, 1);
    EXPECT_EQ(torn, 0);
  }
  EXPECT_EQ(ring.latest_published(), kVersions);
}

TEST(VersionedRingTest, BeginWriteWaitsForTheReaderAndTheRetirement) {
  Buffers memory(1, 8);
  VersionedRing ring(memory.base(), memory.bytes(), memory.bytes(), 1, "block 2 snapshots");
  fill(ring.begin_write(1, nanoseconds(0)), memory.elements, 1);
  ring.publish(1);
  ring.acquire(1);

  std::atomic<bool> released{false};
  std::atomic<bool> retired{false};
  std::latch writer_started(1);
  auto writer = std::async(std::launch::async, [&] {
    writer_started.count_down();
    std::byte* buffer = ring.begin_write(2, kLongWait);
    // Both happened before the buffer was handed over.
    EXPECT_TRUE(released.load());
    EXPECT_TRUE(retired.load());
    fill(buffer, memory.elements, 2);
    ring.publish(2);
  });
  writer_started.wait();
  released = true;
  ring.release(1);
  // Unpinned but not retired: the buffer still belongs to version 1.
  EXPECT_EQ(ring.state(1), SlotState::kPublished);
  EXPECT_EQ(ring.state(2), SlotState::kEmpty);
  retired = true;
  ring.retire_through(1);
  writer.get();
  EXPECT_EQ(ring.state(2), SlotState::kPublished);
  EXPECT_EQ(memory.data[0], 2);
}

TEST(VersionedRingTest, CloseEndsAWaitingWriterAtOnce) {
  Buffers memory(1, 8);
  VersionedRing ring(memory.base(), memory.bytes(), memory.bytes(), 1, "block 4 results");
  fill(ring.begin_write(1, nanoseconds(0)), memory.elements, 1);
  ring.publish(1);
  ring.acquire(1);  // held for good: a step that failed mid-install never releases it
  std::latch writer_started(1);
  auto writer = std::async(std::launch::async, [&] {
    writer_started.count_down();
    ring.begin_write(2, kLongWait);
  });
  writer_started.wait();
  ring.close();  // before or after the writer blocks: either way its wait ends now, not after kLongWait
  try {
    writer.get();
    FAIL() << "begin_write returned after close()";
  } catch (const CancelledError& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "closed while it waited for buffer 0", e.what());
  }
  EXPECT_THROW(ring.begin_write(2, kLongWait), CancelledError);  // and from then on
  ring.close();  // idempotent
}

TEST(VersionedRingTest, BeginWriteTimesOutNamingWhatHoldsTheBuffer) {
  Buffers memory(2, 8);
  VersionedRing ring(memory.base(), memory.bytes(), memory.bytes(), 2, "block 3 results");
  ring.begin_write(1, nanoseconds(0));
  ring.publish(1);
  ring.acquire(1);
  ring.retire_through(1);
  bool waited = false;
  try {
    ring.begin_write(3, milliseconds(50), &waited);
    FAIL() << "begin_write did not time out";
  } catch (const TimeoutError& e) {
    EXPECT_TRUE(waited);
    EXPECT_PRED_FORMAT2(IsSubstring, "[VersionedRing::begin_write] block 3 results: version 3 waited ", e.what());
    EXPECT_PRED_FORMAT2(IsSubstring, " s for buffer 1, held by version 1 (published, 1 reader)", e.what());
  }
  ring.release(1);
  EXPECT_NO_THROW(ring.begin_write(3, nanoseconds(0)));
}

TEST(VersionedRingTest, AFailedVersionFreesItsBufferWithoutRetirement) {
  Buffers memory(2, 8);
  VersionedRing ring(memory.base(), memory.bytes(), memory.bytes(), 2, "block 4 results");
  ring.begin_write(1, nanoseconds(0));
  ring.fail(1);
  EXPECT_EQ(ring.state(1), SlotState::kFailed);
  EXPECT_EQ(ring.latest_published(), 0);
  EXPECT_THROW(ring.acquire(1), InvalidArgument);
  // No reader can hold version 1, and retiring it would retire every older version too.
  EXPECT_NO_THROW(ring.begin_write(3, nanoseconds(0)));
  EXPECT_EQ(ring.state(1), SlotState::kEmpty);
  try {
    ring.begin_write(1, nanoseconds(0));
    FAIL() << "failed version 1 written again over version 3";
  } catch (const InvalidArgument& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "version 1 is older than version 3 in its buffer", e.what());
  }
}

TEST(VersionedRingTest, OutOfOrderWritersClaimABufferInVersionOrder) {
  Buffers memory(2, 8);
  VersionedRing ring(memory.base(), memory.bytes(), memory.bytes(), 2, "block 5 results");
  // Version 2 may start before version 1, but version 3 must not take the buffer version 1 needs.
  ring.begin_write(2, nanoseconds(0));
  EXPECT_THROW(ring.begin_write(3, nanoseconds(0)), TimeoutError);
  ring.begin_write(1, nanoseconds(0));
  ring.publish(1);
  ring.publish(2);
  EXPECT_EQ(ring.latest_published(), 2);
  ring.retire_through(1);
  EXPECT_NO_THROW(ring.begin_write(3, nanoseconds(0)));
}

TEST(VersionedRingTest, RejectsVersionsThatCannotBeWrittenOrRead) {
  Buffers memory(2, 8);
  VersionedRing ring(memory.base(), memory.bytes(), memory.bytes(), 2, "block 6 results");
  EXPECT_THROW(ring.begin_write(0, nanoseconds(0)), InvalidArgument);
  EXPECT_THROW(ring.begin_write(-3, nanoseconds(0)), InvalidArgument);
  EXPECT_THROW(ring.state(0), InvalidArgument);

  ring.begin_write(1, nanoseconds(0));
  try {
    ring.begin_write(1, nanoseconds(0));
    FAIL() << "version 1 written twice";
  } catch (const InvalidArgument& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "block 6 results: version 1 was written before (writing)", e.what());
  }
  EXPECT_THROW(ring.acquire(1), InvalidArgument);  // not yet published
  EXPECT_THROW(ring.publish(2), InvalidArgument);  // not being written
  EXPECT_THROW(ring.fail(2), InvalidArgument);
  ring.publish(1);
  EXPECT_THROW(ring.publish(1), InvalidArgument);
  EXPECT_THROW(ring.fail(1), InvalidArgument);
  EXPECT_THROW(ring.release(1), InvalidArgument);  // not acquired
  EXPECT_THROW(ring.begin_write(1, nanoseconds(0)), InvalidArgument);

  ring.retire_through(4);
  ring.retire_through(2);  // retirement only moves forward
  try {
    ring.begin_write(4, nanoseconds(0));
    FAIL() << "retired version 4 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "version 4 is retired (retired through 4)", e.what());
  }
  EXPECT_NO_THROW(ring.begin_write(5, nanoseconds(0)));
}

TEST(VersionedRingTest, RejectsInvalidConstruction) {
  Buffers memory(2, 8);
  EXPECT_THROW(VersionedRing(nullptr, 8, 8, 2, "null"), InvalidArgument);
  try {
    VersionedRing ring(memory.base(), memory.bytes(), memory.bytes(), 0, "block 7 results");
    FAIL() << "depth=0 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "block 7 results: depth=0 must be >= 1", e.what());
  }
  try {
    VersionedRing ring(memory.base(), 64, 32, 2, "block 8 results");
    FAIL() << "overlapping buffers accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "buffer_bytes=64 exceeds stride_bytes=32", e.what());
  }
  // One buffer never overlaps another, whatever the stride.
  EXPECT_NO_THROW(VersionedRing(memory.base(), 64, 0, 1, "block 9 results"));
}

TEST(VersionedRingTest, ASkippedVersionHandsItsBufferOnInOrder) {
  using namespace std::chrono_literals;
  Buffers memory(1, 8);
  VersionedRing ring(memory.base(), memory.bytes(), memory.bytes(), 1, "one buffer");
  ring.begin_write(1, 1s);
  ring.publish(1);
  ring.skip(2);  // never written: version 3 comes after version 1 in the one buffer
  EXPECT_THROW(ring.begin_write(3, 10ms), TimeoutError);  // version 1 is not retired yet
  ring.retire_through(1);
  EXPECT_NE(ring.begin_write(3, 1s), nullptr);
  ring.publish(3);
  EXPECT_THROW(ring.begin_write(2, 10ms), InvalidArgument);  // skipped
  EXPECT_THROW(ring.skip(3), InvalidArgument);               // written
  ring.retire_through(3);
  EXPECT_THROW(ring.skip(3), InvalidArgument);               // retired
  ring.skip(4);
  ring.skip(5);  // two in a row: version 6 follows version 3
  EXPECT_NE(ring.begin_write(6, 1s), nullptr);
}

TEST(VersionedRingTest, AnAbandonedWriteLeavesTheBufferAsItWas) {
  using namespace std::chrono_literals;
  Buffers memory(2, 4);
  VersionedRing ring(memory.base(), memory.bytes(), memory.bytes(), 2, "two buffers");
  fill(ring.begin_write(1, 1s), memory.elements, 1);
  ring.publish(1);
  ring.retire_through(1);
  ring.begin_write(3, 1s);  // takes version 1's buffer
  EXPECT_EQ(ring.state(1), SlotState::kEmpty);
  ring.abandon_write(3);
  EXPECT_EQ(ring.state(1), SlotState::kPublished);  // back, and its bytes were never touched
  EXPECT_EQ(ring.state(3), SlotState::kEmpty);
  EXPECT_THROW(ring.abandon_write(3), InvalidArgument);  // not being written any more
  EXPECT_THROW(ring.abandon_write(1), InvalidArgument);  // published, not being written
  EXPECT_EQ(memory.data[memory.elements], 1);
  // The version can be claimed again; one abandoned from an empty buffer leaves it empty.
  EXPECT_NE(ring.begin_write(3, 1s), nullptr);
  ring.publish(3);
  ring.begin_write(2, 1s);
  ring.abandon_write(2);
  EXPECT_EQ(ring.state(2), SlotState::kEmpty);
  EXPECT_NE(ring.begin_write(2, 1s), nullptr);
  // A writer of the next version in the buffer, waiting for the abandoned one, keeps waiting (it is neither
  // retired nor failed): abandoning hands the buffer back, not on.
  ring.abandon_write(2);
  EXPECT_THROW(ring.begin_write(4, 10ms), TimeoutError);
}

TEST(VersionedRingTest, NamesSlotStates) {
  EXPECT_STREQ(to_string(SlotState::kEmpty), "empty");
  EXPECT_STREQ(to_string(SlotState::kWriting), "writing");
  EXPECT_STREQ(to_string(SlotState::kPublished), "published");
  EXPECT_STREQ(to_string(SlotState::kFailed), "failed");
}

}  // namespace
}  // namespace asteria::store
