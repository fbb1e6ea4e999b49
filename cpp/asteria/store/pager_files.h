// What the pager's source files share (internal: not part of the store's interface): aligned buffers
// for O_DIRECT, errno's text, a file descriptor closed on scope exit, and the page files' names.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

namespace asteria::store::detail {

struct FreeDeleter {
  void operator()(std::byte* p) const noexcept { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<std::byte, FreeDeleter>;

// `bytes` rounded up to whole pages, aligned for O_DIRECT; throws std::bad_alloc.
AlignedBuffer aligned_buffer(std::size_t bytes);

// strerror's text with the number, for error messages that name the system's cause.
std::string errno_text(int error_number);

// Closes `fd` on scope exit (errors of close() on a read-only or already-synced fd carry no data).
struct FdGuard {
  int fd = -1;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
};

// "page-<16 hex>.astp", the file of `key`.
std::string page_file_name(std::uint64_t key);
// Parses "page-<16 hex>.astp"; returns false for any other name.
bool parse_page_file_name(const char* name, std::uint64_t* key);

}  // namespace asteria::store::detail
