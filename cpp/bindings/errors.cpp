// The one place that maps the core's C++ exceptions to Python exceptions.
#include <Python.h>
#include <nanobind/stl/string.h>

#include <string>

#include "asteria/common/errors.h"
#include "bindings.h"

namespace nb = nanobind;

namespace asteria::bindings {

namespace {

PyObject* g_cancelled = nullptr;
PyObject* g_numerical = nullptr;
PyObject* g_block_failure = nullptr;
PyObject* g_pager_io = nullptr;
PyObject* g_checksum = nullptr;
PyObject* g_block_timeout = nullptr;

PyObject* new_exception(nb::module_& m, const char* name, PyObject* base, const char* doc) {
  const std::string qualified = std::string("asteria._core.") + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, base, nullptr);
  if (type == nullptr) throw nb::python_error();
  m.attr(name) = nb::handle(type);
  return type;
}

// Raises `type` (an OSError subclass) as type(errno, message) with filename, offset and size set.
void set_pager_error(PyObject* type, const PagerIOError& e) {
  nb::object error = nb::steal(PyObject_CallFunction(type, "is", e.error_number(), e.what()));
  if (!error.is_valid()) return;  // the call set its own error
  error.attr("filename") = e.path();
  error.attr("offset") = e.offset();
  error.attr("size") = e.size();
  PyErr_SetObject(type, error.ptr());
}

}  // namespace

std::chrono::nanoseconds seconds_arg(double seconds, const char* name, bool zero_allowed) {
  if (!(zero_allowed ? seconds >= 0.0 : seconds > 0.0) || !(seconds <= 1e9)) {
    throw InvalidArgument(std::string("Invalid ") + name + "=" + std::to_string(seconds) +
                          ": must be a number of seconds in " + (zero_allowed ? "[0" : "(0") + ", 1e9]" +
                          (zero_allowed ? " (0 turns it off)" : ""));
  }
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(seconds));
}

void init_errors(nb::module_& m) {
  g_cancelled = new_exception(m, "CancelledError", PyExc_RuntimeError,
                              "A job was cancelled because its engine or pool shut down.");
  g_numerical = new_exception(m, "NumericalError", PyExc_ArithmeticError,
                              "A numerical routine failed or met non-finite values.");
  g_block_failure = new_exception(m, "BlockFailure", PyExc_RuntimeError,
                                  "A preconditioner block failed its refresh too often in a row. "
                                  "args = (message, block, version, cause).");
  g_pager_io = new_exception(m, "PagerIOError", PyExc_OSError,
                             "An I/O operation of the NVMe pager failed (ENOSPC, EFBIG, EIO, a removed file, a short "
                             "read). errno, strerror (the full message), filename (the page file), offset and size "
                             "(bytes) name it.");
  g_checksum = new_exception(m, "ChecksumError", g_pager_io,
                             "A page read back by the NVMe pager failed validation (header or payload CRC32C, wrong "
                             "key, version or slot size). Same attributes as PagerIOError (errno EBADMSG).");
  g_block_timeout = new_exception(m, "BlockTimeout", PyExc_TimeoutError,
                                  "The activation barrier's bounded wait for a block's version ran out. "
                                  "Attributes: block, version.");
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const BlockFailure& e) {
      nb::object args = nb::make_tuple(e.what(), e.block(), e.version(), e.cause());
      PyErr_SetObject(g_block_failure, args.ptr());
    } catch (const ChecksumError& e) {
      set_pager_error(g_checksum, e);
    } catch (const PagerIOError& e) {
      set_pager_error(g_pager_io, e);
    } catch (const NotFound& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    } catch (const BlockTimeout& e) {
      // An OSError subclass reads three args as (errno, strerror, filename): attributes instead.
      nb::object error = nb::borrow(g_block_timeout)(e.what());
      error.attr("block") = e.block();
      error.attr("version") = e.version();
      PyErr_SetObject(g_block_timeout, error.ptr());
    } catch (const InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const TimeoutError& e) {
      PyErr_SetString(PyExc_TimeoutError, e.what());
    } catch (const CancelledError& e) {
      PyErr_SetString(g_cancelled, e.what());
    } catch (const NumericalError& e) {
      PyErr_SetString(g_numerical, e.what());
    }
  });
}

}  // namespace asteria::bindings
