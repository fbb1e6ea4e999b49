#include "asteria/common/errors.h"

namespace asteria {

BlockFailure::BlockFailure(std::int64_t block, std::int64_t version, const std::string& cause)
    : Error("block " + std::to_string(block) + " failed its refresh (version " + std::to_string(version) +
            "): " + cause),
      block_(block),
      version_(version),
      cause_(cause) {}

PagerIOError::PagerIOError(const std::string& message, std::string path, std::uint64_t offset,
                           std::uint64_t size, int error_number)
    : Error(message), path_(std::move(path)), offset_(offset), size_(size), errno_(error_number) {}

}  // namespace asteria
