"""OpenBLAS's kernels for the C++ workers' refresh math, chosen before the core loads the library.

OpenBLAS picks its kernels when it loads, from the CPU's model number. A model newer than its release gets
its generic "Prescott" kernels (SSE2): Debian 12's OpenBLAS 0.3.21 does so on a 5th-generation Xeon (family
6, model 207), where the refresh engine's two workers computed 1.07 inverse roots of 2048 blocks a second and
1.33 of SOAP's warm-started bases, against 3.47 and 5.56 with the AVX-512 ("SkylakeX") kernels
(``bench/refresh_engine.py``, docs/results.md). Where ``OPENBLAS_CORETYPE`` is unset, ``choose_kernels`` names the
kernels that an Intel CPU's instruction flags support: SkylakeX with AVX-512 (CooperLake and SapphireRapids add only
bfloat16 kernels; the refresh math is float32 and float64), Haswell with AVX2 and FMA. An AMD CPU with AVX2 and FMA
gets the Zen kernels, which OpenBLAS picks itself on the Zen families it knows but not on a newer one (Zen 5 is
family 26); its AVX-512 (Zen 4 on) is left unnamed, as SkylakeX's kernels are unmeasured there. Other vendors keep
OpenBLAS's choice. A user's own ``OPENBLAS_CORETYPE`` always wins; ``runtime_stats()["blas_core"]`` says which
kernels run.
OpenBLAS reads the variable once, when it loads, so a copy loaded before (numpy's, or the core's own library
loaded by another module) keeps its kernels; where the core's are then weaker than the CPU supports,
``warn_if_generic`` says so.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import MutableMapping
from pathlib import Path

AVX512 = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl"})
# OpenBLAS's x86 kernel sets with AVX2 and FMA or more (openblas_get_corename's names, lower case)
VECTOR_CORES = frozenset({"haswell", "skylakex", "cooperlake", "sapphirerapids", "zen"})


def coretype_for(vendor: str, flags: frozenset[str] | set[str]) -> str | None:
    """The OPENBLAS_CORETYPE for an x86 CPU's vendor id and /proc/cpuinfo flags (None: leave OpenBLAS's)."""
    if vendor == "AuthenticAMD":
        return "Zen" if {"avx2", "fma"} <= flags else None
    if vendor != "GenuineIntel":
        return None
    if AVX512 <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


def cpu_identity(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, frozenset[str]]:
    """The first CPU's vendor id and flags ('', {} where /proc/cpuinfo has none, as off x86 Linux)."""
    vendor, flags = "", frozenset()
    try:
        text = cpuinfo.read_text()
    except OSError:
        return vendor, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "vendor_id" and not vendor:
            vendor = value.strip()
        elif key == "flags":
            return vendor, frozenset(value.split())
    return vendor, flags


def choose_kernels(environ: MutableMapping[str, str] = os.environ, cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """Sets ``OPENBLAS_CORETYPE`` from the CPU's flags where it is unset; returns what it set (None: nothing). A copy
    of OpenBLAS loaded already keeps its kernels: the variable reaches only the copies loaded after it."""
    if "OPENBLAS_CORETYPE" in environ:
        return None
    coretype = coretype_for(*cpu_identity(cpuinfo))
    if coretype is not None:
        environ["OPENBLAS_CORETYPE"] = coretype
    return coretype


def kernel_warning(core: str, vendor: str, flags: frozenset[str] | set[str], user_set: bool) -> str | None:
    """Why the running kernels ``core`` are weaker than this CPU supports, and what to do (None: they are not,
    or the user named them)."""
    wanted = coretype_for(vendor, flags)
    if user_set or wanted is None or core.lower() in VECTOR_CORES:
        return None
    vectors = "AVX-512" if wanted == "SkylakeX" else "AVX2"
    return (f"OpenBLAS runs its {core!r} kernels on a CPU with {vectors}: it was loaded before asteria could name "
            f"{wanted!r}, and the refresh workers' math runs up to 3x slower (docs/results.md). Start the process "
            f"with OPENBLAS_CORETYPE={wanted}, or import asteria first.")


#: whether the user named the kernels (read when this module is imported, before ``choose_kernels`` sets them)
USER_SET = "OPENBLAS_CORETYPE" in os.environ


def warn_if_generic(core: str) -> None:
    """Warns (RuntimeWarning) where OpenBLAS runs kernels weaker than the CPU supports (``kernel_warning``), unless
    the user set ``OPENBLAS_CORETYPE`` before asteria did."""
    message = kernel_warning(core, *cpu_identity(), user_set=USER_SET)
    if message is not None:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
