"""Which software produced a run: Asteria's version and a fingerprint of its installed code, torch's and
CUDA's versions. Runs of different code are different experiments even when their settings match, so
``tools/seeds.py`` lists the fingerprints it pools."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

import asteria
from asteria import _core


@functools.cache
def code_fingerprint() -> str:
    """The first 12 hex digits of the SHA-256 over the package's Python sources and its compiled
    extension (wherever the extension is loaded from, so that an editable install counts it too): each
    file's name, length and contents, in path order. Computed once per process, when first asked (a run
    asks when it starts)."""
    root = Path(asteria.__file__).resolve().parent
    files = {p for p in root.rglob("*") if p.is_file() and p.suffix in (".py", ".so", ".pyd")}
    files.add(Path(_core.__file__).resolve())
    digest = hashlib.sha256()
    for path in sorted(files):
        data = path.read_bytes()
        name = str(path.relative_to(root)) if path.is_relative_to(root) else path.name
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()[:12]


def software() -> dict[str, str | None]:
    """``asteria`` (version), ``code`` (``code_fingerprint()``), ``torch`` and ``cuda`` (None on CPU builds)."""
    return {"asteria": asteria.__version__, "code": code_fingerprint(), "torch": torch.__version__,
            "cuda": torch.version.cuda}
