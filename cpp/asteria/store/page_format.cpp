#include "asteria/store/page_format.h"

#include <array>
#include <cstdio>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace asteria::store {

namespace {

constexpr std::uint32_t kCrc32cPolynomial = 0x82F63B78u;  // reflected Castagnoli

using Tables = std::array<std::array<std::uint32_t, 256>, 8>;

constexpr Tables make_tables() {
  Tables t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1u) ? (c >> 1) ^ kCrc32cPolynomial : c >> 1;
    t[0][i] = c;
  }
  for (std::size_t i = 0; i < 256; ++i) {
    for (std::size_t k = 1; k < 8; ++k) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFFu];
  }
  return t;
}

constexpr Tables kTables = make_tables();

// Little-endian loads and stores of `n` bytes, independent of the host's byte order and alignment.
std::uint64_t load(const std::byte* p, int n) noexcept {
  std::uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<std::uint64_t>(p[i]);
  return v;
}
void store(std::byte* p, std::uint64_t v, int n) noexcept {
  for (int i = 0; i < n; ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xFFu);
}

// Field offsets (see page_format.h).
constexpr std::size_t kOffMagic = 0, kOffFormat = 4, kOffHeaderBytes = 6, kOffKey = 8, kOffVersion = 16,
                      kOffPayloadBytes = 24, kOffSlotBytes = 32, kOffPayloadCrc = 40, kOffFlags = 44,
                      kOffReserved = 48, kReservedBytes = 12, kOffHeaderCrc = 60;

std::uint32_t crc32c_table(const std::byte* p, std::size_t n, std::uint32_t crc) noexcept {
  std::uint32_t c = ~crc;
  while (n >= 8) {
    const std::uint64_t word = load(p, 8) ^ c;
    c = kTables[7][word & 0xFF] ^ kTables[6][(word >> 8) & 0xFF] ^ kTables[5][(word >> 16) & 0xFF] ^
        kTables[4][(word >> 24) & 0xFF] ^ kTables[3][(word >> 32) & 0xFF] ^ kTables[2][(word >> 40) & 0xFF] ^
        kTables[1][(word >> 48) & 0xFF] ^ kTables[0][word >> 56];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) c = (c >> 8) ^ kTables[0][(c ^ static_cast<std::uint32_t>(*p++)) & 0xFFu];
  return ~c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) std::uint32_t crc32c_sse42(const std::byte* p, std::size_t n,
                                                             std::uint32_t crc) noexcept {
  std::uint64_t c = ~crc;
  while (n >= 8) {
    std::uint64_t word;
    std::memcpy(&word, p, 8);  // x86 is little-endian, as the CRC's byte order requires
    c = _mm_crc32_u64(c, word);
    p += 8;
    n -= 8;
  }
  auto c32 = static_cast<std::uint32_t>(c);
  while (n-- > 0) c32 = _mm_crc32_u8(c32, static_cast<std::uint8_t>(*p++));
  return ~c32;
}

bool have_sse42() noexcept {
  static const bool have = __builtin_cpu_supports("sse4.2");
  return have;
}
#endif

std::string hex32(std::uint32_t v) {
  char text[16];
  std::snprintf(text, sizeof(text), "0x%08x", v);
  return text;
}

}  // namespace

std::uint32_t crc32c_portable(std::span<const std::byte> data, std::uint32_t crc) noexcept {
  return crc32c_table(data.data(), data.size(), crc);
}

std::uint32_t crc32c(std::span<const std::byte> data, std::uint32_t crc) noexcept {
#if defined(__x86_64__)
  if (have_sse42()) return crc32c_sse42(data.data(), data.size(), crc);
#endif
  return crc32c_table(data.data(), data.size(), crc);
}

const char* to_string(HeaderStatus status) noexcept {
  switch (status) {
    case HeaderStatus::kOk: return "ok";
    case HeaderStatus::kTooShort: return "shorter than the 64-byte header";
    case HeaderStatus::kBadMagic: return "bad magic (not a pager page, or a slot never written)";
    case HeaderStatus::kUnsupportedVersion: return "unsupported format version";
    case HeaderStatus::kBadHeaderSize: return "bad header size";
    case HeaderStatus::kHeaderChecksum: return "header checksum mismatch";
    case HeaderStatus::kBadFlags: return "unknown flags or non-zero reserved bytes";
    case HeaderStatus::kBadSlotSize: return "bad slot size";
    case HeaderStatus::kBadPayloadSize: return "payload larger than its slot";
    case HeaderStatus::kBadVersion: return "version 0";
  }
  return "unknown";
}

std::size_t round_up_to_page(std::size_t x) noexcept {
  return (x + kPageAlignment - 1) / kPageAlignment * kPageAlignment;
}

std::size_t slot_bytes_for(std::size_t record_bytes) noexcept {
  return round_up_to_page(kPageHeaderBytes + record_bytes);
}

