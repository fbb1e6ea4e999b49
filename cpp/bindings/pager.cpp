// Bindings of the NVMe pager (store/pager.h). Python owns the read-ahead buffers (a (k, m) host array,
// pinned torch memory on CUDA machines) and the sources of writes in flight; the binding keeps both
// alive until the pager no longer touches them.
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cmath>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>

#include "asteria/common/errors.h"
#include "asteria/store/pager.h"
#include "bindings.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace asteria::bindings {

namespace {

using store::Pager;
using HostArray = nb::ndarray<nb::c_contig>;
using ReadOnlyArray = nb::ndarray<nb::ro, nb::c_contig>;

std::uint64_t key_arg(std::int64_t key, const char* name) {
  if (key < 0) throw InvalidArgument(std::string("Invalid ") + name + "=" + std::to_string(key) + ": must be >= 0");
  return static_cast<std::uint64_t>(key);
}

template <typename Array>
void check_host(const Array& a, const char* name) {
  if (a.device_type() != nb::device::cpu::value && a.device_type() != nb::device::cuda_host::value) {
    throw InvalidArgument(std::string("Invalid ") + name + " on device type " + std::to_string(a.device_type()) +
                          ": must be host memory (CPU or pinned)");
  }
}

// The pager plus the Python objects whose memory it uses.
struct PyPager {
  std::unique_ptr<Pager> pager;
  HostArray buffers;                                         // the read-ahead pool
  std::unordered_map<Pager::Ticket, ReadOnlyArray> sources;  // write sources until waited for

  ~PyPager() {
    if (pager) pager->close();  // joins the I/O threads (they never take the GIL) before the memory goes
  }
};

nb::dict stats_dict(const store::PagerStats& s) {
  nb::dict d;
  d["mode"] = store::to_string(s.mode);
  d["io_threads"] = s.io_threads;
  d["record_bytes"] = s.record_bytes;
  d["slot_bytes"] = s.slot_bytes;
  d["keys"] = s.keys;
  d["reads"] = s.reads;
  d["writes"] = s.writes;
  d["bytes_read"] = s.bytes_read;
  d["bytes_written"] = s.bytes_written;
  d["read_errors"] = s.read_errors;
  d["write_errors"] = s.write_errors;
  d["checksum_failures"] = s.checksum_failures;
  d["read_ahead_hits"] = s.read_ahead_hits;
  d["read_ahead_misses"] = s.read_ahead_misses;
  d["cancelled"] = s.cancelled;
  d["read_seconds"] = s.read_seconds;
  d["write_seconds"] = s.write_seconds;
  d["acquire_wait_seconds"] = s.acquire_wait_seconds;
  d["recovered_keys"] = s.recovered_keys;
  d["recovered_bad_pages"] = s.recovered_bad_pages;
  d["queued"] = s.queued;
  return d;
}

}  // namespace

