// Fuzz target for the NVMe pager's page parser (asteria/store/page_format.h): the bytes a pager reads
// back from disk are external input. Checks, beyond "no crash / no sanitizer report":
//  - a header that parses re-encodes to exactly the same 64 bytes (nothing is accepted loosely);
//  - an accepted header obeys the documented invariants;
//  - check_page() accepts a page only if its payload CRC matches;
//  - the SSE4.2 and table CRC32C paths agree.
// Built with libFuzzer under clang (-fsanitize=fuzzer,address,undefined) or, with gcc, linked with
// fuzz/standalone_driver.cpp (ASan+UBSan), which calls the same entry point.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>

#include "asteria/store/page_format.h"

namespace {

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "page_header_fuzz: invariant violated: %s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace asteria::store;
  const std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data), size);

  if (crc32c(in) != crc32c_portable(in)) fail("crc32c paths disagree");

  PageHeader header;
  const HeaderStatus status = parse_page_header(in, &header);
  if (size < kPageHeaderBytes && status != HeaderStatus::kTooShort) fail("short input not reported as too short");
  if (status == HeaderStatus::kOk) {
    if (header.slot_bytes == 0 || header.slot_bytes % kPageAlignment != 0) fail("accepted a bad slot size");
    if (header.payload_bytes > header.slot_bytes - kPageHeaderBytes) fail("accepted a payload larger than its slot");
    if (header.version == 0) fail("accepted version 0");
    std::byte again[kPageHeaderBytes];
    if (!encode_page_header(header, again)) fail("encode refused a parsed header");
    if (std::memcmp(again, in.data(), kPageHeaderBytes) != 0) fail("parsed header does not re-encode to its bytes");
    if (in.size() >= header.slot_bytes) {
      const auto page = in.first(header.slot_bytes);
      const PageCheck check = check_page(page, header.key, header.version);
      const bool crc_ok = crc32c(page.subspan(kPageHeaderBytes, header.payload_bytes)) == header.payload_crc;
      if ((check.status == PageStatus::kOk) != crc_ok) fail("check_page disagrees with the payload CRC");
    }
  }
  // The whole input as a page of key 0, any version: must never read out of bounds.
  const PageCheck any = check_page(in, 0, 0);
  if (any.status == PageStatus::kOk && (any.header.slot_bytes != size || any.header.key != 0)) {
    fail("check_page accepted a page of another size or key");
  }
  return 0;
}
