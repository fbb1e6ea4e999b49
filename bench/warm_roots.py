"""Whether Shampoo's inverse roots could be refined from the previous eigenbasis by float64 matrix products
(cheap on a GPU, where ``eigh`` is latency-bound) instead of decomposed afresh, on the factors a real run makes.

First ``asteria bench`` trains bench/block_size.py's model (the tiny preset widened to 256 with a 2048-wide MLP)
with native Shampoo and saves every factor of size ``--dim`` that a refresh decomposes (deleted at the end).
Then, at every ``--every``-th refresh of each saved block, it starts from the previous refresh's exact eigenbasis
(the best warm start there is) and runs ``--iterations`` refinement steps in float64 after Ogita and Aishima ("Iterative
refinement for symmetric eigenvalue decomposition", 2018): with S = X^T A X and R = I - X^T X, each pair (i, j)
whose gap |l_j - l_i| exceeds ``--separation`` times its coupling |S_ij + l_j R_ij| turns by their ratio, and X
is re-orthonormalized (QR) after each step, which keeps the iteration from diverging when many pairs turn at once.

The error of a root R is the preconditioned gradient's against the float64 root R*: sqrt(E|(R - R*) g|^2 /
E|R* g|^2) for gradients with E[g g^T] = A, i.e. ||(R - R*) A^(1/2)||_F / ||R* A^(1/2)||_F. A row gives float32
``eigh``'s error (what the library's roots carry), the stale basis's (k = 0: the old basis with the new Rayleigh
quotients), and the error after each refinement step, with the off-diagonal share ||S - diag S||_F / ||S||_F.

    python3 bench/warm_roots.py --steps 300 --every 7 --iterations 6
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from pathlib import Path

import torch

from asteria import functional as F
from asteria.train import model as models
from asteria.train.cli import main as asteria

PRESET = "block-size"


def capture(args: argparse.Namespace) -> list[list[Path]]:
    """Trains native Shampoo, saving each decomposed batch of blocks of ``--dim``; returns the files of each batch
    of blocks (one chain per batch), in refresh order."""
    models.PRESETS[PRESET] = dataclasses.replace(models.PRESETS["tiny"], hidden_size=256, intermediate_size=2048,
                                                 num_heads=4)
    folder = args.out / "factors"
    folder.mkdir(parents=True, exist_ok=True)
    chains: dict[int, list[Path]] = {}
    decompose = F.inverse_root

    def saving(factor, exponent, eps, scale, widen=False, relative_eps=0.0):
        if factor.shape[-1] == args.dim:
            files = chains.setdefault(factor.data_ptr(), [])  # a batch's factors keep their storage
            path = folder / f"batch{list(chains).index(factor.data_ptr())}-refresh{len(files):03d}.pt"
            torch.save({"matrix": factor * scale, "exponent": exponent, "eps": eps}, path)
            files.append(path)
        return decompose(factor, exponent, eps, scale, widen, relative_eps)

    F.inverse_root = saving
    try:
        argv = ["bench", "--model", PRESET, "--device", "cpu", "--batch-size", "8", "--seq-len", "128", "--steps",
                str(args.steps), "--precondition-frequency", str(args.frequency), "--eval-every",
                str(min(100, args.steps)), "--eval-batches", "8", "--seed", str(args.seed),
                "--max-preconditioner-dim", "2048", "--configs", "shampoo-sync", "--out", str(args.out / "run")]
        if asteria(argv) != 0:
            raise SystemExit("warm_roots: the native Shampoo run failed")
    finally:
        F.inverse_root = decompose
    return list(chains.values())


def powers(values: torch.Tensor, eps: float, exponent: float) -> torch.Tensor:
    """The library's regularized eigenvalues (``functional.regularize_eigenvalues``) to ``exponent``."""
    return F.regularize_eigenvalues(values, eps).pow(exponent)


