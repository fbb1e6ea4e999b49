// What the pager's source files share (internal: not part of the store's interface): aligned buffers
// for O_DIRECT, errno's text, a file descriptor closed on scope exit, and the page files' names.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
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

// A directory's lock file, flocked by this process or not.
struct FileLock {
  int fd = -1;           // the held lock's descriptor (-1: not held)
  bool created = false;  // this call made the file
  bool busy = false;     // another holder has it (flock's EWOULDBLOCK)
  int error = 0;         // errno of the open or flock that failed
};

// Opens `path` (creating it where absent) and flocks it without blocking. A holder that lets go removes the file
// while it still holds the lock, so a lock taken on a file opened just before that removal would be on a file no
// longer at `path`, beside a newer holder's: each lock taken is checked against the file `path` names then, and
// taken again where they differ. `after_open` runs between the open and the flock (tests replace the file there).
FileLock lock_file(const std::string& path, const std::function<void()>& after_open = {});

// "page-<16 hex>.astp", the file of `key`.
std::string page_file_name(std::uint64_t key);
// Parses "page-<16 hex>.astp"; returns false for any other name.
bool parse_page_file_name(const char* name, std::uint64_t* key);

}  // namespace asteria::store::detail
