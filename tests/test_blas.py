"""OpenBLAS's kernels: asteria names them from the CPU's flags before the core loads OpenBLAS (asteria.blas)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asteria import blas

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 207
flags\t\t: fpu sse sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl amx_tile
processor\t: 1
vendor_id\t: GenuineIntel
flags\t\t: fpu sse sse2
"""


@pytest.mark.parametrize(("vendor", "flags", "expected"), [
    ("GenuineIntel", {"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl"}, "SkylakeX"),
    ("GenuineIntel", {"avx2", "fma", "avx512f"}, "Haswell"),  # not the whole AVX-512 set SkylakeX's kernels use
    ("GenuineIntel", {"avx", "avx2", "fma"}, "Haswell"),
    ("GenuineIntel", {"sse2", "avx"}, None),
    ("AuthenticAMD", {"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl"}, "Zen"),  # Zen 4 on
    ("AuthenticAMD", {"avx", "avx2", "fma"}, "Zen"),
    ("AuthenticAMD", {"sse2", "avx"}, None),
    ("HygonGenuine", {"avx2", "fma"}, None),
    ("", set(), None),
])
def test_kernels_follow_the_cpus_flags(vendor: str, flags: set[str], expected: str | None) -> None:
    assert blas.coretype_for(vendor, frozenset(flags)) == expected


def test_cpu_identity_reads_the_first_cpu(tmp_path: Path) -> None:
    (tmp_path / "cpuinfo").write_text(CPUINFO)
    vendor, flags = blas.cpu_identity(tmp_path / "cpuinfo")
    assert vendor == "GenuineIntel"
    assert {"avx512f", "amx_tile", "fma"} <= flags
    assert blas.cpu_identity(tmp_path / "missing") == ("", frozenset())


def test_choose_kernels_leaves_a_users_choice_alone(tmp_path: Path) -> None:
    (tmp_path / "cpuinfo").write_text(CPUINFO)
    environ: dict[str, str] = {}
    assert blas.choose_kernels(environ, tmp_path / "cpuinfo") == "SkylakeX"
    assert environ == {"OPENBLAS_CORETYPE": "SkylakeX"}
    mine = {"OPENBLAS_CORETYPE": "Haswell"}
    assert blas.choose_kernels(mine, tmp_path / "cpuinfo") is None
    assert mine == {"OPENBLAS_CORETYPE": "Haswell"}
    (tmp_path / "cpuinfo").write_text("vendor_id\t: AuthenticAMD\nflags\t\t: avx2 fma\n")
    environ = {}
    assert blas.choose_kernels(environ, tmp_path / "cpuinfo") == "Zen"
    assert environ == {"OPENBLAS_CORETYPE": "Zen"}
    (tmp_path / "cpuinfo").write_text("vendor_id\t: CentaurHauls\nflags\t\t: avx2 fma\n")
    environ = {}
    assert blas.choose_kernels(environ, tmp_path / "cpuinfo") is None
    assert environ == {}


def _unset() -> dict[str, str]:
    """This process's environment without OPENBLAS_CORETYPE."""
    return {key: value for key, value in os.environ.items() if key != "OPENBLAS_CORETYPE"}


def _fresh_process(code: str, environ: dict[str, str]) -> str:
    """The stdout of ``code`` run in a fresh interpreter with ``environ``."""
    return subprocess.run([sys.executable, "-c", code], env=environ, check=True, capture_output=True,
                          text=True, timeout=120).stdout.strip()


def _core_in_fresh_process(environ: dict[str, str], first: str = "") -> str:
    return _fresh_process(f"{first}import asteria; from asteria import _core; print(_core.blas_core())", environ)


def test_the_core_runs_the_kernels_this_cpu_supports() -> None:
    """In a fresh process: unset, OpenBLAS runs the kernels named from this CPU's flags (on a CPU its release
    does not know, it would run generic ones), also after numpy loaded its own copy of OpenBLAS; a user's
    OPENBLAS_CORETYPE wins."""
    expected = blas.coretype_for(*blas.cpu_identity())
    if expected is None:
        pytest.skip("this CPU keeps OpenBLAS's own choice (not an Intel or AMD CPU with AVX2)")
    environ = _unset()
    assert _core_in_fresh_process(environ) == expected
    assert _core_in_fresh_process(environ, first="import numpy; numpy.ones((64, 64)) @ numpy.ones((64, 64)); ") \
        == expected
    assert _core_in_fresh_process(environ | {"OPENBLAS_CORETYPE": "Haswell"}) == "Haswell"


@pytest.mark.parametrize(("core", "flags", "user_set", "warns"), [
    ("Prescott", {"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl"}, False, "SkylakeX"),
    ("Core2", {"avx2", "fma"}, False, "Haswell"),
    ("Prescott", {"avx2", "fma"}, True, None),  # the user named them
    ("SkylakeX", {"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl"}, False, None),
    ("Haswell", {"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl"}, False, None),
    ("Prescott", {"sse2"}, False, None),  # nothing better to run
])
def test_generic_kernels_on_a_vector_cpu_are_named(core: str, flags: set[str], user_set: bool,
                                                   warns: str | None) -> None:
    message = blas.kernel_warning(core, "GenuineIntel", frozenset(flags), user_set)
    if warns is None:
        assert message is None
    else:
        assert message is not None and repr(core) in message and f"OPENBLAS_CORETYPE={warns}" in message


def test_generic_kernels_on_an_amd_vector_cpu_are_named() -> None:
    """Zen 5 (family 26) on an OpenBLAS that predates it runs the generic kernels: the warning names Zen's."""
    message = blas.kernel_warning("Prescott", "AuthenticAMD", frozenset({"avx2", "fma", "avx512f"}), False)
    assert message is not None and "OPENBLAS_CORETYPE=Zen" in message and "AVX2" in message
    assert blas.kernel_warning("Zen", "AuthenticAMD", frozenset({"avx2", "fma"}), False) is None


def test_openblas_loaded_first_warns_where_its_kernels_are_generic() -> None:
    """In a fresh process that loads the core's libopenblas before importing asteria (whose variable then comes too
    late), the import warns exactly when OpenBLAS's own choice is weaker than this CPU supports (on this CI machine's
    5th-generation Xeon it is); a numpy imported first, with its own copy, changes nothing."""
    code = ("import ctypes, warnings, numpy; ctypes.CDLL('libopenblas.so.0', mode=ctypes.RTLD_GLOBAL)\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    import asteria\n"
            "from asteria import _core\n"
            "print(_core.blas_core())\n"
            "print(sum('OPENBLAS_CORETYPE=' in str(w.message) for w in caught if w.category is RuntimeWarning))\n")
    environ = _unset()
    try:
        out = _fresh_process(code, environ).split()
    except subprocess.CalledProcessError as error:
        if "libopenblas.so.0" in error.stderr:
            pytest.skip("no libopenblas.so.0 on the loader's path")
        raise
    core, warned = out[0], int(out[1])
    expected = blas.kernel_warning(core, *blas.cpu_identity(), user_set=False) is not None
    assert warned == int(expected)