void init_pager(nb::module_& m) {
  nb::class_<PyPager>(m, "Pager",
                      "NVMe pager: versioned records (key, version, up to record_bytes bytes) in checksummed A/B "
                      "page files under `directory`, written and read by background I/O threads with O_DIRECT "
                      "(buffered I/O + fdatasync where the filesystem refuses it), read ahead in schedule order "
                      "into the caller's buffers. Errors surface at wait()/acquire()/read() as PagerIOError "
                      "(an OSError: errno, filename, offset, size) or ChecksumError; every wait is bounded and "
                      "releases the GIL.")
      .def(
          "__init__",
          [](PyPager* self, const std::string& directory, HostArray buffers, std::optional<std::int64_t> record_bytes,
             int io_threads, std::optional<bool> o_direct, bool keep_files) {
            check_host(buffers, "buffers");
            if (buffers.ndim() != 2 || buffers.shape(0) == 0 || buffers.shape(1) == 0) {
              std::string shape = "(";
              for (std::size_t i = 0; i < buffers.ndim(); ++i) {
                shape += (i ? ", " : "") + std::to_string(buffers.shape(i));
              }
              throw InvalidArgument("Invalid buffers shape " + shape + "): must be (k, m) with k, m >= 1");
            }
            const std::size_t row_bytes = buffers.shape(1) * buffers.itemsize();
            const std::int64_t record = record_bytes.value_or(static_cast<std::int64_t>(row_bytes));
            if (record < 1 || static_cast<std::size_t>(record) > row_bytes) {
              throw InvalidArgument("Invalid record_bytes=" + std::to_string(record) + ": must be in [1, " +
                                    std::to_string(row_bytes) + "] (a buffer row holds " + std::to_string(row_bytes) +
                                    " bytes)");
            }
            store::PagerConfig config;
            config.directory = directory;
            config.record_bytes = static_cast<std::size_t>(record);
            config.io_threads = io_threads;
            config.mode = !o_direct.has_value() ? store::IoModeRequest::kAuto
                          : *o_direct           ? store::IoModeRequest::kDirect
                                                : store::IoModeRequest::kBuffered;
            config.keep_files = keep_files;
            store::BufferPool pool{static_cast<std::byte*>(buffers.data()), buffers.shape(0), row_bytes};
            std::unique_ptr<Pager> pager;
            {
              nb::gil_scoped_release release;
              pager = std::make_unique<Pager>(config, pool);
            }
            auto* py = new (self) PyPager();
            py->pager = std::move(pager);
            py->buffers = buffers;
          },
          "directory"_a, "buffers"_a.noconvert(), "record_bytes"_a = nb::none(), "io_threads"_a = 2,
          "o_direct"_a = nb::none(), "keep_files"_a = false,
          "`buffers`: a C-contiguous (k, m) host array (any dtype; pinned torch memory on CUDA machines; never "
          "copied: a non-contiguous one is a TypeError) of k read-ahead buffers of m * itemsize bytes, kept alive "
          "by the pager. `record_bytes` (default: a row's "
          "bytes) is the largest payload. `o_direct`: None probes the directory and falls back to buffered I/O, "
          "True requires O_DIRECT, False uses buffered I/O + fdatasync. `keep_files`: False (a scratch tier) "
          "needs a directory without page files and removes the files it created at close(); True recovers "
          "existing pages and removes nothing.")
      .def(
          "write",
          [](PyPager& p, std::int64_t key, std::int64_t version, ReadOnlyArray src) {
            check_host(src, "src");
            if (version < 1) throw InvalidArgument("Invalid version=" + std::to_string(version) + ": must be >= 1");
            const std::uint64_t k = key_arg(key, "key");
            Pager::Ticket ticket;
            {
              nb::gil_scoped_release release;
              ticket = p.pager->write(k, static_cast<std::uint64_t>(version),
                                      static_cast<const std::byte*>(src.data()), src.nbytes());
            }
            p.sources.emplace(ticket, std::move(src));
            return ticket;
          },
          "key"_a, "version"_a, "src"_a,
          "Queues a write of `version` (> the key's live and queued versions) of `key` from the host array `src` "
          "(its raw bytes in C order, at most record_bytes; a non-contiguous array is copied first). Returns a "
          "ticket for wait(). The pager holds `src` until wait() has returned; do not modify it before then.")
      .def(
          "wait",
          [](PyPager& p, Pager::Ticket ticket, double timeout_s) {
            const auto timeout = seconds_arg(timeout_s, "timeout_s");
            std::exception_ptr error;
            bool timed_out = false;
            {
              nb::gil_scoped_release release;
              try {
                p.pager->wait(ticket, timeout);
              } catch (const TimeoutError&) {
                timed_out = true;
                error = std::current_exception();
              } catch (...) {
                error = std::current_exception();
              }
            }
            if (!timed_out) p.sources.erase(ticket);
            if (error) std::rethrow_exception(error);
          },
          "ticket"_a, "timeout_s"_a,
          "Waits (GIL released) for a write; raises its error (PagerIOError, ChecksumError, CancelledError) or "
          "TimeoutError (the ticket then stays valid).")
      .def(
          "read_ahead",
          [](PyPager& p, const std::vector<std::int64_t>& keys) {
            std::vector<std::uint64_t> k;
            k.reserve(keys.size());
            for (const auto key : keys) k.push_back(key_arg(key, "key"));
            nb::gil_scoped_release release;
            p.pager->read_ahead(k);
          },
          "keys"_a,
          "Appends `keys`, in the order they will be needed, to the read-ahead schedule; free buffers are filled "
          "in that order in the background. A key never written raises KeyError and nothing is scheduled.")
      .def(
          "acquire",
          [](PyPager& p, std::int64_t key, double timeout_s) {
            const auto timeout = seconds_arg(timeout_s, "timeout_s");
            const std::uint64_t k = key_arg(key, "key");
            nb::gil_scoped_release release;
            const store::Acquired a = p.pager->acquire(k, timeout);
            return std::make_tuple(a.index, a.version, a.bytes);
          },
          "key"_a, "timeout_s"_a,
          "Waits (GIL released) for the earliest scheduled read of `key` (one not scheduled is read next) and "
          "returns (buffer_index, version, nbytes); the buffer row is the caller's until release(). Raises the "
          "read's error (PagerIOError, ChecksumError, KeyError if no readable version is left) or TimeoutError.")
      .def(
          "release", [](PyPager& p, std::int64_t index) {
            if (index < 0) throw InvalidArgument("Invalid index=" + std::to_string(index) + ": must be >= 0");
            p.pager->release(static_cast<std::size_t>(index));
          },
          "index"_a, "Returns buffer `index` (from acquire()) to the read-ahead pool.")
      .def("cancel_read_ahead", [](PyPager& p) { p.pager->cancel_read_ahead(); },
           "Drops the schedule and frees loaded buffers not yet acquired (held buffers stay held).")
      .def(
          "read",
          [](PyPager& p, std::int64_t key, HostArray dst, double timeout_s) {
            check_host(dst, "dst");
            const auto timeout = seconds_arg(timeout_s, "timeout_s");
            const std::uint64_t k = key_arg(key, "key");
            nb::gil_scoped_release release;
            const store::ReadResult r = p.pager->read(k, static_cast<std::byte*>(dst.data()), dst.nbytes(), timeout);
            return std::make_tuple(r.version, r.bytes);
          },
          "key"_a, "dst"_a.noconvert(), "timeout_s"_a,
          "Reads the newest version of `key` into the C-contiguous host array `dst` (never copied; GIL released), "
          "bypassing the read-ahead pool. Returns (version, nbytes).")
      .def(
          "drain",
          [](PyPager& p, double timeout_s) {
            const auto timeout = seconds_arg(timeout_s, "timeout_s");
            nb::gil_scoped_release release;
            p.pager->drain(timeout);
          },
          "timeout_s"_a, "Waits (GIL released) until every queued write and read has finished.")
      .def(
          "close",
          [](PyPager& p) {
            {
              nb::gil_scoped_release release;
              p.pager->close();
            }
            p.sources.clear();
          },
          "Cancels queued requests, waits for the ones in flight, stops the I/O threads and, unless keep_files, "
          "removes the files it created (and the directory if it created it). Idempotent.")
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__",
           [](PyPager& p, nb::handle, nb::handle, nb::handle) {
             {
               nb::gil_scoped_release release;
               p.pager->close();
             }
             p.sources.clear();
           },
           nb::arg().none(), nb::arg().none(), nb::arg().none())
      .def_prop_ro("closed", [](const PyPager& p) { return p.pager->closed(); })
      .def_prop_ro("mode", [](const PyPager& p) { return std::string(store::to_string(p.pager->mode())); },
                   "'o_direct' or 'buffered': the I/O mode in use.")
      .def_prop_ro("record_bytes", [](const PyPager& p) { return p.pager->record_bytes(); })
      .def_prop_ro("slot_bytes", [](const PyPager& p) { return p.pager->slot_bytes(); },
                   "Bytes per slot on disk: 64 + record_bytes rounded up to 4096.")
      .def_prop_ro("num_buffers", [](const PyPager& p) { return p.pager->buffer_count(); })
      .def_prop_ro("directory", [](const PyPager& p) { return p.pager->directory(); })
      .def(
          "version", [](const PyPager& p, std::int64_t key) { return p.pager->version(key_arg(key, "key")); }, "key"_a,
          "The live (readable) version of `key`, or None.")
      .def("keys", [](const PyPager& p) { return p.pager->keys(); }, "Every key written (sorted).")
      .def(
          "path_of", [](const PyPager& p, std::int64_t key) { return p.pager->path_of(key_arg(key, "key")); }, "key"_a,
          "The page file of `key`.")
      .def("stats", [](const PyPager& p) { return stats_dict(p.pager->stats()); },
           "Counters: mode, reads/writes, bytes_read/bytes_written (device bytes), read/write errors, "
           "checksum_failures, read_ahead_hits/misses, I/O seconds, acquire wait seconds, recovery counts.");
}

}  // namespace asteria::bindings
