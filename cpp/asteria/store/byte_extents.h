// Byte ranges of caller-owned memory that must stay disjoint: an owner of many rings over memory it is handed
// (the refresh engine's blocks) records each buffer here and refuses one that overlaps a buffer recorded before,
// since two rings over the same bytes would let one block's job write into another block's snapshot or result.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace asteria::store {

class ByteExtents {
 public:
  struct Extent {
    const std::byte* begin;
    std::size_t bytes;
    std::string name;  // for the error message, e.g. "block 3's snapshot buffer 1"
  };
  // Records `extents` (all or nothing). Throws InvalidArgument, naming both, where one of them overlaps an extent
  // recorded before or another of `extents`. Empty extents overlap nothing.
  void add(const std::vector<Extent>& extents);
  std::size_t size() const noexcept { return by_begin_.size(); }

 private:
  // The recorded extent overlapping [begin, begin + bytes), if any (nullptr).
  const Extent* overlap(const std::byte* begin, std::size_t bytes) const;
  std::map<const std::byte*, Extent> by_begin_;  // disjoint, non-empty, keyed by their first byte
};

}  // namespace asteria::store
