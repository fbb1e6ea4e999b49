"""What a late root costs native Shampoo, and whether re-estimating its eigenvalues at install removes
that cost: native Shampoo (``asteria bench``'s ``shampoo-sync`` run, GPU eigh) whose refreshes after the
first ``--aligned`` are installed ``--lag`` steps after their snapshot, as Asteria's deterministic rule
does, optionally with each root rebuilt at install from its snapshot's eigenvectors Q and the eigenvalue
estimates diag(Q^T F Q) of the factor F as it is then (``--correct``; under ``asteria bench``'s hooks a
version due at a step that refreshes nothing is installed at the end of that step's forward, so F holds the
gradients up to the step before). ``--lag 0`` installs through the same path at the snapshot's own step,
which is native itself, bit for bit.

Every other option goes to ``asteria bench`` unchanged, so a run pairs bit for bit, up to the first late
install, with a native run of the same seed and settings.

Run:  python3 bench/shampoo_lag_sim.py --lag 2 --correct -- --model olmo-160m ... --configs shampoo-sync

Measured on the H200 (docs/results.md, twenty-first session): the correction makes a 2-step delay far
worse, +11% in validation loss against +2.0% without it on the same four seeds, so Asteria does not use it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

import asteria.optim.base as base
from asteria import functional as F
from asteria.pipeline.refresh import SyncRefresher
from asteria.train import cli


class LaggedRefresher(SyncRefresher):
    """Native refreshes of versions after ``aligned`` installed ``lag`` steps late (see the module). Each
    late version is decomposed at its snapshot step with native's rules (a non-finite factor is left out, a
    float32 eigh that fails is retried in float64, a zero factor gives the identity) and its root is formed
    at the install, from the snapshot's eigenvalues or, with ``correct``, from diag(Q^T F Q) of the factor
    then. ``lag`` 0 sends the versions through the same path, installed at their own step."""

    def __init__(self, sets: Any, config: Any, interval: int, lag: int, correct: bool, aligned: int) -> None:
        super().__init__(sets, config, interval)
        self.delay, self.correct, self.aligned = lag, correct, aligned
        self.pending: list[tuple[int, int, int, Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def _refresh(self, step: int, items: list) -> None:
        at_once = [item for item in items if item[1] <= self.aligned]
        if at_once:
            super()._refresh(step, at_once)
        for index, version, request in items:
            if version <= self.aligned:
                continue
            fset = self.sets[index]
            if fset.kind != "root":
                raise ValueError(f"Invalid factor set {fset.name}: this simulation covers Shampoo's roots only")
            finite, zero = F.finite_rows(fset.factors), F.zero_rows(fset.factors)
            eye = torch.eye(fset.dim, dtype=fset.factors.dtype, device=fset.device)
            matrix = torch.where(F.batch_view(finite, fset.factors), fset.factors * self._scale(fset, request), eye)
            try:
                values, vectors = torch.linalg.eigh(matrix)
            except RuntimeError:  # no convergence in float32: native retries in float64
                values, vectors = torch.linalg.eigh(matrix.double())
            self.pending.append((step + self.delay, index, version, request, values, vectors, finite, zero))
            self._newest_versions[index] = version

    @staticmethod
    def _scale(fset: Any, request: Any) -> Any:
        if isinstance(request.scale, tuple):
            return F.batch_view(torch.tensor(request.scale, dtype=fset.factors.dtype, device=fset.device), fset.factors)
        return request.scale

    def activate(self, step: int) -> None:
        due = [entry for entry in self.pending if entry[0] <= step]
        self.pending = [entry for entry in self.pending if entry[0] > step]
        with F.float32_matmuls():
            for _, index, version, request, values, vectors, finite, zero in due:
                fset = self.sets[index]
                if self.correct:  # diag(Q^T F Q) of the factor now, in the snapshot's basis
                    now = (fset.factors * self._scale(fset, request)).to(vectors.dtype)
                    values = (vectors * (now @ vectors)).sum(-2)
                powers = F.regularize_eigenvalues(values, request.eps).pow(fset.exponent)
                roots = ((vectors * powers.unsqueeze(-2)) @ vectors.mT).to(fset.factors.dtype)
                eye = torch.eye(fset.dim, dtype=roots.dtype, device=roots.device)
                usable = finite & F.finite_rows(roots)
                roots = torch.where(F.batch_view(usable, roots), roots, eye)
                roots = torch.where(F.batch_view(zero, roots), eye, roots)  # a zero factor: the identity
                fset.preconditioners.copy_(torch.where(F.batch_view(usable, roots), roots, fset.preconditioners))
                fset.installed |= usable
                self._refreshes += fset.batch
                self._failures += int((~usable).sum())
                for block in usable.nonzero().flatten().tolist():
                    self._set_version(index, block, version)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lag", type=int, required=True, help="steps from a snapshot to its install (>= 0)")
    parser.add_argument("--correct", action="store_true", help="re-estimate the eigenvalues at install")
    parser.add_argument("--aligned", type=int, default=2, help="versions installed at their own step")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the asteria bench options")
    args = parser.parse_args(argv)
    if args.lag < 0:
        parser.error(f"Invalid --lag={args.lag}: must be >= 0")
    if args.aligned < 1:
        parser.error(f"Invalid --aligned={args.aligned}: must be >= 1 (the bootstrap refresh is always used at once)")
    made = base.make_refresher

    def make(sets: Any, config: Any, interval: int, groups: Any = None, resident: bool = True) -> Any:
        if config.mode != "sync":
            return made(sets, config, interval, groups, resident)
        return LaggedRefresher(sets, config, interval, args.lag, args.correct, args.aligned)

    rest = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    base.make_refresher = make
    try:
        return cli.main(["bench", *rest])
    finally:
        base.make_refresher = made


if __name__ == "__main__":
    sys.exit(main())
