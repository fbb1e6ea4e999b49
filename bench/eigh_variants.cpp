// Throughput of float32 symmetric eigendecomposition variants, as the refresh workers run them:
// T std::threads, each with OpenBLAS at 1 thread, share B random SPD blocks of size n.
//
// Build (from the repository root; not part of the CMake build), one line:
//   g++ -O3 -march=native -std=c++20 bench/eigh_variants.cpp -I cpp cpp/asteria/linalg/lapack.cpp cpp/asteria/linalg/inverse_root.cpp cpp/asteria/common/errors.cpp -lopenblas -lpthread -o /tmp/eigh_variants
// Run:
//   /tmp/eigh_variants B T [n ...]        e.g. /tmp/eigh_variants 8 2 1024
//
// Columns: blocks/s over the timed pass (after one untimed warm-up block per thread);
// resid = |A Q - Q diag(w)|_F / |A|_F and orth = |Q^T Q - I|_F / sqrt(n) on the first block.
// For inverse_root (exponent -1/2) resid = |R A R - I|_F / sqrt(n) and orth is blank.
//
// Variants: LAPACK's ssyevd with a fresh or a reused workspace; ssyevr (MRRR); ssytrd + sorgtr +
// sstedc('V'); ssytrd + sstedc('I') + Q Z by slarft/slarfb 128 wide; the shim's eigh (in-house
// tridiagonalization, sstedc('I'), Q Z by packed 64-wide block reflectors through gemm on
// 256-column slices); and the whole inverse_root (eigh + syrk), which uses eigh. Three phases beside them, without
// error columns: LAPACK's ssytrd alone (half its flops are BLAS-2 passes over the trailing matrix), its
// two-stage reduction (BLAS-3 to a band, then bulge chasing in cache; the reduction only) and one gemm of n^3
// (compute-bound): their ratios at T = 1 against T = all cores say whether the one-stage reduction turns
// memory-bound when every core reduces its own matrix, as the refresh workers do, and whether two stages
// would pay there for the second back-transformation they need.
//
// Measured (blocks/s; resid ~9e-7, orth ~2e-6 for all but syevr, orth 2e-5..2e-4):
//                          2-core dev VM, T=2     H200 host, 16 cores, T=16 (OPENBLAS_CORETYPE=SkylakeX)
//                          n=1024 B=8  2048 B=4   n=1024 B=128   n=2048 B=48
//   syevd reused workspace    17.2       2.49         69.3          10.1
//   syevr (MRRR)              10.4       1.72         48.8           9.2
//   eigh                      22.9       3.03         88.3          15.0
//   inverse_root              20.3       2.69         78.2          13.3
//   torch.linalg.eigh (MKL 2024.2, 16 Python threads x 1 MKL thread, same run):  87.8  12.7
// Phases on the 2-core dev VM, n = 2048 (`eigh_variants 2 1 2048`, `4 2 2048`): eigh 1.86 and 3.42 blocks/s at
// T = 1 and 2, ssytrd alone 3.44 and 6.04 (the reduction is 54% of eigh's time; 36 GF/s against gemm's 165),
// gemm 10.2 and 18.0: two cores there do not contend. At T = 1 the two-stage reduction ran 1.2x ssytrd at
// n = 2048 and 0.95x at 1024, less than its second back-transformation would cost. The H200 host's T = 16 is
// what the phases are for.
// Run to run, the H200 host varies by about 15% (MKL at n=1024 measured 88 to 111 blocks/s).
// On a 2-core AMD EPYC (Zen 3: AVX2, no AVX-512; OpenBLAS's Zen kernels), `eigh_variants 6 2 2048`: syevd 1.77-1.96,
// eigh 2.69-2.77, inverse_root 2.05-2.45 (before the AVX2 kernels used 32-byte vectors: eigh 1.65-1.70).
// Without OPENBLAS_CORETYPE, OpenBLAS 0.3.21 does not recognise that CPU (family 6 model 207)
// and runs its Prescott kernels: gemm at a quarter of the speed, eigh at 37 blocks/s.
#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "asteria/linalg/inverse_root.h"
#include "asteria/linalg/lapack.h"

