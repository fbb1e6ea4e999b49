"""Names of the per-mode tensors in a shape group's state, shared by the three optimizers."""

from __future__ import annotations


def factor_key(mode: int) -> str:
    """The Kronecker factor of dimension ``mode``."""
    return f"factor_{mode}"


def root_key(mode: int) -> str:
    """Shampoo's inverse root of that factor."""
    return f"root_{mode}"


def has_root_key(mode: int) -> str:
    return f"has_root_{mode}"


def basis_key(mode: int) -> str:
    """SOAP's and KL-Shampoo's eigenbasis of that factor."""
    return f"basis_{mode}"


def has_basis_key(mode: int) -> str:
    return f"has_basis_{mode}"
