#include "asteria/store/node_store.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "asteria/common/clock.h"
#include "asteria/common/errors.h"

namespace asteria::store {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using ::testing::IsSubstring;

constexpr auto kLongWait = seconds(30);  // only hit if the code under test hangs

// A segment name no other test run uses.
std::string unique_name(const char* what) {
  std::random_device device;
  return "/asteria-test-" + std::string(what) + "-" + std::to_string(::getpid()) + "-" + std::to_string(device());
}

// Creates a segment and unlinks it at the end of the test, whatever happens.
struct Segment {
  Segment(const char* what, int ranks, std::vector<std::int64_t> caps)
      : name(unique_name(what)), capacities(std::move(caps)), store(NodeStore::create(name, ranks, capacities)) {}
  ~Segment() { store->unlink(); }
  std::string name;
  std::vector<std::int64_t> capacities;
  std::unique_ptr<NodeStore> store;
};

void fill(float* slot, std::int64_t n, float value) { std::fill_n(slot, n, value); }

TEST(NodeStoreTest, SecondMappingSeesPublishedVersionsAndData) {
  Segment segment("share", 2, {6, 3});
  auto other = NodeStore::open(segment.name, 2, segment.capacities);
  EXPECT_EQ(other->num_blocks(), 2);
  EXPECT_EQ(other->capacity(0), 6);
  EXPECT_EQ(other->capacity(1), 3);
  EXPECT_EQ(other->published(1).version, 0);
  EXPECT_EQ(other->published(1).good_slot, -1);

  const int slot = segment.store->write_slot(1);
  fill(segment.store->slot(1, slot), 3, 7.5f);
  segment.store->publish(1, 4, VersionStatus::kOk);

  const auto seen = other->wait({1}, {4}, kLongWait);
  ASSERT_EQ(seen.size(), 1U);
  EXPECT_EQ(seen[0].version, 4);
  EXPECT_EQ(seen[0].status, VersionStatus::kOk);
  EXPECT_EQ(seen[0].good_slot, slot);
  const float* data = other->slot(1, seen[0].good_slot);
  EXPECT_TRUE(std::all_of(data, data + 3, [](float x) { return x == 7.5f; }));
  // The same bytes through both mappings, at the same offsets.
  EXPECT_EQ(other->offset(1, slot), segment.store->offset(1, slot));
  EXPECT_EQ(other->stats().waits, 0U);  // published before the wait: no blocking
}

TEST(NodeStoreTest, OkVersionsAlternateSlotsWhileFailedAndSkippedKeepTheGoodData) {
  auto store = NodeStore::private_memory({4});
  EXPECT_EQ(store->name(), "");
  EXPECT_EQ(store->write_slot(0), 0);
  fill(store->slot(0, 0), 4, 1.0f);
  store->publish(0, 1, VersionStatus::kOk);
  EXPECT_EQ(store->published(0).good_slot, 0);
  EXPECT_EQ(store->write_slot(0), 1);

  store->publish(0, 2, VersionStatus::kSkipped);
  EXPECT_EQ(store->published(0).status, VersionStatus::kSkipped);
  EXPECT_EQ(store->published(0).good_slot, 0);
  store->publish(0, 3, VersionStatus::kFailed);
  EXPECT_EQ(store->published(0).good_slot, 0);
  EXPECT_EQ(store->write_slot(0), 1);

  fill(store->slot(0, 1), 4, 2.0f);
  store->publish(0, 5, VersionStatus::kOk);
  EXPECT_EQ(store->published(0).version, 5);
  EXPECT_EQ(store->published(0).good_slot, 1);
  EXPECT_EQ(store->slot(0, 0)[0], 1.0f);  // the previous good data is untouched
  EXPECT_EQ(store->write_slot(0), 0);
  EXPECT_EQ(store->stats().published, 4U);
}

TEST(NodeStoreTest, RejectsBadArguments) {
  auto store = NodeStore::private_memory({4, 4});
  store->publish(0, 2, VersionStatus::kOk);
  EXPECT_THROW(store->publish(0, 2, VersionStatus::kOk), InvalidArgument);   // not newer
  EXPECT_THROW(store->publish(0, 1, VersionStatus::kOk), InvalidArgument);   // older
  EXPECT_THROW(store->publish(0, 3, VersionStatus::kNone), InvalidArgument);
  EXPECT_THROW(store->publish(2, 1, VersionStatus::kOk), InvalidArgument);   // no such block
  EXPECT_THROW(store->published(-1), InvalidArgument);
  EXPECT_THROW(store->slot(0, 2), InvalidArgument);
  EXPECT_THROW(store->wait({0, 1}, {1}, kLongWait), InvalidArgument);
  EXPECT_THROW(store->mark_done(1, 3), InvalidArgument);                     // one local rank only
  EXPECT_THROW(store->register_rank(0, 0), InvalidArgument);
  EXPECT_THROW(NodeStore::private_memory({4, 0}), InvalidArgument);
  // Capacities whose byte counts would overflow (before, 2^62 floats wrapped to a 192-byte store that a write
  // then ran past), and a total beyond the cap.
  try {
    NodeStore::private_memory({4, std::int64_t{1} << 62});
    FAIL() << "a capacity of 2^62 floats accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "Invalid capacities[1]=4611686018427387904: must be >= 1 float and <= 2^40",
                        e.what());
  }
  try {
    NodeStore::private_memory(std::vector<std::int64_t>(1 << 17, std::int64_t{1} << 40));
    FAIL() << "2^57 bytes accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "Invalid capacities: 131072 blocks; a store holds at most 2^20 blocks and 2^56",
                        e.what());
  }
  try {
    store->publish(1, std::int64_t{1} << 54, VersionStatus::kOk);
    FAIL() << "version 2^54 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "and below 2^54", e.what());
  }
  EXPECT_THROW(NodeStore::create("no-slash", 1, {4}), InvalidArgument);
  EXPECT_THROW(NodeStore::create("/a/b", 1, {4}), InvalidArgument);
  EXPECT_THROW(NodeStore::create(unique_name("ranks"), 0, {4}), InvalidArgument);
  try {
    store->publish(1, 0, VersionStatus::kOk);
    FAIL() << "version 0 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "Invalid version=0", e.what());
  }
}

