#include "asteria/store/byte_extents.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "asteria/common/errors.h"

namespace asteria::store {
namespace {

TEST(ByteExtents, DisjointAndTouchingRangesAreKept) {
  std::vector<std::byte> memory(100);
  const std::byte* base = memory.data();
  ByteExtents extents;
  extents.add({{base + 10, 10, "a"}, {base + 30, 10, "b"}});
  extents.add({{base + 20, 10, "between, touching both"}, {base, 10, "before"}, {base + 40, 0, "empty"}});
  extents.add({{base + 40, 60, "after"}});
  EXPECT_EQ(extents.size(), 5u);  // (the empty one is not kept)
}

TEST(ByteExtents, AnOverlapIsRefusedByNameAndNothingIsRecorded) {
  std::vector<std::byte> memory(100);
  const std::byte* base = memory.data();
  ByteExtents extents;
  extents.add({{base + 10, 10, "block 0's snapshot buffer 0"}, {base + 40, 10, "block 0's result buffer 0"}});
  const auto refused = [&](const std::vector<ByteExtents::Extent>& batch, const std::string& first,
                           const std::string& second) {
    try {
      extents.add(batch);
      ADD_FAILURE() << "expected InvalidArgument for " << first;
    } catch (const InvalidArgument& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("Invalid block memory: " + first), std::string::npos) << message;
      EXPECT_NE(message.find("overlaps " + second), std::string::npos) << message;
    }
  };
  refused({{base + 19, 2, "x"}}, "x", "block 0's snapshot buffer 0");           // its last byte
  refused({{base + 5, 6, "y"}}, "y", "block 0's snapshot buffer 0");            // its first byte
  refused({{base, 100, "z"}}, "z", "block 0's snapshot buffer 0");              // around both
  refused({{base + 42, 2, "w"}}, "w", "block 0's result buffer 0");             // inside
  refused({{base + 60, 10, "p"}, {base + 65, 10, "q"}}, "q", "p");             // two new ones
  EXPECT_EQ(extents.size(), 2u);  // every refused batch left nothing behind
  extents.add({{base + 60, 10, "p"}});  // (p alone was never recorded)
  EXPECT_EQ(extents.size(), 3u);
}

}  // namespace
}  // namespace asteria::store
