// One init function per concern of the core; module.cpp calls them in order.
#pragma once

#include <nanobind/nanobind.h>

#include <chrono>

namespace asteria::bindings {

// A wait of `seconds` named `name` in errors: a number in (0, 1e9] ([0, 1e9] with `zero_allowed`). The core's
// clocks count int64 nanoseconds, and a deadline adds the wait to the clock's now: beyond that the conversion
// would overflow (asteria.config's MAX_TIMEOUT_S is 1e7).
std::chrono::nanoseconds seconds_arg(double seconds, const char* name, bool zero_allowed = false);

void init_errors(nanobind::module_& m);
void init_runtime(nanobind::module_& m);
void init_linalg(nanobind::module_& m);
void init_pager(nanobind::module_& m);
void init_node_store(nanobind::module_& m);

}  // namespace asteria::bindings