bool encode_page_header(const PageHeader& header, std::span<std::byte> out) noexcept {
  if (out.size() < kPageHeaderBytes) return false;
  std::byte* p = out.data();
  std::memset(p, 0, kPageHeaderBytes);
  store(p + kOffMagic, kPageMagic, 4);
  store(p + kOffFormat, kPageFormatVersion, 2);
  store(p + kOffHeaderBytes, kPageHeaderBytes, 2);
  store(p + kOffKey, header.key, 8);
  store(p + kOffVersion, header.version, 8);
  store(p + kOffPayloadBytes, header.payload_bytes, 8);
  store(p + kOffSlotBytes, header.slot_bytes, 8);
  store(p + kOffPayloadCrc, header.payload_crc, 4);
  store(p + kOffFlags, 0, 4);
  store(p + kOffHeaderCrc, crc32c({p, kOffHeaderCrc}), 4);
  return true;
}

HeaderStatus parse_page_header(std::span<const std::byte> in, PageHeader* out) noexcept {
  if (in.size() < kPageHeaderBytes) return HeaderStatus::kTooShort;
  const std::byte* p = in.data();
  if (load(p + kOffMagic, 4) != kPageMagic) return HeaderStatus::kBadMagic;
  if (load(p + kOffFormat, 2) != kPageFormatVersion) return HeaderStatus::kUnsupportedVersion;
  if (load(p + kOffHeaderBytes, 2) != kPageHeaderBytes) return HeaderStatus::kBadHeaderSize;
  if (load(p + kOffHeaderCrc, 4) != crc32c({p, kOffHeaderCrc})) return HeaderStatus::kHeaderChecksum;
  if (load(p + kOffFlags, 4) != 0) return HeaderStatus::kBadFlags;
  for (std::size_t i = 0; i < kReservedBytes; ++i) {
    if (p[kOffReserved + i] != std::byte{0}) return HeaderStatus::kBadFlags;
  }
  PageHeader h;
  h.key = load(p + kOffKey, 8);
  h.version = load(p + kOffVersion, 8);
  h.payload_bytes = load(p + kOffPayloadBytes, 8);
  h.slot_bytes = load(p + kOffSlotBytes, 8);
  h.payload_crc = static_cast<std::uint32_t>(load(p + kOffPayloadCrc, 4));
  if (h.slot_bytes == 0 || h.slot_bytes % kPageAlignment != 0) return HeaderStatus::kBadSlotSize;
  if (h.payload_bytes > h.slot_bytes - kPageHeaderBytes) return HeaderStatus::kBadPayloadSize;
  if (h.version == 0) return HeaderStatus::kBadVersion;
  if (out != nullptr) *out = h;
  return HeaderStatus::kOk;
}

bool encode_page(std::uint64_t key, std::uint64_t version, std::span<const std::byte> payload,
                 std::span<std::byte> page) noexcept {
  if (page.size() % kPageAlignment != 0 || page.size() < kPageHeaderBytes + payload.size()) return false;
  PageHeader h;
  h.key = key;
  h.version = version;
  h.payload_bytes = payload.size();
  h.slot_bytes = page.size();
  h.payload_crc = crc32c(payload);
  encode_page_header(h, page);
  if (!payload.empty()) std::memcpy(page.data() + kPageHeaderBytes, payload.data(), payload.size());
  const std::size_t used = kPageHeaderBytes + payload.size();
  std::memset(page.data() + used, 0, page.size() - used);
  return true;
}

PageCheck check_page(std::span<const std::byte> page, std::uint64_t key, std::uint64_t expected_version) {
  PageCheck check;
  check.header_status = parse_page_header(page, &check.header);
  if (check.header_status != HeaderStatus::kOk) {
    check.status = PageStatus::kHeader;
    check.detail = std::string("page header invalid: ") + to_string(check.header_status);
    return check;
  }
  const PageHeader& h = check.header;
  if (h.key != key) {
    check.status = PageStatus::kKeyMismatch;
    check.detail = "page holds key " + std::to_string(h.key) + ", expected key " + std::to_string(key);
    return check;
  }
  if (h.slot_bytes != page.size()) {
    check.status = PageStatus::kSlotMismatch;
    check.detail = "page was written for " + std::to_string(h.slot_bytes) + "-byte slots, this pager uses " +
                   std::to_string(page.size()) + "-byte slots";
    return check;
  }
  if (expected_version != 0 && h.version != expected_version) {
    check.status = PageStatus::kVersionMismatch;
    check.detail = "page holds version " + std::to_string(h.version) + ", expected version " +
                   std::to_string(expected_version);
    return check;
  }
  const std::uint32_t actual = crc32c(page.subspan(kPageHeaderBytes, h.payload_bytes));
  if (actual != h.payload_crc) {
    check.status = PageStatus::kPayloadChecksum;
    check.detail = "payload CRC32C " + hex32(actual) + " != header's " + hex32(h.payload_crc) + " (" +
                   std::to_string(h.payload_bytes) + " payload bytes)";
  }
  return check;
}

}  // namespace asteria::store
