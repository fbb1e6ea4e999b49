// Exception types of the Asteria core. The bindings map each to one Python exception type
// (cpp/bindings/errors.cpp is the only place that does so).
#pragma once

#include <charconv>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace asteria {

// A number as error messages show it: the shortest text that reads back as the same double ("0.5",
// "1e-12", "nan"), where std::to_string would print 1e-8 as "0.000000".
inline std::string format_number(double value) {
  char buffer[32];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return std::string(buffer, result.ptr);
}

// Base of every error the core throws on purpose.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A caller passed a value outside what is allowed; the message names the argument and the value.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A bounded wait ran out; the message says what was awaited and for how long.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// The bounded wait for one block's version ran out (the activation barrier); says which.
class BlockTimeout : public TimeoutError {
 public:
  BlockTimeout(std::int64_t block, std::int64_t version, const std::string& message)
      : TimeoutError(message), block_(block), version_(version) {}
  std::int64_t block() const noexcept { return block_; }
  std::int64_t version() const noexcept { return version_; }

 private:
  std::int64_t block_;
  std::int64_t version_;
};

// A job was cancelled (the pool shut down before it ran).
class CancelledError : public Error {
 public:
  using Error::Error;
};

// A numerical routine failed or its input/output was not finite.
class NumericalError : public Error {
 public:
  using Error::Error;
};

// A preconditioner block failed more often in a row than the configured bound allows.
class BlockFailure : public Error {
 public:
  BlockFailure(std::int64_t block, std::int64_t version, const std::string& cause);
  std::int64_t block() const noexcept { return block_; }
  std::int64_t version() const noexcept { return version_; }
  const std::string& cause() const noexcept { return cause_; }

 private:
  std::int64_t block_;
  std::int64_t version_;
  std::string cause_;
};

// A key the caller asked for does not exist (never written, or no readable version is left).
class NotFound : public Error {
 public:
  using Error::Error;
};

// An I/O operation of the NVMe pager failed: a system call error (ENOSPC, EFBIG, EIO, ENOENT for a
// removed file, ...) or a short read. The message names the path, offset, size and errno text.
class PagerIOError : public Error {
 public:
  PagerIOError(const std::string& message, std::string path, std::uint64_t offset, std::uint64_t size,
               int error_number);
  const std::string& path() const noexcept { return path_; }
  std::uint64_t offset() const noexcept { return offset_; }
  std::uint64_t size() const noexcept { return size_; }
  // errno of the failed call; EIO for a short read, EBADMSG for a checksum failure.
  int error_number() const noexcept { return errno_; }

 private:
  std::string path_;
  std::uint64_t offset_;
  std::uint64_t size_;
  int errno_;
};

// A page read back from disk failed validation (header or payload CRC32C, wrong key, version or
// slot size): the data on disk is corrupt. Same fields as PagerIOError (errno EBADMSG).
class ChecksumError : public PagerIOError {
 public:
  using PagerIOError::PagerIOError;
};

}  // namespace asteria
