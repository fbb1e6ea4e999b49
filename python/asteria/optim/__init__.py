"""The Asteria optimizers: torch.optim.Optimizer subclasses over one refresh runtime."""

from asteria.optim.shampoo import Shampoo
from asteria.optim.soap import SOAP

__all__ = ["SOAP", "Shampoo"]