// LAPACK routines only the variants below use; the core goes through asteria/linalg/lapack.h.
extern "C" {
void openblas_set_num_threads(int threads);
char* openblas_get_corename();
void ssyevr_(const char* jobz, const char* range, const char* uplo, const int* n, float* a, const int* lda,
             const float* vl, const float* vu, const int* il, const int* iu, const float* abstol, int* m, float* w,
             float* z, const int* ldz, int* isuppz, float* work, const int* lwork, int* iwork, const int* liwork,
             int* info, std::size_t, std::size_t, std::size_t);
void ssytrd_(const char* uplo, const int* n, float* a, const int* lda, float* d, float* e, float* tau, float* work,
             const int* lwork, int* info, std::size_t);
void sorgtr_(const char* uplo, const int* n, float* a, const int* lda, const float* tau, float* work,
             const int* lwork, int* info, std::size_t);
void sstedc_(const char* compz, const int* n, float* d, float* e, float* z, const int* ldz, float* work,
             const int* lwork, int* iwork, const int* liwork, int* info, std::size_t);
void ssytrd_2stage_(const char* vect, const char* uplo, const int* n, float* a, const int* lda, float* d, float* e,
                    float* tau, float* hous2, const int* lhous2, float* work, const int* lwork, int* info, std::size_t,
                    std::size_t);
void slarft_(const char* direct, const char* storev, const int* n, const int* k, const float* v, const int* ldv,
             const float* tau, float* t, const int* ldt, std::size_t, std::size_t);
void slarfb_(const char* side, const char* trans, const char* direct, const char* storev, const int* m,
             const int* n, const int* k, const float* v, const int* ldv, const float* t, const int* ldt, float* c,
             const int* ldc, float* work, const int* ldwork, std::size_t, std::size_t, std::size_t, std::size_t);
}

