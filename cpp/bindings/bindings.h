// One init function per concern of the core; module.cpp calls them in order.
#pragma once

#include <nanobind/nanobind.h>

namespace asteria::bindings {

void init_errors(nanobind::module_& m);
void init_runtime(nanobind::module_& m);
void init_linalg(nanobind::module_& m);
void init_pager(nanobind::module_& m);
void init_node_store(nanobind::module_& m);

}  // namespace asteria::bindings
