"""The Asteria optimizers: torch.optim.Optimizer subclasses over one refresh runtime."""

from asteria.optim.shampoo import Shampoo

__all__ = ["Shampoo"]
