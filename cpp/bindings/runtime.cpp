// Bindings of the refresh engine (runtime + store + coherence as one object for Python).
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cmath>
#include <string>

#include "asteria/common/errors.h"
#include "asteria/runtime/blas_threads.h"
#include "asteria/runtime/refresh_engine.h"
#include "bindings.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace asteria::bindings {

namespace {

using runtime::RefreshEngine;
using Ring = nb::ndarray<float, nb::ndim<3>, nb::device::cpu>;
using AnyRing = nb::ndarray<float, nb::device::cpu>;

std::string shape_text(const Ring& ring) {
  return "(" + std::to_string(ring.shape(0)) + ", " + std::to_string(ring.shape(1)) + ", " +
         std::to_string(ring.shape(2)) + ")";
}

// Checks that `ring` is (depth, n + extra_rows, n) with contiguous rows and columns, and returns the
// stride between its buffers in elements. `expected` describes the shape for the message.
std::int64_t ring_stride(const Ring& ring, const char* name, std::size_t extra_rows, const std::string& expected) {
  const auto depth = ring.shape(0), rows = ring.shape(1), cols = ring.shape(2);
  if (rows != cols + extra_rows || cols == 0 || depth == 0) {
    throw InvalidArgument(std::string("Invalid ") + name + " shape " + shape_text(ring) + ": must be " + expected +
                          " with depth, n >= 1");
  }
  if (ring.stride(2) != 1 || ring.stride(1) != static_cast<std::int64_t>(cols)) {
    throw InvalidArgument(std::string("Invalid ") + name + " strides (" + std::to_string(ring.stride(0)) + ", " +
                          std::to_string(ring.stride(1)) + ", " + std::to_string(ring.stride(2)) +
                          "): each buffer must be contiguous");
  }
  return ring.stride(0);
}

nb::dict pool_dict(const runtime::PoolStats& s) {
  nb::dict d;
  d["workers"] = s.workers;
  d["submitted"] = s.submitted;
  d["completed"] = s.completed;
  d["failed"] = s.failed;
  d["cancelled"] = s.cancelled;
  d["queue_depth"] = s.queue_depth;
  d["max_queue_depth"] = s.max_queue_depth;
  d["busy_seconds"] = s.busy_seconds;
  d["express_workers"] = s.express_workers;
  d["express_busy_seconds"] = s.express_busy_seconds;
  d["wall_seconds"] = s.wall_seconds;
  d["busy_fraction"] = s.wall_seconds > 0 && s.workers > 0 ? s.busy_seconds / (s.wall_seconds * s.workers) : 0.0;
  d["mean_latency_seconds"] = s.mean_latency_seconds;
  d["max_latency_seconds"] = s.max_latency_seconds;
  d["mean_run_seconds"] = s.mean_run_seconds;
  d["max_run_seconds"] = s.max_run_seconds;
  d["cheap_ended"] = s.cheap_ended;
  d["cheap_mean_latency_seconds"] = s.cheap_mean_latency_seconds;
  d["cheap_mean_run_seconds"] = s.cheap_mean_run_seconds;
  return d;
}

nb::dict registry_dict(const coherence::RegistryStats& s) {
  nb::dict d;
  d["activations"] = s.activations;
  d["waits"] = s.waits;
  d["wait_seconds"] = s.wait_seconds;
  d["max_wait_seconds"] = s.max_wait_seconds;
  d["failures"] = s.failures;
  d["skipped_versions"] = s.skipped_versions;
  d["superseded_versions"] = s.superseded_versions;
  d["staleness_histogram"] = s.staleness_histogram;
  d["max_staleness_seen"] = s.max_staleness_seen;
  return d;
}

}  // namespace