def refine(matrix: torch.Tensor, basis: torch.Tensor, separation: float) -> torch.Tensor:
    """One damped Ogita-Aishima step (module docstring), then an exact re-orthonormalization."""
    eye = torch.eye(matrix.shape[-1], dtype=matrix.dtype)
    residual = eye - basis.mT @ basis
    rotated = basis.mT @ matrix @ basis
    rotated = (rotated + rotated.mT) / 2
    values = rotated.diagonal(dim1=-2, dim2=-1) / (1 - residual.diagonal(dim1=-2, dim2=-1))
    gap = values.unsqueeze(-2) - values.unsqueeze(-1)  # [i, j] = l_j - l_i
    coupling = rotated + values.unsqueeze(-2) * residual
    apart = gap.abs() > separation * coupling.abs()
    turn = torch.where(apart, coupling / torch.where(apart, gap, torch.ones_like(gap)), residual / 2)
    q, r = torch.linalg.qr(basis + basis @ turn)
    return q * torch.sign(r.diagonal(dim1=-2, dim2=-1)).unsqueeze(-2)  # the column signs of the basis kept


def root_from(matrix: torch.Tensor, basis: torch.Tensor, eps: float,
              exponent: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The root from ``basis`` and its Rayleigh quotients, and the off-diagonal share of S = basis^T A basis."""
    rotated = basis.mT @ matrix @ basis
    values = rotated.diagonal(dim1=-2, dim2=-1)
    off = torch.linalg.matrix_norm(rotated - torch.diag_embed(values)) / torch.linalg.matrix_norm(rotated)
    return (basis * powers(values, eps, exponent).unsqueeze(-2)) @ basis.mT, off


def study(chains: list[list[Path]], args: argparse.Namespace) -> list[str]:
    steps = " ".join(f"{'k=' + str(k):>8}" for k in range(1, args.iterations + 1))
    lines = [f"{'batch':>5} {'refresh':>7} {'block':>5} {'off-diag':>8} {'eigh32':>8} {'stale':>8} {steps}"]
    print(lines[0], flush=True)
    for index, files in enumerate(chains):
        studied = sorted({r for r in range(1, len(files)) if r % args.every == 0} | {len(files) - 1} - {0})
        for refresh in studied:
            previous = torch.linalg.eigh(torch.load(files[refresh - 1])["matrix"].double())[1]
            blob = torch.load(files[refresh])
            single, eps, exponent = blob["matrix"], blob["eps"], blob["exponent"]
            matrix = single.double()
            values, vectors = torch.linalg.eigh(matrix)
            exact = (vectors * powers(values, eps, exponent).unsqueeze(-2)) @ vectors.mT
            half = (vectors * values.clamp_min(0).sqrt().unsqueeze(-2)) @ vectors.mT
            scale = torch.linalg.matrix_norm(exact @ half)
            error = lambda root: torch.linalg.matrix_norm((root.double() - exact) @ half) / scale  # noqa: E731
            v32, q32 = torch.linalg.eigh(single)
            errors = [error((q32 * powers(v32, eps, exponent).unsqueeze(-2)) @ q32.mT)]
            stale, off = root_from(matrix, previous, eps, exponent)
            errors.append(error(stale))
            basis = previous
            for _ in range(args.iterations):
                basis = refine(matrix, basis, args.separation)
                errors.append(error(root_from(matrix, basis, eps, exponent)[0]))
            for block in range(matrix.shape[0]):
                lines.append(f"{index:>5} {refresh:>7} {block:>5} {float(off[block]):>8.2e} "
                             + " ".join(f"{float(e[block]):>8.2e}" for e in errors))
            print(*lines[-matrix.shape[0]:], sep="\n", flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--frequency", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dim", type=int, default=2048, help="the block size studied")
    parser.add_argument("--every", type=int, default=7, help="study every N-th refresh (and the last)")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--separation", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=Path("runs/warm-roots"))
    args = parser.parse_args()
    for name in ("steps", "frequency", "dim", "every", "iterations"):
        if getattr(args, name) < 1:
            parser.error(f"argument --{name.replace('_', '-')}: invalid value {getattr(args, name)}: must be >= 1")
    if args.separation <= 0:
        parser.error(f"argument --separation: invalid value {args.separation}: must be > 0")
    try:
        text = "\n".join(study(capture(args), args))
    finally:
        shutil.rmtree(args.out / "factors", ignore_errors=True)  # about 3 GB at the defaults
    (args.out / "warm_roots.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
