#include "asteria/common/errors.h"

namespace asteria {

BlockFailure::BlockFailure(std::int64_t block, std::int64_t version, const std::string& cause)
    : Error("block " + std::to_string(block) + " failed its refresh (version " + std::to_string(version) +
            "): " + cause),
      block_(block),
      version_(version),
      cause_(cause) {}

}  // namespace asteria
