// Bindings of the node-shared store (store/node_store.h).
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cmath>
#include <string>

#include "asteria/common/errors.h"
#include "asteria/store/node_store.h"
#include "bindings.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace asteria::bindings {

namespace {

using store::NodeStore;
using store::Published;
using store::VersionStatus;

VersionStatus status_arg(const std::string& status) {
  if (status == "ok") return VersionStatus::kOk;
  if (status == "failed") return VersionStatus::kFailed;
  if (status == "skipped") return VersionStatus::kSkipped;
  throw InvalidArgument("Invalid status='" + status + "': must be 'ok', 'failed' or 'skipped'");
}

std::tuple<std::int64_t, std::string, int> word(const Published& p) {
  return {p.version, store::to_string(p.status), p.good_slot};
}

}  // namespace

void init_node_store(nb::module_& m) {
  nb::class_<NodeStore>(m, "NodeStore",
                        "One host copy of the preconditioner versions for all local ranks of a node, in POSIX "
                        "shared memory: two slots of `capacity` floats per block and one version word per block "
                        "(atomic, release/acquire), so that a rank sees another's published version with no "
                        "message. Every wait is bounded and ends early when a local rank's process has exited.")
      .def_static("create", &NodeStore::create, "name"_a, "local_ranks"_a, "capacities"_a,
                  "Creates and initializes the segment `name` ('/...', must not exist).")
      .def_static("open", &NodeStore::open, "name"_a, "local_ranks"_a, "capacities"_a,
                  "Maps the existing segment `name`, checking its layout.")
      .def_static("private_memory", &NodeStore::private_memory, "capacities"_a,
                  "The same store over private memory, for a node of one rank.")
      .def_static("exists", &NodeStore::exists, "name"_a, "Whether a segment of that name exists.")
      .def("unlink", &NodeStore::unlink, "Removes the segment's name (the mapping stays). Idempotent.")
      .def_prop_ro("name", &NodeStore::name)
      .def_prop_ro("num_blocks", &NodeStore::num_blocks)
      .def_prop_ro("local_ranks", &NodeStore::local_ranks)
      .def_prop_ro("bytes", &NodeStore::bytes)
      .def("capacity", &NodeStore::capacity, "block"_a)
      .def("offset", &NodeStore::offset, "block"_a, "slot"_a,
           "Offset in floats of a block's slot (0 or 1) within data().")
      .def(
          "data",
          [](nb::handle self) {
            NodeStore& s = nb::cast<NodeStore&>(self);
            const std::size_t shape[1] = {static_cast<std::size_t>(s.data_floats())};
            return nb::ndarray<nb::numpy, float, nb::ndim<1>>(s.data(), 1, shape, self);
          },
          "The data region (every block's two slots) as a float32 array over the mapping; it keeps the store "
          "alive.")
      .def("register_rank", &NodeStore::register_rank, "local_rank"_a, "pid"_a,
           "Records this process as `local_rank`, for the liveness checks of waits.")
      .def(
          "published", [](const NodeStore& s, std::int64_t block) { return word(s.published(block)); }, "block"_a,
          "(version, status, good_slot) of `block`: status 'none', 'ok', 'failed' or 'skipped'.")
      .def("write_slot", &NodeStore::write_slot, "block"_a, "The slot an ok version of `block` is written into.")
      .def(
          "write",
          [](NodeStore& s, std::int64_t block, int slot,
             nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu> source, int threads) {
            nb::gil_scoped_release release;
            s.write(block, slot, source.data(), static_cast<std::int64_t>(source.shape(0)), threads);
          },
          "block"_a, "slot"_a, "source"_a, "threads"_a,
          "Copies the float32 vector `source` to the start of a block's slot, over `threads` threads (the "
          "caller's among them; GIL released).")
      .def(
          "publish",
          [](NodeStore& s, std::int64_t block, std::int64_t version, const std::string& status) {
            s.publish(block, version, status_arg(status));
          },
          "block"_a, "version"_a, "status"_a,
          "Publishes `version` of `block` as 'ok' (written into write_slot(block)), 'failed' or 'skipped'.")
      .def(
          "wait",
          [](NodeStore& s, const std::vector<std::int64_t>& blocks, const std::vector<std::int64_t>& versions,
             double timeout_s) {
            const auto timeout = seconds_arg(timeout_s, "timeout_s");
            std::vector<Published> seen;
            {
              nb::gil_scoped_release release;
              seen = s.wait(blocks, versions, timeout);
            }
            std::vector<std::tuple<std::int64_t, std::string, int>> out;
            out.reserve(seen.size());
            for (const Published& p : seen) out.push_back(word(p));
            return out;
          },
          "blocks"_a, "versions"_a, "timeout_s"_a,
          "Waits (GIL released, bounded) until each block has published at least its version; returns their "
          "(version, status, good_slot).")
      .def("mark_done", &NodeStore::mark_done, "local_rank"_a, "step"_a,
           "`local_rank` has read every version due up to `step`.")
      .def("done", &NodeStore::done, "local_rank"_a)
      .def(
          "wait_done",
          [](NodeStore& s, std::int64_t step, double timeout_s) {
            s.wait_done(step, seconds_arg(timeout_s, "timeout_s"));
          },
          "step"_a, "timeout_s"_a, nb::call_guard<nb::gil_scoped_release>(),
          "Waits (GIL released, bounded) until every local rank has marked `step` done.")
      .def("stats", [](const NodeStore& s) {
        const store::NodeStoreStats st = s.stats();
        nb::dict d;
        d["waits"] = st.waits;
        d["wait_seconds"] = st.wait_seconds;
        d["max_wait_seconds"] = st.max_wait_seconds;
        d["published"] = st.published;
        return d;
      });
}

}  // namespace asteria::bindings