namespace {

using asteria::linalg::gemm;

struct Scratch {
  std::vector<float> a, e, tau, t, work;
  std::vector<int> iwork, isuppz;
};

void grow(std::vector<float>& v, std::size_t size) {
  if (v.size() < size) v.resize(size);
}
void grow(std::vector<int>& v, std::size_t size) {
  if (v.size() < size) v.resize(size);
}

void check(const char* routine, int info) {
  if (info != 0) {
    std::fprintf(stderr, "%s failed, info=%d\n", routine, info);
    std::exit(1);
  }
}

// Every variant: eigenvectors of the n x n symmetric `a` into q (columns), eigenvalues into w.
using Variant = std::function<void(int n, const float* a, float* q, float* w, Scratch& s)>;

void syevd_into(int n, const float* a, float* q, float* w, Scratch& s) {
  std::copy(a, a + static_cast<std::size_t>(n) * n, q);
  asteria::linalg::syevd(n, q, /* lda = */ n, w, s.work, s.iwork);
}

void eigh_into(int n, const float* a, float* q, float* w, Scratch& s) {
  std::copy(a, a + static_cast<std::size_t>(n) * n, q);
  asteria::linalg::eigh(n, q, /* lda = */ n, w, s.work, s.iwork);
}

void syevr_into(int n, const float* a, float* q, float* w, Scratch& s) {
  const std::size_t nn = static_cast<std::size_t>(n);
  s.a.assign(a, a + nn * nn);
  grow(s.isuppz, 2 * nn);
  const float unused = 0, abstol = 0;
  const int unused_index = 0, query = -1;
  int m = 0, info = 0, iwork_query = 0;
  float work_query = 0;
  ssyevr_("V", "A", "L", &n, s.a.data(), &n, &unused, &unused, &unused_index, &unused_index, &abstol, &m, w, q,
          /* ldz = */ &n, s.isuppz.data(), &work_query, /* lwork = */ &query, &iwork_query, /* liwork = */ &query,
          &info, 1, 1, 1);
  check("ssyevr", info);
  grow(s.work, static_cast<std::size_t>(work_query) + 1);
  grow(s.iwork, static_cast<std::size_t>(iwork_query));
  const int lwork = static_cast<int>(s.work.size()), liwork = static_cast<int>(s.iwork.size());
  ssyevr_("V", "A", "L", &n, s.a.data(), &n, &unused, &unused, &unused_index, &unused_index, &abstol, &m, w, q, &n,
          s.isuppz.data(), s.work.data(), &lwork, s.iwork.data(), &liwork, &info, 1, 1, 1);
  check("ssyevr", info);
}

// LAPACK's Householder tridiagonalization of a copy of `a` into s.a, d (= w), e and tau.
void sytrd_copy(int n, const float* a, float* w, Scratch& s) {
  const std::size_t nn = static_cast<std::size_t>(n);
  s.a.assign(a, a + nn * nn);
  grow(s.e, nn);
  grow(s.tau, nn);
  const int query = -1;
  int info = 0;
  float work_query = 0;
  ssytrd_("L", &n, s.a.data(), &n, w, s.e.data(), s.tau.data(), &work_query, /* lwork = */ &query, &info, 1);
  check("ssytrd", info);
  grow(s.work, static_cast<std::size_t>(work_query) + 1);
  const int lwork = static_cast<int>(s.work.size());
  ssytrd_("L", &n, s.a.data(), &n, w, s.e.data(), s.tau.data(), s.work.data(), &lwork, &info, 1);
  check("ssytrd", info);
}

void sytrd_copy_into(int n, const float* a, float*, float* w, Scratch& s) { sytrd_copy(n, a, w, s); }

// LAPACK's two-stage reduction to tridiagonal form (dense to band by BLAS-3 panels, then band to tridiagonal
// by bulge chasing), without the Householder representation of its second stage: LAPACK cannot yet apply it
// to eigenvectors, so this times the reduction alone, for comparison with ssytrd.
void sytrd_2stage_into(int n, const float* a, float*, float* w, Scratch& s) {
  const std::size_t nn = static_cast<std::size_t>(n);
  s.a.assign(a, a + nn * nn);
  grow(s.e, nn);
  grow(s.tau, nn);
  grow(s.t, 4 * nn);
  const int query = -1, lhous = static_cast<int>(4 * nn);
  int info = 0;
  float work_query = 0;
  ssytrd_2stage_("N", "L", &n, s.a.data(), &n, w, s.e.data(), s.tau.data(), s.t.data(), &lhous, &work_query,
                 /* lwork = */ &query, &info, 1, 1);
  check("ssytrd_2stage", info);
  grow(s.work, static_cast<std::size_t>(work_query) + 1);
  const int lwork = static_cast<int>(s.work.size());
  ssytrd_2stage_("N", "L", &n, s.a.data(), &n, w, s.e.data(), s.tau.data(), s.t.data(), &lhous, s.work.data(),
                 &lwork, &info, 1, 1);
  check("ssytrd_2stage", info);
}

void stedc(const char* compz, int n, float* w, float* z, Scratch& s) {
  const int query = -1;
  int info = 0, iwork_query = 0;
  float work_query = 0;
  sstedc_(compz, &n, w, s.e.data(), z, /* ldz = */ &n, &work_query, /* lwork = */ &query, &iwork_query,
          /* liwork = */ &query, &info, 1);
  check("sstedc", info);
  grow(s.work, static_cast<std::size_t>(work_query) + 1);
  grow(s.iwork, static_cast<std::size_t>(iwork_query));
  const int lwork = static_cast<int>(s.work.size()), liwork = static_cast<int>(s.iwork.size());
  sstedc_(compz, &n, w, s.e.data(), z, &n, s.work.data(), &lwork, s.iwork.data(), &liwork, &info, 1);
  check("sstedc", info);
}

// Q from sytrd formed explicitly, then sstedc('V') computes Q Z itself.
void orgtr_stedc_into(int n, const float* a, float* q, float* w, Scratch& s) {
  sytrd_copy(n, a, w, s);
  const std::size_t nn = static_cast<std::size_t>(n);
  std::copy(s.a.data(), s.a.data() + nn * nn, q);
  const int query = -1;
  int info = 0;
  float work_query = 0;
  sorgtr_("L", &n, q, &n, s.tau.data(), &work_query, /* lwork = */ &query, &info, 1);
  check("sorgtr", info);
  grow(s.work, static_cast<std::size_t>(work_query) + 1);
  const int lwork = static_cast<int>(s.work.size());
  sorgtr_("L", &n, q, &n, s.tau.data(), s.work.data(), &lwork, &info, 1);
  check("sorgtr", info);
  stedc("V", n, w, q, s);
}

// sytrd + sstedc('I') + Q Z applied with block reflectors `nb` wide (sormtr uses ilaenv's 32:
// its rank-32 gemm updates stream Z from memory n/32 times).
void wide_backtransform_into(int n, const float* a, float* q, float* w, Scratch& s, int nb) {
  sytrd_copy(n, a, w, s);
  stedc("I", n, w, q, s);
  // sytrd('L') leaves H(i) = I - tau v v^T with v(i+1) = 1 and v(i+2:n) in a(i+2:n, i): the
  // reflectors of a QR factorization stored in a(2:n, 1:n-1), acting on rows 2:n of Z.
  const int m = n - 1, k = n - 1;
  const float* v = s.a.data() + 1;
  float* c = q + 1;
  grow(s.t, static_cast<std::size_t>(nb) * nb);
  grow(s.work, static_cast<std::size_t>(n) * nb);
  for (int i = ((k - 1) / nb) * nb; i >= 0; i -= nb) {
    const int ib = std::min(nb, k - i), mi = m - i;
    const float* vi = v + i + static_cast<std::size_t>(i) * n;
    slarft_("F", "C", &mi, &ib, vi, /* ldv = */ &n, s.tau.data() + i, s.t.data(), /* ldt = */ &nb, 1, 1);
    slarfb_("L", "N", "F", "C", &mi, /* n = */ &n, /* k = */ &ib, vi, /* ldv = */ &n, s.t.data(), /* ldt = */ &nb,
            c + i, /* ldc = */ &n, s.work.data(), /* ldwork = */ &n, 1, 1, 1, 1);
  }
}

double frobenius(const std::vector<float>& x) {
  double sum = 0;
  for (float v : x) sum += static_cast<double>(v) * v;
  return std::sqrt(sum);
}

// |A Q - Q diag(w)|_F / |A|_F and |Q^T Q - I|_F / sqrt(n).
std::pair<double, double> eigen_errors(int n, const float* a, const float* q, const float* w) {
  const std::size_t nn = static_cast<std::size_t>(n);
  std::vector<float> aq(nn * nn), qtq(nn * nn);
  gemm(false, false, n, n, n, 1.0f, a, n, q, n, 0.0f, aq.data(), n);
  for (std::size_t j = 0; j < nn; ++j)
    for (std::size_t i = 0; i < nn; ++i) aq[i + j * nn] -= q[i + j * nn] * w[j];
  gemm(true, false, n, n, n, 1.0f, q, n, q, n, 0.0f, qtq.data(), n);
  for (std::size_t i = 0; i < nn; ++i) qtq[i + i * nn] -= 1.0f;
  const std::vector<float> a_copy(a, a + nn * nn);
  return {frobenius(aq) / frobenius(a_copy), frobenius(qtq) / std::sqrt(static_cast<double>(n))};
}

double root_error(int n, const float* a, const float* r) {
  const std::size_t nn = static_cast<std::size_t>(n);
  std::vector<float> ar(nn * nn), rar(nn * nn);
  gemm(false, false, n, n, n, 1.0f, a, n, r, n, 0.0f, ar.data(), n);
  gemm(false, false, n, n, n, 1.0f, r, n, ar.data(), n, 0.0f, rar.data(), n);
  for (std::size_t i = 0; i < nn; ++i) rar[i + i * nn] -= 1.0f;
  return frobenius(rar) / std::sqrt(static_cast<double>(n));
}

// A = G G^T / n + I with G Gaussian: the eigenvectors (what the solvers work on) of a Gram
// matrix, with a spectrum in [1, 5] so that inverse_root's check is meaningful in float32.
std::vector<std::vector<float>> random_spd(int blocks, int n) {
  const std::size_t nn = static_cast<std::size_t>(n);
  std::vector<std::vector<float>> out(blocks);
  std::vector<float> g(nn * nn);
  std::mt19937 rng(12345);
  std::normal_distribution<float> normal;
  for (auto& a : out) {
    for (float& x : g) x = normal(rng);
    a.assign(nn * nn, 0.0f);
    asteria::linalg::syrk_lower(n, n, 1.0f / n, g.data(), n, 0.0f, a.data(), n);
    asteria::linalg::symmetrize_from_lower(n, a.data(), n);
    for (std::size_t i = 0; i < nn; ++i) a[i + i * nn] += 1.0f;
  }
  return out;
}

struct Result {
  double blocks_per_second, resid, orth;
};

enum class Check { kEigen, kRoot, kNone };

// Runs `variant` over all blocks on `threads` threads; block b goes to thread b % threads.
Result measure(const Variant& variant, Check kind, int n, int threads,
               const std::vector<std::vector<float>>& blocks) {
  const std::size_t nn = static_cast<std::size_t>(n);
  std::vector<std::vector<float>> q(threads, std::vector<float>(nn * nn));
  std::vector<std::vector<float>> w(threads, std::vector<float>(nn));
  std::barrier sync(threads + 1);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      Scratch scratch;
      variant(n, blocks[t % blocks.size()].data(), q[t].data(), w[t].data(), scratch);  // warm-up
      sync.arrive_and_wait();
      for (std::size_t b = t; b < blocks.size(); b += threads) {
        variant(n, blocks[b].data(), q[t].data(), w[t].data(), scratch);
      }
    });
  }
  sync.arrive_and_wait();
  const auto start = std::chrono::steady_clock::now();
  for (auto& thread : pool) thread.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  Scratch scratch;
  variant(n, blocks[0].data(), q[0].data(), w[0].data(), scratch);
  Result result{blocks.size() / seconds, NAN, NAN};
  if (kind == Check::kRoot) {
    result.resid = root_error(n, blocks[0].data(), q[0].data());
  } else if (kind == Check::kEigen) {
    std::tie(result.resid, result.orth) = eigen_errors(n, blocks[0].data(), q[0].data(), w[0].data());
  }
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s B T [n ...]\n", argv[0]);
    return 2;
  }
  const int blocks = std::atoi(argv[1]), threads = std::atoi(argv[2]);
  std::vector<int> sizes;
  for (int i = 3; i < argc; ++i) sizes.push_back(std::atoi(argv[i]));
  if (sizes.empty()) sizes = {1024, 2048};
  openblas_set_num_threads(1);

  const asteria::linalg::RootSpec spec{.exponent = -0.5, .eps = 1e-6, .scale = 1.0};
  const std::vector<std::pair<std::string, Variant>> variants = {
      {"syevd fresh workspace",
       [](int n, const float* a, float* q, float* w, Scratch&) {
         Scratch fresh;
         syevd_into(n, a, q, w, fresh);
       }},
      {"syevd reused workspace", syevd_into},
      {"syevr (MRRR)", syevr_into},
      {"sytrd+orgtr+stedc(V)", orgtr_stedc_into},
      {"sytrd+stedc+larfb nb=128",
       [](int n, const float* a, float* q, float* w, Scratch& s) { wide_backtransform_into(n, a, q, w, s, 128); }},
      {"eigh", eigh_into},
      {"inverse_root(-1/2)",
       [&spec](int n, const float* a, float* r, float*, Scratch&) {
         asteria::linalg::inverse_root(n, a, n, r, n, spec);
       }},
      {"phase: ssytrd", sytrd_copy_into},
      {"phase: ssytrd_2stage", sytrd_2stage_into},
      {"phase: gemm n^3",
       [](int n, const float* a, float* q, float*, Scratch&) {
         gemm(false, false, n, n, n, 1.0f, a, n, a, n, 0.0f, q, n);
       }},
  };

  std::printf("OpenBLAS core: %s (OPENBLAS_CORETYPE=%s)\n", openblas_get_corename(),
              std::getenv("OPENBLAS_CORETYPE") ? std::getenv("OPENBLAS_CORETYPE") : "");
  std::printf("%-28s %5s %3s %4s %9s %9s %9s\n", "variant", "n", "T", "B", "blocks/s", "resid", "orth");
  for (int n : sizes) {
    const auto data = random_spd(blocks, n);
    for (const auto& [name, variant] : variants) {
      const Check kind = name.rfind("inverse_root", 0) == 0 ? Check::kRoot
                         : name.rfind("phase:", 0) == 0   ? Check::kNone
                                                          : Check::kEigen;
      const Result r = measure(variant, kind, n, threads, data);
      std::printf("%-28s %5d %3d %4d %9.2f %9.2e %9.2e\n", name.c_str(), n, threads, blocks, r.blocks_per_second,
                  r.resid, r.orth);
      std::fflush(stdout);
    }
  }
  return 0;
}
