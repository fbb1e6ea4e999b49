"""Which software produced a run: Asteria's version and a fingerprint of its installed code, torch's and
CUDA's versions. Runs of different code are different experiments even when their settings match, so
``asteria seeds`` lists the fingerprints it pools."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

import asteria


@functools.cache
def code_fingerprint() -> str:
    """The first 12 hex digits of the SHA-256 over the installed package's Python sources and compiled
    extension (path and contents, in path order)."""
    root = Path(asteria.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".py", ".so", ".pyd")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def software() -> dict[str, str | None]:
    """``asteria`` (version), ``code`` (``code_fingerprint()``), ``torch`` and ``cuda`` (None on CPU builds)."""
    return {"asteria": asteria.__version__, "code": code_fingerprint(), "torch": torch.__version__,
            "cuda": torch.version.cuda}
