#include "asteria/store/page_format.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace asteria::store {
namespace {

std::vector<std::byte> bytes_of(const std::string& text) {
  std::vector<std::byte> out(text.size());
  std::memcpy(out.data(), text.data(), text.size());
  return out;
}

// Rewrites the header CRC of a hand-edited header so that the edit itself is what the parser sees.
void reseal(std::vector<std::byte>& page) {
  const std::uint32_t crc = crc32c({page.data(), 60});
  for (int i = 0; i < 4; ++i) page[60 + i] = static_cast<std::byte>((crc >> (8 * i)) & 0xFF);
}

void put_u64(std::vector<std::byte>& page, std::size_t offset, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) page[offset + i] = static_cast<std::byte>((v >> (8 * i)) & 0xFF);
}

std::vector<std::byte> valid_page(std::size_t payload_bytes, std::uint64_t key = 7, std::uint64_t version = 3) {
  std::vector<std::byte> payload(payload_bytes);
  for (std::size_t i = 0; i < payload_bytes; ++i) payload[i] = static_cast<std::byte>((i * 13 + 5) & 0xFF);
  std::vector<std::byte> page(slot_bytes_for(payload_bytes));
  EXPECT_TRUE(encode_page(key, version, payload, page));
  return page;
}

TEST(PageFormat, Crc32cMatchesKnownVectors) {
  EXPECT_EQ(crc32c(bytes_of("123456789")), 0xE3069283u);
  EXPECT_EQ(crc32c_portable(bytes_of("123456789")), 0xE3069283u);
  // RFC 3720 (iSCSI) B.4 test vectors.
  std::vector<std::byte> zeros(32, std::byte{0}), ones(32, std::byte{0xFF}), ascending(32);
  for (int i = 0; i < 32; ++i) ascending[i] = static_cast<std::byte>(i);
  EXPECT_EQ(crc32c(zeros), 0x8A9136AAu);
  EXPECT_EQ(crc32c(ones), 0x62A8AB43u);
  EXPECT_EQ(crc32c(ascending), 0x46DD794Eu);
  EXPECT_EQ(crc32c_portable(ascending), 0x46DD794Eu);
  EXPECT_EQ(crc32c({}), 0u);
}

TEST(PageFormat, Crc32cPathsAgreeAndContinue) {
  std::mt19937 rng(5);
  std::vector<std::byte> data(10007);
  for (auto& b : data) b = static_cast<std::byte>(rng() & 0xFF);
  for (std::size_t n : {0, 1, 7, 8, 9, 63, 64, 65, 4096, 10007}) {
    const std::span<const std::byte> part(data.data() + 1, std::min<std::size_t>(n, data.size() - 1));  // unaligned
    EXPECT_EQ(crc32c(part), crc32c_portable(part)) << n;
  }
  const std::span<const std::byte> all(data);
  const std::uint32_t split = crc32c(all.subspan(1234), crc32c(all.first(1234)));
  EXPECT_EQ(split, crc32c(all));
  EXPECT_EQ(crc32c_portable(all.subspan(1234), crc32c_portable(all.first(1234))), crc32c(all));
}

TEST(PageFormat, RoundTripsHeaderAndPage) {
  const auto page = valid_page(10000, 0xFFFFFFFFFFFFFFFFull, 42);
  EXPECT_EQ(page.size(), 12288u);  // 64 + 10000 rounded up to 4096
  PageHeader h;
  ASSERT_EQ(parse_page_header(page, &h), HeaderStatus::kOk);
  EXPECT_EQ(h.key, 0xFFFFFFFFFFFFFFFFull);
  EXPECT_EQ(h.version, 42u);
  EXPECT_EQ(h.payload_bytes, 10000u);
  EXPECT_EQ(h.slot_bytes, 12288u);
  const PageCheck check = check_page(page, 0xFFFFFFFFFFFFFFFFull, 42);
  EXPECT_EQ(check.status, PageStatus::kOk) << check.detail;
  for (std::size_t i = 64 + 10000; i < page.size(); ++i) ASSERT_EQ(page[i], std::byte{0}) << "padding at " << i;
  // Re-encoding the parsed header gives the same bytes.
  std::vector<std::byte> again(64);
  ASSERT_TRUE(encode_page_header(h, again));
  EXPECT_EQ(0, std::memcmp(again.data(), page.data(), 64));
}

