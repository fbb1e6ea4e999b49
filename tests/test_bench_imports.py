"""Every script in bench/ imports against the package as it is now. A script whose import of a moved or renamed
function broke would otherwise show it only on the GPU machine, in a call that costs device time (what the
scripts compute is tested where it matters: test_session_script.py and the test_*_bench.py files)."""

from __future__ import annotations

import pytest
from conftest import BENCH, bench_script


@pytest.mark.parametrize("script", sorted(path.stem for path in BENCH.glob("*.py")))
def test_the_script_imports_and_has_its_entry_point(script, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # (scripts import their neighbours, as when run from there)
    assert callable(bench_script(script).main)  # (each runs only under __main__)