TEST(NodeStoreTest, WriteCopiesIntoTheSlotOverSeveralThreadsAndRejectsBadArguments) {
  // One block of three 1 MiB chunks and a bit, one small block; the guard floats after each copy stay.
  const std::int64_t big = 3 * (1 << 18) + 37, small = 5;
  auto store = NodeStore::private_memory({big + 1, small + 1});
  std::vector<float> source(static_cast<std::size_t>(big));
  for (std::size_t i = 0; i < source.size(); ++i) source[i] = static_cast<float>(i % 1009) + 0.5f;
  for (int threads : {1, 2, 3, 8}) {
    for (int slot : {0, 1}) {
      fill(store->slot(0, slot), big + 1, -1.0f);
      store->write(0, slot, source.data(), big, threads);
      EXPECT_TRUE(std::equal(source.begin(), source.end(), store->slot(0, slot))) << threads << " threads";
      EXPECT_EQ(store->slot(0, slot)[big], -1.0f);
    }
  }
  fill(store->slot(1, 0), small + 1, -1.0f);
  store->write(1, 0, source.data(), small, 4);
  EXPECT_TRUE(std::equal(source.begin(), source.begin() + small, store->slot(1, 0)));
  EXPECT_EQ(store->slot(1, 0)[small], -1.0f);
  store->write(1, 0, nullptr, 0, 1);  // nothing to copy
  EXPECT_THROW(store->write(2, 0, source.data(), 1, 1), InvalidArgument);          // no such block
  EXPECT_THROW(store->write(1, 2, source.data(), 1, 1), InvalidArgument);          // no such slot
  EXPECT_THROW(store->write(1, 0, source.data(), small + 2, 1), InvalidArgument);  // over the capacity
  EXPECT_THROW(store->write(1, 0, source.data(), -1, 1), InvalidArgument);
  EXPECT_THROW(store->write(1, 0, nullptr, 1, 1), InvalidArgument);
  try {
    store->write(1, 0, source.data(), 1, 0);
    FAIL() << "threads=0 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "Invalid threads=0", e.what());
  }
}

TEST(NodeStoreTest, OpenChecksTheNameAndTheLayout) {
  Segment segment("layout", 2, {8, 8});
  EXPECT_THROW(NodeStore::create(segment.name, 2, {8, 8}), Error);  // exists already
  try {
    NodeStore::open(segment.name, 2, {8, 9});
    FAIL() << "a different layout was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "disagree on the blocks", e.what());
  }
  EXPECT_THROW(NodeStore::open(segment.name, 3, {8, 8}), InvalidArgument);
  EXPECT_TRUE(NodeStore::exists(segment.name));
  segment.store->unlink();
  EXPECT_FALSE(NodeStore::exists(segment.name));
  segment.store->unlink();  // idempotent
  try {
    NodeStore::open(segment.name, 2, {8, 8});
    FAIL() << "opened an unlinked segment";
  } catch (const Error& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "has not created it, or has unlinked it", e.what());
  }
  // The mapping outlives the name.
  segment.store->publish(0, 1, VersionStatus::kFailed);
  EXPECT_EQ(segment.store->published(0).version, 1);
}

