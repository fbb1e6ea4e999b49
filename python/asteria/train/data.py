"""Training data: text from local files (or an embedded default corpus), a tokenizer, and fixed-length
packed sequences with a held-out validation split, served in an order that depends only on the seed
and a cursor (so a checkpoint holds the data position as one integer)."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Protocol

import torch

BYTE_VOCAB_SIZE = 256


def head(path: Path, limit: int) -> bytes:
    """The first ``limit`` bytes of a file, without reading the rest."""
    with path.open("rb") as file:
        return file.read(limit)


def default_corpus(max_bytes: int = 4_000_000) -> list[bytes]:
    """Python's own standard-library sources: a corpus present on every machine with Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = head(path, max_bytes - total)
        docs.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return docs


def is_binary(head: bytes) -> bool:
    """Whether a file whose first bytes are ``head`` is not text: it holds a NUL byte (git's test)."""
    return b"\0" in head


def load_documents(path: str | None, max_bytes: int) -> list[bytes]:
    """The bytes of a text file, of every text file under a folder (sorted by path; files with a NUL byte
    in their first 8 KiB are binary and skipped), or the default corpus."""
    if path is None:
        return default_corpus(max_bytes)
    source = Path(path)
    if not source.exists():
        raise FileNotFoundError(f"Invalid data={path!r}: no such file or folder")
    if not source.is_dir() and not source.is_file():  # a pipe or device would be read without end
        raise ValueError(f"Invalid data={path!r}: must be a regular file or a folder")
    files = sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else [source]
    docs, total, binary = [], 0, 0
    for file in files:
        if total >= max_bytes:
            break
        data = head(file, max_bytes - total)
        if is_binary(data[:8192]):
            if not source.is_dir():
                raise ValueError(f"Invalid data={path!r}: not a text file (a NUL byte in its first 8 KiB)")
            binary += 1
            continue
        docs.append(data)
        total += len(data)
    if total < 4096:
        skipped = f" ({binary} binary files skipped)" if binary else ""
        raise ValueError(f"Invalid data={path!r}: {total} bytes of text{skipped}, need at least 4096")
    return docs


class Tokenizer(Protocol):
    name: str
    vocab_size: int

    def encode(self, documents: list[bytes]) -> torch.Tensor:
        """One stream of token ids (int64) for all documents, in order."""


class ByteTokenizer:
    """Bytes are tokens: 256 ids, no special tokens, nothing to load."""

    name = "bytes"
    vocab_size = BYTE_VOCAB_SIZE

    def encode(self, documents: list[bytes]) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"".join(documents)), dtype=torch.uint8).long()


class HFTokenizer:
    """A HF tokenizer saved in a local folder (``tokenizer.json`` and its config); documents are
    separated by its end-of-sequence token when it has one. The vocabulary is rounded up to a
    multiple of 128 (an efficient embedding width)."""

    def __init__(self, path: str) -> None:
        if not Path(path).exists():
            raise FileNotFoundError(f"Invalid tokenizer={path!r}: no such file or folder")
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as error:  # transformers raises OSError, ValueError, KeyError... for a bad folder
            raise ValueError(f"Invalid tokenizer={path!r}: not a loadable HF tokenizer folder "
                             f"({type(error).__name__}: {error})") from error
        self.name = str(path)
        self.vocab_size = -(-len(self.tokenizer) // 128) * 128

    def encode(self, documents: list[bytes]) -> torch.Tensor:
        eos = self.tokenizer.eos_token_id
        ids: list[int] = []
        for doc in documents:
            ids.extend(self.tokenizer(doc.decode("utf-8", errors="replace"), add_special_tokens=False,
                                      verbose=False)["input_ids"])
            if eos is not None:
                ids.append(eos)
        return torch.tensor(ids, dtype=torch.long)


def load_tokenizer(path: str | None) -> Tokenizer:
    return ByteTokenizer() if path is None else HFTokenizer(path)


class PackedData:
    """A token stream cut into non-overlapping (T + 1)-token sequences; the last ``val_fraction`` of
    them (at least one) is held out for validation. Training batches walk a fresh permutation of the
    training sequences each epoch; batch contents depend only on (seed, cursor)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, val_fraction: float = 0.05, seed: int = 0,
                 source: str = "data") -> None:
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"Invalid val_fraction={val_fraction!r}: must be in (0, 1)")
        count = len(tokens) // (seq_len + 1)
        val = max(1, round(count * val_fraction))
        if count - val < 1:
            raise ValueError(f"Invalid {source}: {len(tokens)} tokens make {count} sequences of seq_len + 1 = "
                             f"{seq_len + 1}; need at least 2 (one to train on, one held out)")
        sequences = tokens[: count * (seq_len + 1)].view(count, seq_len + 1)
        self.train, self.val = sequences[: count - val], sequences[count - val:]
        self.seq_len, self.seed = seq_len, seed
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.long)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(len(self.train), generator=generator)
        return self._order

    def batch(self, cursor: int, batch_size: int) -> torch.Tensor:
        """Training sequences ``cursor .. cursor + batch_size - 1`` of the endless epoch sequence."""
        n = len(self.train)
        index = [int(self._permutation(i // n)[i % n]) for i in range(cursor, cursor + batch_size)]
        return self.train[index]

    def val_batches(self, batch_size: int, max_batches: int) -> list[torch.Tensor]:
        """The held-out sequences in order, at most ``max_batches`` batches."""
        return [self.val[i:i + batch_size] for i in range(0, min(len(self.val), batch_size * max_batches), batch_size)]
