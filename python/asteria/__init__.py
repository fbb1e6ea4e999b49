"""Asteria: second-order optimizers (Shampoo, SOAP, KL-Shampoo) whose O(N^3) state maintenance runs
off the GPU's critical path, on C++ workers with bounded staleness."""

from asteria.blas import choose_kernels, warn_if_generic

choose_kernels()  # OpenBLAS's kernels, before the core loads it (asteria.blas)

from asteria import _core  # noqa: E402
from asteria.config import MemoryConfig, RuntimeConfig  # noqa: E402
from asteria.errors import NonFiniteGradientError, RefreshBacklogWarning, RefreshError  # noqa: E402
from asteria.hooks import AttachHandle, attach  # noqa: E402
from asteria.optim import SOAP, KLShampoo, Shampoo  # noqa: E402
from asteria.pipeline.streams import training_stream  # noqa: E402

warn_if_generic(_core.blas_core())  # where another library loaded OpenBLAS first
_core.simd_kernels()  # a bad ASTERIA_MAX_SIMD fails the import, not a worker's first job

__all__ = ["AttachHandle", "KLShampoo", "MemoryConfig", "NonFiniteGradientError", "RefreshBacklogWarning",
           "RefreshError", "RuntimeConfig", "SOAP", "Shampoo", "attach", "training_stream"]
__version__ = "0.1.0"