void init_runtime(nb::module_& m) {
  m.def("set_blas_threads", &runtime::set_blas_threads, "threads"_a,
        "Sets the thread count of the BLAS library the core links (OpenBLAS).");
  m.def("blas_threads", &runtime::blas_threads, "The BLAS library's current thread count.");
  m.def("blas_core", &runtime::blas_core,
        "The CPU kernel family OpenBLAS dispatches to; 'Prescott' on a modern CPU means slow generic kernels "
        "(set OPENBLAS_CORETYPE before import to override).");

  nb::class_<RefreshEngine>(m, "RefreshEngine",
                            "Computes inverse roots (or SOAP eigenbases) of snapshotted factor matrices on C++ worker "
                            "threads and "
                            "decides, by a deterministic or bounded-staleness schedule, which version each "
                            "block uses at each step. Memory is owned by the caller (pinned torch tensors) "
                            "and must outlive close().")
      .def(
          "__init__",
          [](RefreshEngine* self, int workers, int blas_threads, int staleness, bool deterministic,
             int max_consecutive_failures, double slot_timeout_s, int worker_nice, std::vector<int> worker_cpus,
             int sync_versions, const std::string& queue_order, int express_workers, int express_max_n) {
            runtime::EngineConfig config;
            if (queue_order == "shortest") {
              config.queue_order = runtime::QueueOrder::kShortest;
            } else if (queue_order != "deadline") {
              throw InvalidArgument("Invalid queue_order='" + queue_order + "': must be 'deadline' or 'shortest'");
            }
            config.workers = workers;
            config.express_workers = express_workers;
            config.express_max_n = express_max_n;
            config.worker_nice = worker_nice;
            config.worker_cpus = std::move(worker_cpus);
            config.blas_threads = blas_threads;
            config.registry.staleness = staleness;
            config.registry.deterministic = deterministic;
            config.registry.max_consecutive_failures = max_consecutive_failures;
            config.registry.sync_versions = sync_versions;
            config.slot_timeout = seconds_arg(slot_timeout_s, "slot_timeout_s");
            new (self) RefreshEngine(config);
          },
          "workers"_a, "blas_threads"_a = 1, "staleness"_a = 5, "deterministic"_a = true,
          "max_consecutive_failures"_a = 3, "slot_timeout_s"_a = 300.0, "worker_nice"_a = 10,
          "worker_cpus"_a = std::vector<int>{}, "sync_versions"_a = 1, "queue_order"_a = "deadline",
          "express_workers"_a = 0, "express_max_n"_a = 0)
      .def(
          "add_block",
          [](RefreshEngine& e, AnyRing snapshots, Ring results, const std::string& kind,
             const std::string& first_basis) {
            runtime::BlockMemory memory;
            std::size_t extra_rows = 0;
            if (kind == "eigenbasis") {
              memory.kind = runtime::RefreshKind::kEigenbasis;
              extra_rows = 2;
            } else if (kind != "root") {
              throw InvalidArgument("Invalid kind='" + kind + "': must be 'root' or 'eigenbasis'");
            }
            if (first_basis != "eigh" && first_basis != "qr") {
              throw InvalidArgument("Invalid first_basis='" + first_basis + "': must be 'eigh' or 'qr'");
            }
            if (first_basis == "qr" && kind != "eigenbasis") {
              throw InvalidArgument("Invalid first_basis='qr' for kind='" + kind +
                                    "': only an eigenbasis block has a first basis");
            }
            memory.first_from_identity = first_basis == "qr";
            const std::string expected = extra_rows == 0 ? "(depth, n, n)" : "(depth, n + 2, n)";
            memory.result_stride = ring_stride(results, "results", extra_rows, expected + " for kind='" + kind + "'");
            constexpr std::size_t kMaxSide = 1 << 20;  // (n * n and depth * stride stay far inside int64)
            if (results.shape(2) > kMaxSide || results.shape(0) > kMaxSide) {
              throw InvalidArgument("Invalid results shape " + shape_text(results) + ": n and depth must be <= " +
                                    std::to_string(kMaxSide));
            }
            memory.n = static_cast<int>(results.shape(2));
            memory.depth = static_cast<int>(results.shape(0));
            memory.packed = snapshots.ndim() == 2;
            const std::int64_t elements = runtime::snapshot_elements(memory.n, memory.packed);
            const std::string wanted = memory.packed ? "(depth, n (n + 1) / 2)" : "(depth, n, n)";
            const bool shape_ok = (snapshots.ndim() == 2 || snapshots.ndim() == 3) &&
                                  snapshots.shape(0) == results.shape(0) &&
                                  (memory.packed ? static_cast<std::int64_t>(snapshots.shape(1)) == elements
                                                 : snapshots.shape(1) == results.shape(2) &&
                                                       snapshots.shape(2) == results.shape(2));
            if (!shape_ok) {
              std::string shape = "(";
              for (std::size_t d = 0; d < snapshots.ndim(); ++d) {
                shape += (d ? ", " : "") + std::to_string(snapshots.shape(d));
              }
              throw InvalidArgument("Invalid snapshots shape " + shape + "): must be " + wanted + " = (" +
                                    std::to_string(results.shape(0)) + ", " +
                                    (memory.packed ? std::to_string(elements)
                                                   : std::to_string(memory.n) + ", " + std::to_string(memory.n)) +
                                    ") to match results " + shape_text(results) + " for kind='" + kind + "'");
            }
            const bool contiguous = memory.packed ? snapshots.stride(1) == 1
                                                  : snapshots.stride(2) == 1 && snapshots.stride(1) == memory.n;
            if (!contiguous) {
              throw InvalidArgument("Invalid snapshots strides: each buffer must be contiguous");
            }
            memory.snapshot_stride = snapshots.stride(0);
            memory.snapshots = static_cast<float*>(snapshots.data());
            memory.results = results.data();
            return e.add_block(memory);
          },
          "snapshots"_a.noconvert(), "results"_a.noconvert(), "kind"_a = "root", "first_basis"_a = "eigh",
          nb::keep_alive<1, 2>(), nb::keep_alive<1, 3>(),  // (the workers write there until the engine is gone)
          "Registers a block. `snapshots` is a float32 host array of `depth` buffers: (depth, n, n), or (depth, "
          "n (n + 1) / 2) holding each factor's lower triangle row by row (torch.tril_indices order; half the "
          "memory, unpacked by the worker). No converted copy is made: the engine reads and writes the caller's "
          "memory. `results` is (depth, n, n) for kind='root' (inverse roots) or (depth, n + 2, n) for "
          "kind='eigenbasis' (rows 0..n-1: the basis Q, vectors as columns; row n: eigenvalue estimates; row n + 1: "
          "the permutation of the previous basis's columns, as floats). Version v lives at index v % depth. "
          "`first_basis` (eigenbasis blocks): 'eigh', a full eigendecomposition for the block's first basis, or "
          "'qr', one warm-started QR step from the identity (Distributed Shampoo's rule). Returns the block id.")
      .def_prop_ro("num_blocks", &RefreshEngine::num_blocks)
      .def("block_dim", &RefreshEngine::block_dim, "block"_a)
      .def("depth", &RefreshEngine::depth, "block"_a)
      .def("start_at", &RefreshEngine::start_at, "blocks"_a, "version"_a,
           "Declares that versions before `version` will never be written (a resumed run starts there).")
      .def("skip", &RefreshEngine::skip, "blocks"_a, "version"_a,
           "Version `version` of `blocks` will never be snapshotted (a deferred refresh): the rings go on in order.")
      .def("resume_at", &RefreshEngine::resume_at, "blocks"_a, "versions"_a,
           "A resumed run uses versions[i] of blocks[i]: activations and staleness count from there.")
      .def(
          "begin_snapshot",
          [](RefreshEngine& e, const std::vector<std::int64_t>& blocks, std::int64_t version, double timeout_s) {
            e.begin_snapshot(blocks, version, seconds_arg(timeout_s, "timeout_s"));
          },
          "blocks"_a, "version"_a, "timeout_s"_a, nb::call_guard<nb::gil_scoped_release>(),
          "Claims the snapshot buffers of `version`, waiting (GIL released) for jobs still reading them. All or "
          "nothing: a claim that fails gives back those made before it.")
      .def("abandon_snapshot", &RefreshEngine::abandon_snapshot, "blocks"_a, "version"_a,
           "Gives back the snapshot buffers begin_snapshot claimed for `version` and that were not submitted.")
      .def(
          "submit",
          [](RefreshEngine& e, const std::vector<std::int64_t>& blocks, std::int64_t version,
             std::int64_t activation_step, double exponent, double eps, double scale, double skip_tol,
             double relative_eps) {
            e.submit(blocks, version, activation_step, linalg::RootSpec{exponent, eps, scale, relative_eps},
                     skip_tol);
          },
          "blocks"_a, "version"_a, "activation_step"_a, "exponent"_a, "eps"_a, "scale"_a = 1.0, "skip_tol"_a = 0.0,
          "relative_eps"_a = 0.0,
          nb::call_guard<nb::gil_scoped_release>(),
          "Publishes the filled snapshots and queues one refresh job per block, due at `activation_step`. "
          "Root blocks add eps + relative_eps * (the largest eigenvalue) to every eigenvalue. Eigenbasis blocks "
          "use `scale` and `skip_tol` only; their versions must be submitted in increasing order with "
          "non-decreasing activation steps, since each job warm-starts from the newest good basis before it (the "
          "first, with none, is a full eigendecomposition).")
      .def(
          "set_basis",
          [](RefreshEngine& e, std::int64_t block, std::int64_t version,
             nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> basis) {
            const auto n = static_cast<std::size_t>(e.block_dim(block));
            if (basis.shape(0) != n || basis.shape(1) != n) {
              throw InvalidArgument("Invalid basis shape (" + std::to_string(basis.shape(0)) + ", " +
                                    std::to_string(basis.shape(1)) + "): must be (n, n) = (" + std::to_string(n) +
                                    ", " + std::to_string(n) + ")");
            }
            e.set_basis(block, version, basis.data());
          },
          "block"_a, "version"_a, "basis"_a,
          "Seeds an eigenbasis block's warm-start chain with the good basis (n, n) of `version` (copied), e.g. the "
          "basis in use when a run resumes; the next submitted version warm-starts from it.")
      .def("seed_basis", &RefreshEngine::seed_basis, "block"_a, "version"_a, "next"_a,
           "set_basis() without the copy: the good basis of `version` lies in rows [0, n) of the block's result "
           "buffer of version `next`, which the caller fills before it submits `next`, the block's next version; "
           "that job takes it into the chain on its worker (and fails if it is not finite).")
      .def("chain_busy", &RefreshEngine::chain_busy, "block"_a,
           "Whether the block's newest eigenbasis job has not ended (set_basis() and seed_basis() would refuse); False "
           "for a root block.")
      .def(
          "activate",
          [](RefreshEngine& e, std::int64_t step, double timeout_s) {
            std::vector<std::tuple<std::int64_t, std::int64_t>> out;
            for (const auto& a : e.activate(step, seconds_arg(timeout_s, "timeout_s"))) out.emplace_back(a.block, a.version);
            return out;
          },
          "step"_a, "timeout_s"_a, nb::call_guard<nb::gil_scoped_release>(),
          "Returns [(block, version)] for blocks whose version changes at `step`, waiting (bounded, GIL released) "
          "for versions the schedule requires. Each returned version is pinned until release().")
      .def("release", &RefreshEngine::release, "block"_a, "version"_a,
           "Unpins a version returned by activate() once it has been copied.")
      .def("note_external", &RefreshEngine::note_external, "blocks"_a, "version"_a, "activation_step"_a,
           "Version `version` of `blocks` is computed outside the engine (e.g. on the GPU), due at "
           "`activation_step`: the registry tracks it like the workers' own (activation, staleness, bounded wait). "
           "An eigenbasis block's chain then needs set_basis() or seed_basis() before its next submit().")
      .def("finish_external", &RefreshEngine::finish_external, "blocks"_a, "version"_a, "ok"_a, "error"_a = "",
           nb::call_guard<nb::gil_scoped_release>(),
           "The external `version` of `blocks` ended; ok[i] says whether blocks[i]'s result is usable.")
      .def(
          "drain", [](RefreshEngine& e, double timeout_s) { e.drain(seconds_arg(timeout_s, "timeout_s")); },
          "timeout_s"_a, nb::call_guard<nb::gil_scoped_release>(), "Waits for every submitted job to end.")
      .def("close", &RefreshEngine::close, nb::call_guard<nb::gil_scoped_release>(),
           "Cancels queued jobs, waits for running ones and stops the workers. Idempotent.")
      .def_prop_ro("closed", &RefreshEngine::closed)
      .def(
          "inject_fault",
          [](RefreshEngine& e, std::int64_t block, std::optional<std::int64_t> version, const std::string& kind,
             double seconds) {
            runtime::FaultKind fault;
            if (kind == "throw") {
              fault = runtime::FaultKind::kThrow;
            } else if (kind == "nonfinite") {
              fault = runtime::FaultKind::kNonFinite;
            } else if (kind == "hang") {
              fault = runtime::FaultKind::kHang;
            } else if (kind == "delay") {
              fault = runtime::FaultKind::kDelay;
            } else if (kind == "pause") {
              fault = runtime::FaultKind::kPause;
            } else {
              throw InvalidArgument("Invalid kind='" + kind +
                                    "': must be 'throw', 'nonfinite', 'hang', 'delay' or 'pause'");
            }
            if (version && *version < 1) {
              throw InvalidArgument("Invalid version=" + std::to_string(*version) +
                                    ": must be >= 1, or None for every version");
            }
            std::chrono::nanoseconds duration{0};
            if (fault == runtime::FaultKind::kDelay || (fault == runtime::FaultKind::kHang && seconds != 0.0)) {
              duration = seconds_arg(seconds, "seconds");
            } else if (seconds != 0.0) {
              throw InvalidArgument("Invalid seconds=" + std::to_string(seconds) + " for kind='" + kind +
                                    "': only kinds 'delay' and 'hang' take seconds");
            }
            e.inject_fault(block, version.value_or(runtime::kAnyVersion), fault, duration);
          },
          "block"_a, "version"_a = nb::none(), "kind"_a = "throw", "seconds"_a = 0.0,
          "Test-only fault injection into the real worker job of (block, version); version=None hits every "
          "version of the block until clear_faults(). kind: 'throw' (the job raises inside its numerics), "
          "'nonfinite' (its result is poisoned with a NaN, which the quality gate rejects), 'hang' (it blocks "
          "until close(), or for `seconds` if given, then fails), 'delay' (it sleeps `seconds` first, cut short by "
          "close()), 'pause' (it waits until release_pauses()). A specific version's fault fires once.")
      .def(
          "set_random_delay",
          [](RefreshEngine& e, double max_delay_s, std::uint64_t seed) {
            e.set_random_delay(seconds_arg(max_delay_s, "max_delay_s", /*zero_allowed=*/true), seed);
          },
          "max_delay_s"_a, "seed"_a = 0,
          "Test-only: every job without an injected fault first sleeps a pseudo-random time in [0, max_delay_s), "
          "a function of (seed, block, version) only. 0 turns it off.")
      .def(
          "wait_paused",
          [](RefreshEngine& e, int count, double timeout_s) { e.wait_paused(count, seconds_arg(timeout_s, "timeout_s")); },
          "count"_a, "timeout_s"_a = 30.0, nb::call_guard<nb::gil_scoped_release>(),
          "Test-only: blocks until at least `count` jobs paused since the last release_pauses() wait in a 'pause' "
          "fault (TimeoutError after timeout_s).")
      .def("release_pauses", &RefreshEngine::release_pauses, "Test-only: lets every job paused by a 'pause' fault go on.")
      .def("clear_faults", &RefreshEngine::clear_faults,
           "Disarms every injected fault and the random delay.")
      .def(
          "status",
          [](const RefreshEngine& e, std::int64_t block) {
            const coherence::BlockStatus s = e.status(block);
            nb::dict d;
            d["active_version"] = s.active_version;
            d["newest_snapshot"] = s.newest_snapshot;
            d["newest_finished"] = s.newest_finished;
            d["newest_ok"] = s.newest_ok;
            d["consecutive_failures"] = s.consecutive_failures;
            d["total_failures"] = s.total_failures;
            d["last_error"] = s.last_error;
            return d;
          },
          "block"_a)
      .def("stats", [](const RefreshEngine& e) {
        const runtime::EngineStats s = e.stats();
        nb::dict d;
        d["pool"] = pool_dict(s.pool);
        d["registry"] = registry_dict(s.registry);
        d["refreshes_ok"] = s.refreshes_ok;
        d["refreshes_failed"] = s.refreshes_failed;
        d["float64_retries"] = s.float64_retries;
        d["refreshes_skipped"] = s.refreshes_skipped;
        d["refreshes_superseded"] = s.refreshes_superseded;
        d["snapshot_waits"] = s.snapshot_waits;
        d["snapshot_wait_seconds"] = s.snapshot_wait_seconds;
        d["refresh_seconds"] = s.refresh_seconds;
        d["faults_triggered"] = s.faults_triggered;
        nb::dict by_dim;
        for (const auto& [n, timing] : s.by_dim) {
          nb::dict t;
          t["seconds"] = timing.seconds;
          t["jobs"] = timing.jobs;
          by_dim[nb::int_(n)] = t;
        }
        d["by_dim"] = by_dim;
        d["external_versions"] = s.external_versions;
        return d;
      });
}

}  // namespace asteria::bindings
