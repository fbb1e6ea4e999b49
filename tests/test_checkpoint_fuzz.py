"""The checkpoint manifest fuzz target runs (briefly) and finds nothing; scripts/test.sh runs it longer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).resolve().parents[1] / "fuzz" / "checkpoint_manifest_fuzz.py"


@pytest.mark.parametrize("engine", ["auto", "hypothesis"])
def test_manifest_fuzz_runs_clean(engine):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(FUZZ), "--seconds", "2", "--engine", engine], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "no failure" in result.stdout or "Done" in result.stderr


def test_fuzz_property_rejects_a_parser_that_leaks_other_exceptions(monkeypatch):
    """The harness's property is not vacuous: a parser raising anything but CheckpointError fails it."""
    sys.path.insert(0, str(FUZZ.parent))
    try:
        import checkpoint_manifest_fuzz as harness
    finally:
        sys.path.remove(str(FUZZ.parent))
    harness.check(b"\x01" + b"7")  # a good parser: fine
    monkeypatch.setattr(harness.checkpoint, "parse_manifest", lambda data: {}[data])
    with pytest.raises(KeyError):
        harness.check(b"\x01" + b"7")
