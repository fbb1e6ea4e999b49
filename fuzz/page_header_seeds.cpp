// Writes a seed corpus of valid pages for page_header_fuzz into the directory given as argv[1]:
// whole pages (various keys, versions and payload sizes, one and two slots' worth) and bare headers.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "asteria/store/page_format.h"

int main(int argc, char** argv) {
  using namespace asteria::store;
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  int written = 0;
  auto save = [&](const std::vector<std::byte>& bytes) {
    std::ofstream out(dir + "/seed-" + std::to_string(written++), std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  };
  const std::size_t sizes[] = {0, 1, 100, 4032, 4033, 9000};
  const std::uint64_t keys[] = {0, 7, 0xFFFFFFFFFFFFFFFFull};
  for (const std::size_t payload_bytes : sizes) {
    for (const std::uint64_t key : keys) {
      std::vector<std::byte> payload(payload_bytes);
      for (std::size_t i = 0; i < payload_bytes; ++i) payload[i] = static_cast<std::byte>((i * 29 + key) & 0xFF);
      std::vector<std::byte> page(slot_bytes_for(payload_bytes));
      if (!encode_page(key, payload_bytes + 1, payload, page)) return 1;
      save(page);
      save(std::vector<std::byte>(page.begin(), page.begin() + kPageHeaderBytes));
    }
  }
  std::printf("wrote %d seeds to %s\n", written, dir.c_str());
  return 0;
}
