#include "bindings.h"

NB_MODULE(_core, m) {
  m.doc() =
      "Asteria's C++ core: worker pool, LAPACK numerics, versioned host store, NVMe pager and coherence registry. "
      "It knows nothing of torch; arrays cross as DLPack, and every blocking call releases the GIL.";
  asteria::bindings::init_errors(m);
  asteria::bindings::init_runtime(m);
  asteria::bindings::init_linalg(m);
  asteria::bindings::init_pager(m);
  asteria::bindings::init_node_store(m);
}
