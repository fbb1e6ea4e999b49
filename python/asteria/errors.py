"""Exceptions raised by Asteria. C++ errors are mapped in one place (cpp/bindings/errors.cpp)."""

from __future__ import annotations

from asteria._core import BlockFailure, BlockTimeout, CancelledError, NumericalError

__all__ = ["BlockFailure", "BlockTimeout", "CancelledError", "NumericalError", "RefreshError", "NonFiniteGradientError",
           "RefreshBacklogWarning", "StateLostError"]


class RefreshError(RuntimeError):
    """A preconditioner block kept failing its refresh; names the parameter, the block and the cause.

    The last good preconditioner stayed in use until the bound was reached; no state was changed by
    the ``step()`` that raised.
    """

    def __init__(self, param: str, factor: str, version: int, cause: str) -> None:
        super().__init__(f"refresh of {factor} of parameter {param!r} failed (version {version}): {cause}")
        self.param = param
        self.factor = factor
        self.version = version
        self.cause = cause


class StateLostError(RuntimeError):
    """State the optimizer needs to go on exactly is gone (the newest preconditioners of a set on the NVMe tier
    failed their checksum, and only an older version is readable): every later step raises this too, rather
    than quietly leave the trajectory. Recover by loading the last ``state_dict()`` into a new optimizer."""


class NonFiniteGradientError(FloatingPointError):
    """A parameter's gradient held NaN/Inf, or values whose squares overflow float32 (policy ``raise``, or
    too many skipped steps in a row)."""

    def __init__(self, param: str, detail: str) -> None:
        super().__init__(f"non-finite gradient for parameter {param!r}: {detail}")
        self.param = param


class RefreshBacklogWarning(RuntimeWarning):
    """The CPU workers do not keep up with the refresh schedule: after each factor set's first refresh,
    ``step()`` waited for them at least twice, for at least 5% of the training time (with staleness
    S >= 1, where waiting is not the design). Issued once per optimizer, with the waits, the workers'
    busy fraction and what to change."""
