// On-disk format of one NVMe pager page: a 64-byte header, the payload right after it, zero padding
// up to the slot size (a multiple of 4096). This is the parser of bytes read back from disk, so it
// trusts nothing: every field is range-checked and both header and payload carry a CRC32C.
//
// Header layout (little-endian, 64 bytes):
//    0 u32 magic            "ASTP" (0x50545341)
//    4 u16 format_version   kPageFormatVersion
//    6 u16 header_bytes     64
//    8 u64 key              block id
//   16 u64 version          record version (>= 1)
//   24 u64 payload_bytes    <= slot_bytes - 64
//   32 u64 slot_bytes       size of the slot the page was written for: a multiple of 4096
//   40 u32 payload_crc      CRC32C of the payload_bytes payload bytes
//   44 u32 flags            0 (no flag is defined; any other value is refused)
//   48 u8[12] reserved      0
//   60 u32 header_crc       CRC32C of bytes 0..59
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace asteria::store {

inline constexpr std::uint32_t kPageMagic = 0x50545341u;  // "ASTP" read as little-endian bytes
inline constexpr std::uint16_t kPageFormatVersion = 1;
inline constexpr std::size_t kPageHeaderBytes = 64;
inline constexpr std::size_t kPageAlignment = 4096;

// CRC32C (Castagnoli, reflected polynomial 0x82F63B78) of `data`, continuing from `crc` (0 to start).
// Uses the SSE4.2 crc32 instruction when the CPU has it, a slice-by-8 table otherwise.
std::uint32_t crc32c(std::span<const std::byte> data, std::uint32_t crc = 0) noexcept;
// The table-only implementation, exposed so that tests can check both paths agree.
std::uint32_t crc32c_portable(std::span<const std::byte> data, std::uint32_t crc = 0) noexcept;

struct PageHeader {
  std::uint64_t key = 0;
  std::uint64_t version = 0;
  std::uint64_t payload_bytes = 0;
  std::uint64_t slot_bytes = 0;
  std::uint32_t payload_crc = 0;
};

enum class HeaderStatus {
  kOk,
  kTooShort,            // fewer than 64 bytes
  kBadMagic,            // not a pager page (or zeroes: a slot never written)
  kUnsupportedVersion,  // written by another format version
  kBadHeaderSize,
  kHeaderChecksum,      // header CRC mismatch
  kBadFlags,            // unknown flags or non-zero reserved bytes
  kBadSlotSize,         // slot_bytes zero, unaligned or too small for the header
  kBadPayloadSize,      // payload does not fit the slot
  kBadVersion,          // version 0
};

const char* to_string(HeaderStatus status) noexcept;

// `x` rounded up to a multiple of kPageAlignment.
std::size_t round_up_to_page(std::size_t x) noexcept;
// Slot size that holds a payload of up to `record_bytes`: round_up_to_page(64 + record_bytes).
std::size_t slot_bytes_for(std::size_t record_bytes) noexcept;

// Writes the 64-byte header for `header` (payload_crc as given) into out[0..63].
// Requires out.size() >= kPageHeaderBytes (else returns false and writes nothing).
bool encode_page_header(const PageHeader& header, std::span<std::byte> out) noexcept;

// Parses and validates the header at in[0..63]; on kOk fills `*out`. Never reads past in.size().
HeaderStatus parse_page_header(std::span<const std::byte> in, PageHeader* out) noexcept;

// Builds a full page in `page` (size == slot_bytes_for(payload.size()) or larger, a multiple of 4096):
// header, payload, zero padding up to page.size(). Returns false if it does not fit.
bool encode_page(std::uint64_t key, std::uint64_t version, std::span<const std::byte> payload,
                 std::span<std::byte> page) noexcept;

enum class PageStatus {
  kOk,
  kHeader,           // the header failed (see header_status)
  kKeyMismatch,      // a valid page of another key
  kVersionMismatch,  // a valid page of another version than expected
  kSlotMismatch,     // written for another slot size (another record_bytes)
  kPayloadChecksum,  // payload CRC mismatch
};

struct PageCheck {
  PageStatus status = PageStatus::kOk;
  HeaderStatus header_status = HeaderStatus::kOk;
  PageHeader header;
  // What failed, in words, e.g. "payload CRC32C 0x1234abcd != header's 0x0badf00d".
  std::string detail;
};

// Validates a whole page read from a slot: its header, that it belongs to `key`, that its slot size is
// page.size(), its payload checksum, and (when expected_version != 0) its version.
PageCheck check_page(std::span<const std::byte> page, std::uint64_t key, std::uint64_t expected_version);

}  // namespace asteria::store
