"""Asteria: second-order optimizers (Shampoo, SOAP, KL-Shampoo) whose O(N^3) state maintenance runs
off the GPU's critical path, on C++ workers with bounded staleness."""

from asteria.config import MemoryConfig, RuntimeConfig
from asteria.errors import NonFiniteGradientError, RefreshError
from asteria.optim import SOAP, KLShampoo, Shampoo

__all__ = ["KLShampoo", "MemoryConfig", "NonFiniteGradientError", "RefreshError", "RuntimeConfig", "SOAP", "Shampoo"]
__version__ = "0.1.0"
