"""What a late basis costs SOAP itself, without Asteria: an independent SOAP written here from the
published math (Vyas et al. 2024; float32 torch), in which the basis refreshed after step k (one power
step and a QR, second moment reordered) is installed before step k + 1 + LAG instead of k + 1. Same
model, batches and learning rate as ``bench/staleness_lag.py``'s seed 0, so the two print comparable
final losses (mean of the last 10 steps). CPU, about 10 s per run on 2 cores.

Run:  python3 bench/soap_lag_reference.py --lags 0 3 5 10
      python3 bench/soap_lag_reference.py --lags 10 --lag-from 30     # lag only from step 30 on
      python3 bench/soap_lag_reference.py --lags 0 10 --shampoo-beta 0.999
"""

from __future__ import annotations

import argparse

import torch

from asteria.train.data import default_corpus
from asteria.train.model import build_model


def debiased(beta: float, step: int) -> float:
    return 1.0 - (1.0 - beta) / (1.0 - beta**step)


def descending_eigenvectors(matrix: torch.Tensor) -> torch.Tensor:
    return torch.linalg.eigh(matrix.double())[1].flip(-1).float()


def train(lag: int, lag_from: int, args: argparse.Namespace) -> float:
    tokens = torch.tensor(list(b"".join(default_corpus(400_000))[:300_000]), dtype=torch.long)
    seq, batch = 64, 16
    starts = torch.randint(0, len(tokens) - seq - 1, (args.steps, batch), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = build_model("tiny", 256, seq)
    params = list(model.parameters())
    b1, b2, eps, wd, f = 0.95, 0.95, 1e-8, 0.01, args.frequency
    sb = b2 if args.shampoo_beta is None else args.shampoo_beta
    states = [{"m": torch.zeros_like(p), "v": torch.zeros_like(p), "pending": []} for p in params]
    losses = []
    for t in range(1, args.steps + 1):
        loss = model.loss(torch.stack([tokens[i:i + seq + 1] for i in starts[t - 1].tolist()]))
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for p, s in zip(params, states):
                g, matrix = p.grad, p.grad.ndim == 2
                p.grad = None
                if t == 1:  # the factors and their eigenbases only
                    if matrix:
                        s["L"], s["R"] = g @ g.T, g.T @ g
                        s["QL"], s["QR"] = descending_eigenvectors(s["L"]), descending_eigenvectors(s["R"])
                    continue
                k = t - 1
                for _, axis, name, order, basis in [x for x in s["pending"] if x[0] <= k]:
                    s["v"] = s["v"].index_select(axis, order)
                    s[name] = basis
                s["pending"] = [x for x in s["pending"] if x[0] > k]
                rotate = (lambda x, s=s: s["QL"].T @ x @ s["QR"]) if matrix else (lambda x: x)
                back = (lambda x, s=s: s["QL"] @ x @ s["QR"].T) if matrix else (lambda x: x)
                s["m"].mul_(debiased(b1, k)).add_(g, alpha=1 - debiased(b1, k))
                s["v"].mul_(debiased(b2, k)).add_(rotate(g) ** 2, alpha=1 - debiased(b2, k))
                direction = back(rotate(s["m"]) / s["v"].sqrt().clamp_min(eps))
                if matrix:
                    beta = debiased(sb, k)
                    s["L"] = beta * s["L"] + (1 - beta) * g @ g.T
                    s["R"] = beta * s["R"] + (1 - beta) * g.T @ g
                    if k % f == 0:
                        due = k + 1 + (lag if k >= lag_from else 0)
                        for axis, (factor, name) in enumerate((("L", "QL"), ("R", "QR"))):
                            power = s[factor] @ s[name]
                            order = torch.argsort(-(s[name] * power).sum(0), stable=True)
                            basis = torch.linalg.qr(power[:, order].double())[0].float()
                            s["pending"].append((due, axis, name, order, basis))
                p.mul_(1 - args.lr * wd).add_(direction, alpha=-args.lr)
    return sum(losses[-10:]) / 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 3, 10], help="steps each basis arrives late")
    parser.add_argument("--lag-from", type=int, default=0, help="refreshes before this step arrive on time")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--frequency", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--shampoo-beta", type=float, default=None, help="factor decay (default: beta2 = 0.95)")
    args = parser.parse_args()
    if any(lag < 0 for lag in args.lags):
        parser.error(f"Invalid --lags={args.lags}: each must be >= 0")
    print(f"independent SOAP, tiny preset, {args.steps} steps, f={args.frequency}, lr={args.lr}, "
          f"shampoo_beta={args.shampoo_beta or 0.95}, lag from step {args.lag_from}")
    for lag in args.lags:
        print(f"lag {lag:3d}: final loss {train(lag, args.lag_from, args):.4f}", flush=True)


if __name__ == "__main__":
    main()
