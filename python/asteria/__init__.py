"""Asteria: second-order optimizers (Shampoo, SOAP, KL-Shampoo) whose O(N^3) state maintenance runs
off the GPU's critical path, on C++ workers with bounded staleness."""

from asteria.config import MemoryConfig, RuntimeConfig
from asteria.errors import NonFiniteGradientError, RefreshBacklogWarning, RefreshError
from asteria.hooks import AttachHandle, attach
from asteria.optim import SOAP, KLShampoo, Shampoo
from asteria.pipeline.streams import training_stream

__all__ = ["AttachHandle", "KLShampoo", "MemoryConfig", "NonFiniteGradientError", "RefreshBacklogWarning",
           "RefreshError", "RuntimeConfig", "SOAP", "Shampoo", "attach", "training_stream"]
__version__ = "0.1.0"
