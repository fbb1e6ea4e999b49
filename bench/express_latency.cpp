// What express workers do for the small blocks' refreshes while every worker is inside a large root, on the
// real pool and numerics: W workers are kept busy with inverse roots of n_large; every `period_ms` a burst of
// K roots of n_small is submitted; reported are the small jobs' latency (submission to end) and the time all the
// jobs took: by deadline (the large roots were queued first), the smallest first (JobClass::kBackground, as
// queue_order="shortest" runs them: a small root waits for a worker to end its large one), and by deadline with E
// express workers (WorkerPool's ExpressWorkers: a small root preempts a large one).
//
// Build (from the repository root; not part of the CMake build), one line:
//   g++ -O3 -march=native -std=c++20 bench/express_latency.cpp -I cpp cpp/asteria/runtime/worker_pool.cpp cpp/asteria/runtime/blas_threads.cpp cpp/asteria/linalg/lapack.cpp cpp/asteria/linalg/inverse_root.cpp cpp/asteria/common/errors.cpp -lopenblas -lpthread -o /tmp/express_latency
// Run:
//   /tmp/express_latency W E n_large n_small K period_ms bursts [worker_nice express_nice]
//   e.g. /tmp/express_latency 2 2 1536 256 8 100 20 (the nices default to the engine's: 10 and 5)
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

#include "asteria/common/clock.h"
#include "asteria/linalg/inverse_root.h"
#include "asteria/runtime/worker_pool.h"

namespace {

using asteria::Clock;
using asteria::runtime::ExpressWorkers;
using asteria::runtime::JobClass;
using asteria::runtime::JobHandle;
using asteria::runtime::WorkerPool;

std::vector<float> spd(int n, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  std::vector<float> g(static_cast<std::size_t>(n) * n), a(g.size(), 0.0f);
  for (float& x : g) x = normal(gen);
  for (int i = 0; i < n; ++i) {
    for (int k = 0; k < n; ++k) {
      const float gik = g[static_cast<std::size_t>(i) * n + k];
      for (int j = 0; j <= i; ++j) a[static_cast<std::size_t>(i) * n + j] += gik * g[static_cast<std::size_t>(j) * n + k];
    }
  }
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < i; ++j) a[static_cast<std::size_t>(j) * n + i] = a[static_cast<std::size_t>(i) * n + j];
  }
  return a;
}

void root(const std::vector<float>& a, int n) {
  thread_local std::vector<float> out;
  out.resize(a.size());
  asteria::linalg::inverse_root(n, a.data(), n, out.data(), n, asteria::linalg::RootSpec{-0.25, 1e-12, 1.0});
}

struct Result {
  double small_mean_ms, small_max_ms, large_seconds;
};

int worker_nice = 10, express_nice = 5;

Result run(int workers, int express, bool shortest, int n_large, int n_small, int burst, int period_ms, int bursts,
           const std::vector<float>& large, const std::vector<float>& small) {
  const JobClass job_class = shortest ? JobClass::kBackground : JobClass::kDue;
  const double small_cost = static_cast<double>(n_small) * n_small * n_small;
  WorkerPool pool(workers, 1, worker_nice, {}, ExpressWorkers{express, small_cost, express_nice});
  const double large_cost = static_cast<double>(n_large) * n_large * n_large;
  std::vector<JobHandle> large_jobs;
  // Enough large roots to keep every worker busy over all the bursts, and beyond.
  const int large_count = workers * (1 + bursts * period_ms / 200);
  const auto started = Clock::now();
  for (int i = 0; i < large_count; ++i) {
    large_jobs.push_back(pool.submit(0, [&] { root(large, n_large); }, large_cost, job_class));
  }
  std::mutex mutex;
  std::vector<double> latencies;
  std::vector<JobHandle> small_jobs;
  for (int b = 0; b < bursts; ++b) {
    std::this_thread::sleep_for(std::chrono::milliseconds(period_ms));
    for (int k = 0; k < burst; ++k) {
      const auto submitted = Clock::now();
      small_jobs.push_back(pool.submit(b + 1, [&, submitted] {
        root(small, n_small);
        std::lock_guard lock(mutex);
        latencies.push_back(1e3 * asteria::seconds_since(submitted));
      }, small_cost, job_class));
    }
  }
  for (const JobHandle& job : small_jobs) job.wait(std::chrono::hours(1));
  for (const JobHandle& job : large_jobs) job.wait(std::chrono::hours(1));
  const double large_seconds = asteria::seconds_since(started);
  double sum = 0.0;
  for (double ms : latencies) sum += ms;
  return {sum / static_cast<double>(latencies.size()), *std::max_element(latencies.begin(), latencies.end()),
          large_seconds};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 8 && argc != 10) {
    std::fprintf(stderr, "usage: %s W E n_large n_small K period_ms bursts [worker_nice express_nice]\n", argv[0]);
    return 2;
  }
  if (argc == 10) {
    worker_nice = std::atoi(argv[8]);
    express_nice = std::atoi(argv[9]);
  }
  const int workers = std::atoi(argv[1]), express = std::atoi(argv[2]), n_large = std::atoi(argv[3]);
  const int n_small = std::atoi(argv[4]), burst = std::atoi(argv[5]), period_ms = std::atoi(argv[6]);
  const int bursts = std::atoi(argv[7]);
  const std::vector<float> large = spd(n_large, 1), small = spd(n_small, 2);
  root(small, n_small);  // (the library's first call, outside the timings)
  std::printf("%d workers at nice %d (express %d); roots of %d kept queued; bursts of %d roots of %d every %d ms, "
              "%d bursts\n", workers, worker_nice, express_nice, n_large, burst, n_small, period_ms, bursts);
  std::printf("%-22s %14s %14s %18s\n", "order", "small mean ms", "small max ms", "all jobs done, s");
  for (const auto& [name, e, shortest] : {std::tuple{"deadline", 0, false}, std::tuple{"shortest first", 0, true},
                                          std::tuple{"deadline + express", express, false}}) {
    const Result r = run(workers, e, shortest, n_large, n_small, burst, period_ms, bursts, large, small);
    std::printf("%-22s %14.1f %14.1f %18.2f\n", name, r.small_mean_ms, r.small_max_ms, r.large_seconds);
  }
  return 0;
}
