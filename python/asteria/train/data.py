"""Text corpora as byte-level token streams, packed into fixed-length training sequences."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

VOCAB_SIZE = 256  # byte-level tokens


def default_corpus(max_bytes: int = 4_000_000) -> bytes:
    """Python's own standard-library sources: a corpus present on every machine with Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


def load_corpus(path: str | None, max_bytes: int) -> bytes:
    """Bytes of a text file, of every file under a folder, or of the default corpus."""
    if path is None:
        return default_corpus(max_bytes)
    source = Path(path)
    if not source.exists():
        raise FileNotFoundError(f"Invalid data={path!r}: no such file or folder")
    files = sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else [source]
    data = b"".join(p.read_bytes() for p in files)[:max_bytes]
    if len(data) < 4096:
        raise ValueError(f"Invalid data={path!r}: {len(data)} bytes, need at least 4096")
    return data


class TokenStream:
    """A corpus split into a training and a held-out validation part, served as (B, T+1) windows."""

    def __init__(self, data: bytes, seq_len: int, val_fraction: float = 0.05, seed: int = 0) -> None:
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        split = int(len(tokens) * (1 - val_fraction))
        self.train, self.val = tokens[:split], tokens[split:]
        self.seq_len = seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, batch_size: int, split: str = "train") -> torch.Tensor:
        tokens = self.train if split == "train" else self.val
        gen = self.generator if split == "train" else torch.Generator().manual_seed(1)
        starts = torch.randint(0, len(tokens) - self.seq_len - 1, (batch_size,), generator=gen)
        return torch.stack([tokens[s:s + self.seq_len + 1] for s in starts.tolist()])
