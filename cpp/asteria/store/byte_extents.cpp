#include "asteria/store/byte_extents.h"

#include <cstdio>
#include <iterator>

#include "asteria/common/errors.h"

namespace asteria::store {

namespace {

std::string describe(const ByteExtents::Extent& extent) {
  char range[64];
  std::snprintf(range, sizeof(range), "[%p, +%zu bytes)", static_cast<const void*>(extent.begin), extent.bytes);
  return extent.name + " " + range;
}

}  // namespace

const ByteExtents::Extent* ByteExtents::overlap(const std::byte* begin, std::size_t bytes) const {
  if (bytes == 0 || by_begin_.empty()) return nullptr;
  // The first extent starting at or after `begin`, and the one before it: only these two can overlap, since the
  // recorded extents are disjoint.
  auto next = by_begin_.lower_bound(begin);
  if (next != by_begin_.end() && next->first < begin + bytes) return &next->second;
  if (next != by_begin_.begin()) {
    const Extent& before = std::prev(next)->second;
    if (before.begin + before.bytes > begin) return &before;
  }
  return nullptr;
}

void ByteExtents::add(const std::vector<Extent>& extents) {
  ByteExtents added;  // the new extents among themselves
  for (const Extent& extent : extents) {
    if (extent.bytes == 0) continue;
    const Extent* clash = overlap(extent.begin, extent.bytes);
    if (clash == nullptr) clash = added.overlap(extent.begin, extent.bytes);
    if (clash != nullptr) {
      throw InvalidArgument("Invalid block memory: " + describe(extent) + " overlaps " + describe(*clash) +
                            "; every buffer needs memory of its own");
    }
    added.by_begin_.emplace(extent.begin, extent);
  }
  by_begin_.merge(added.by_begin_);
}

}  // namespace asteria::store
