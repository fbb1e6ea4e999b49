#include "asteria/runtime/blas_threads.h"

#include <mutex>
#include <string>

#include "asteria/common/errors.h"

extern "C" void openblas_set_num_threads(int);
extern "C" int openblas_get_num_threads(void);
extern "C" char* openblas_get_corename(void);

namespace asteria::runtime {

namespace {
// OpenBLAS does not document its setter as thread-safe (it may start its own thread pool on first
// use), and every pool worker calls it at start, so the calls are serialized here.
std::mutex& setter_mutex() {
  static std::mutex mutex;
  return mutex;
}
}  // namespace

void set_blas_threads(int threads) {
  if (threads < 1) {
    throw InvalidArgument("[set_blas_threads] threads=" + std::to_string(threads) + " must be >= 1");
  }
  std::lock_guard lock(setter_mutex());
  openblas_set_num_threads(threads);
}

int blas_threads() {
  std::lock_guard lock(setter_mutex());
  return openblas_get_num_threads();
}

const char* blas_core() { return openblas_get_corename(); }

}  // namespace asteria::runtime
