// A small stand-in for libFuzzer where clang is not available: loads the seed corpus given on the
// command line (files or directories), then mutates seeds at random and feeds them to
// LLVMFuzzerTestOneInput until -max_total_time=N seconds (default 30) have passed. It accepts the
// libFuzzer flags the scripts pass (-max_total_time, -seed, -max_len); others are ignored. It has no
// coverage feedback; its mutations know the page layout (they often reseal the header CRC) so that
// inputs reach the checks behind the header checksum.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "asteria/store/page_format.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace {

using Bytes = std::vector<std::uint8_t>;

Bytes read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void reseal(Bytes& b) {
  if (b.size() < 64) return;
  const std::uint32_t crc = asteria::store::crc32c({reinterpret_cast<const std::byte*>(b.data()), 60});
  for (int i = 0; i < 4; ++i) b[60 + i] = static_cast<std::uint8_t>(crc >> (8 * i));
}

Bytes mutate(Bytes b, const std::vector<Bytes>& corpus, std::mt19937_64& rng, std::size_t max_len) {
  const int rounds = 1 + static_cast<int>(rng() % 4);
  for (int r = 0; r < rounds; ++r) {
    switch (rng() % 8) {
      case 0:  // flip a bit
        if (!b.empty()) b[rng() % b.size()] ^= static_cast<std::uint8_t>(1u << (rng() % 8));
        break;
      case 1:  // set a byte to an interesting value
        if (!b.empty()) {
          static const std::uint8_t values[] = {0x00, 0x01, 0x7F, 0x80, 0xFF, 0x10, 0x40};
          b[rng() % b.size()] = values[rng() % sizeof(values)];
        }
        break;
      case 2:  // overwrite a header field (bytes 0..59) with a random 1..8-byte value
        if (b.size() >= 64) {
          const std::size_t at = rng() % 60, n = std::min<std::size_t>(1 + rng() % 8, 60 - at);
          const std::uint64_t v = rng();
          for (std::size_t i = 0; i < n; ++i) b[at + i] = static_cast<std::uint8_t>(v >> (8 * i));
        }
        break;
      case 3:  // truncate
        if (!b.empty()) b.resize(rng() % (b.size() + 1));
        break;
      case 4:  // extend with random bytes
        for (std::size_t n = rng() % 128; n > 0 && b.size() < max_len; --n) {
          b.push_back(static_cast<std::uint8_t>(rng()));
        }
        break;
      case 5:  // splice with another seed
        if (!corpus.empty()) {
          const Bytes& other = corpus[rng() % corpus.size()];
          if (!other.empty()) {
            const std::size_t from = rng() % other.size(), at = b.empty() ? 0 : rng() % b.size();
            const std::size_t n = std::min<std::size_t>(1 + rng() % 64, other.size() - from);
            if (b.size() < at + n) b.resize(at + n);
            std::memcpy(b.data() + at, other.data() + from, n);
          }
        }
        break;
      default:  // 6, 7: reseal the header CRC so the mutation reaches the checks behind it
        reseal(b);
        break;
    }
  }
  if (b.size() > max_len) b.resize(max_len);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  double max_seconds = 30.0;
  std::uint64_t seed = std::random_device{}();
  std::size_t max_len = 1 << 16;
  std::vector<Bytes> corpus;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("-max_total_time=", 0) == 0) max_seconds = std::stod(arg.substr(16));
    else if (arg.rfind("-seed=", 0) == 0) seed = std::stoull(arg.substr(6));
    else if (arg.rfind("-max_len=", 0) == 0) max_len = std::stoull(arg.substr(9));
    else if (arg.rfind("-", 0) == 0) continue;
    else if (std::filesystem::is_directory(arg)) {
      for (const auto& entry : std::filesystem::directory_iterator(arg)) {
        if (entry.is_regular_file()) corpus.push_back(read_file(entry.path()));
      }
    } else {
      corpus.push_back(read_file(arg));
    }
  }
  if (corpus.empty()) corpus.push_back({});
  std::printf("standalone fuzz driver (no libFuzzer): %zu seeds, seed=%llu, %.0f s\n", corpus.size(),
              static_cast<unsigned long long>(seed), max_seconds);
  for (const Bytes& b : corpus) LLVMFuzzerTestOneInput(b.data(), b.size());
  std::mt19937_64 rng(seed);
  const auto start = std::chrono::steady_clock::now();
  std::uint64_t runs = 0;
  for (;; ++runs) {
    if ((runs & 255) == 0 &&
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >= max_seconds) {
      break;
    }
    const Bytes input = mutate(corpus[rng() % corpus.size()], corpus, rng, max_len);
    LLVMFuzzerTestOneInput(input.data(), input.size());
  }
  std::printf("Done %llu runs in %.1f s\n", static_cast<unsigned long long>(runs),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return 0;
}