TEST(PageFormat, SizesRoundToPages) {
  EXPECT_EQ(round_up_to_page(0), 0u);
  EXPECT_EQ(round_up_to_page(1), 4096u);
  EXPECT_EQ(round_up_to_page(4096), 4096u);
  EXPECT_EQ(slot_bytes_for(4032), 4096u);
  EXPECT_EQ(slot_bytes_for(4033), 8192u);
  std::vector<std::byte> payload(4033), small(4096);
  EXPECT_FALSE(encode_page(1, 1, payload, small));        // does not fit
  std::vector<std::byte> odd(5000);
  EXPECT_FALSE(encode_page(1, 1, {}, odd));               // not a multiple of 4096
  std::vector<std::byte> tiny(10);
  EXPECT_FALSE(encode_page_header(PageHeader{}, tiny));
}

TEST(PageFormat, RejectsEachKindOfBadHeader) {
  const auto good = valid_page(100);
  PageHeader h;
  EXPECT_EQ(parse_page_header(std::span(good).first(63), &h), HeaderStatus::kTooShort);

  auto p = good;
  p[0] = std::byte{'X'};
  EXPECT_EQ(parse_page_header(p, &h), HeaderStatus::kBadMagic);
  std::vector<std::byte> zeros(4096, std::byte{0});
  EXPECT_EQ(parse_page_header(zeros, &h), HeaderStatus::kBadMagic);

  p = good;
  p[4] = std::byte{2};
  reseal(p);
  EXPECT_EQ(parse_page_header(p, &h), HeaderStatus::kUnsupportedVersion);

  p = good;
  p[6] = std::byte{128};
  reseal(p);
  EXPECT_EQ(parse_page_header(p, &h), HeaderStatus::kBadHeaderSize);

  p = good;
  p[9] ^= std::byte{1};  // a key bit flipped, CRC not updated
  EXPECT_EQ(parse_page_header(p, &h), HeaderStatus::kHeaderChecksum);
  p = good;
  p[61] ^= std::byte{0x80};  // the CRC itself
  EXPECT_EQ(parse_page_header(p, &h), HeaderStatus::kHeaderChecksum);

  p = good;
  p[44] = std::byte{1};
  reseal(p);
  EXPECT_EQ(parse_page_header(p, &h), HeaderStatus::kBadFlags);
  p = good;
  p[55] = std::byte{1};
  reseal(p);
  EXPECT_EQ(parse_page_header(p, &h), HeaderStatus::kBadFlags);

  p = good;
  put_u64(p, 32, 4095);
  reseal(p);
  EXPECT_EQ(parse_page_header(p, &h), HeaderStatus::kBadSlotSize);
  put_u64(p, 32, 0);
  reseal(p);
  EXPECT_EQ(parse_page_header(p, &h), HeaderStatus::kBadSlotSize);

  p = good;
  put_u64(p, 24, 4096 - 64 + 1);
  reseal(p);
  EXPECT_EQ(parse_page_header(p, &h), HeaderStatus::kBadPayloadSize);
  put_u64(p, 24, ~0ull);
  reseal(p);
  EXPECT_EQ(parse_page_header(p, &h), HeaderStatus::kBadPayloadSize);

  p = good;
  put_u64(p, 16, 0);
  reseal(p);
  EXPECT_EQ(parse_page_header(p, &h), HeaderStatus::kBadVersion);
  EXPECT_STRNE(to_string(HeaderStatus::kBadVersion), "unknown");
}

TEST(PageFormat, CheckPageNamesWhatFailed) {
  const auto good = valid_page(5000, 9, 4);
  EXPECT_EQ(check_page(good, 10, 4).status, PageStatus::kKeyMismatch);
  EXPECT_EQ(check_page(good, 9, 5).status, PageStatus::kVersionMismatch);
  EXPECT_EQ(check_page(good, 9, 0).status, PageStatus::kOk);  // any version
  EXPECT_EQ(check_page(std::span(good).first(4096), 9, 4).status, PageStatus::kSlotMismatch);

  auto p = good;
  p[64 + 4999] ^= std::byte{0x10};
  const PageCheck bad = check_page(p, 9, 4);
  EXPECT_EQ(bad.status, PageStatus::kPayloadChecksum);
  EXPECT_NE(bad.detail.find("CRC32C"), std::string::npos) << bad.detail;

  // A flip in the padding after the payload is outside what the checksum covers and harmless.
  p = good;
  p[64 + 5000] ^= std::byte{0x10};
  EXPECT_EQ(check_page(p, 9, 4).status, PageStatus::kOk);

  p = good;
  p[20] ^= std::byte{1};
  const PageCheck header = check_page(p, 9, 4);
  EXPECT_EQ(header.status, PageStatus::kHeader);
  EXPECT_EQ(header.header_status, HeaderStatus::kHeaderChecksum);
  EXPECT_NE(header.detail.find("header checksum"), std::string::npos) << header.detail;
}

}  // namespace
}  // namespace asteria::store