TEST(NodeStoreTest, WaitTimesOutNamingTheBlockAndVersion) {
  auto store = NodeStore::private_memory({4, 4});
  store->publish(1, 2, VersionStatus::kOk);
  const auto started = Clock::now();
  try {
    store->wait({0, 1}, {0, 3}, milliseconds(50));
    FAIL() << "no timeout";
  } catch (const TimeoutError& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "block 1 version 3 was not published", e.what());
    EXPECT_PRED_FORMAT2(IsSubstring, "holds version 2", e.what());
  }
  EXPECT_GE(seconds_since(started), 0.05);
  EXPECT_EQ(store->stats().waits, 1U);
  EXPECT_GE(store->stats().wait_seconds, 0.05);
  EXPECT_THROW(store->wait_done(1, milliseconds(10)), TimeoutError);
}

TEST(NodeStoreTest, ForkedRankPublishesThroughTheSegmentAndNothingIsLeftAfterUnlink) {
  Segment segment("fork", 2, {16});
  segment.store->register_rank(0, ::getpid());
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    int code = 0;
    try {
      auto mine = NodeStore::open(segment.name, 2, {16});
      mine->register_rank(1, ::getpid());
      for (std::int64_t version = 1; version <= 20; ++version) {
        mine->wait_done(version - 1, seconds(20));  // the parent has read the previous version
        fill(mine->slot(0, mine->write_slot(0)), 16, static_cast<float>(version));
        mine->publish(0, version, VersionStatus::kOk);
        mine->mark_done(1, version);  // the writer reads nothing itself
      }
    } catch (...) {
      code = 1;
    }
    ::_exit(code);
  }
  for (std::int64_t version = 1; version <= 20; ++version) {
    const auto seen = segment.store->wait({0}, {version}, kLongWait);
    ASSERT_EQ(seen[0].version, version);
    const float* data = segment.store->slot(0, seen[0].good_slot);
    EXPECT_TRUE(std::all_of(data, data + 16, [&](float x) { return x == static_cast<float>(version); }));
    segment.store->mark_done(0, version);
  }
  segment.store->wait_done(20, kLongWait);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  segment.store->unlink();
  EXPECT_FALSE(NodeStore::exists(segment.name));
}

TEST(NodeStoreTest, WaitEndsEarlyWhenALocalRankHasExited) {
  Segment segment("exit", 2, {4});
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto mine = NodeStore::open(segment.name, 2, {4});
    mine->register_rank(1, ::getpid());
    mine->mark_done(1, 1);
    ::_exit(0);  // dies without publishing
  }
  // Once the child has marked step 1 done its pid is registered. It is not reaped yet: a zombie,
  // which counts as exited.
  segment.store->mark_done(0, 1);
  segment.store->wait_done(1, kLongWait);
  const auto started = Clock::now();
  try {
    segment.store->wait({0}, {1}, kLongWait);
    FAIL() << "no error";
  } catch (const PeerExited& e) {
    EXPECT_PRED_FORMAT2(IsSubstring, "local rank 1", e.what());
    EXPECT_PRED_FORMAT2(IsSubstring, "has exited", e.what());
  }
  EXPECT_LT(seconds_since(started), 5.0);
  int status = 0;
  ::waitpid(child, &status, 0);
}

TEST(NodeStoreTest, ThreadsOverTwoMappingsSeeEveryVersionWhole) {
  // The multi-process protocol over two mappings of one segment, with threads so that TSan sees the
  // acquire/release pairs: a writer publishes versions with data, a reader checks every one whole.
  constexpr std::int64_t kVersions = 300;
  constexpr std::int64_t kFloats = 257;
  Segment segment("threads", 2, {kFloats, 5});
  auto reader_map = NodeStore::open(segment.name, 2, segment.capacities);
  std::atomic<int> errors{0};
  std::thread writer([&] {
    NodeStore& w = *segment.store;
    for (std::int64_t v = 1; v <= kVersions; ++v) {
      w.wait_done(v - 1, kLongWait);
      if (v % 3 == 0) {
        w.publish(0, v, VersionStatus::kSkipped);
      } else {
        fill(w.slot(0, w.write_slot(0)), kFloats, static_cast<float>(v));
        w.publish(0, v, VersionStatus::kOk);
      }
      w.publish(1, v, VersionStatus::kFailed);
    }
  });
  std::thread reader([&] {
    NodeStore& r = *reader_map;
    float last_good = 0.0f;
    for (std::int64_t v = 1; v <= kVersions; ++v) {
      const auto seen = r.wait({0, 1}, {v, v}, kLongWait);
      if (seen[0].version != v || seen[1].status != VersionStatus::kFailed) errors.fetch_add(1);
      if (seen[0].status == VersionStatus::kOk) last_good = static_cast<float>(v);
      const float* data = r.slot(0, seen[0].good_slot);
      if (!std::all_of(data, data + kFloats, [&](float x) { return x == last_good; })) errors.fetch_add(1);
      r.mark_done(1, v);
    }
  });
  segment.store->mark_done(0, kVersions);  // rank 0 of this node reads nothing here
  writer.join();
  reader.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(reader_map->done(1), kVersions);
}

}  // namespace
}  // namespace asteria::store
