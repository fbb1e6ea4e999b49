"""The Asteria optimizers: torch.optim.Optimizer subclasses over one refresh runtime."""

from asteria.optim.kl_shampoo import KLShampoo
from asteria.optim.shampoo import Shampoo
from asteria.optim.soap import SOAP

__all__ = ["KLShampoo", "SOAP", "Shampoo"]
