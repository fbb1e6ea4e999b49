"""The set-up scripts: which interpreter scripts/python_env.sh picks (in its dry run, which installs and
creates nothing), that every script parses, and that setup.sh installs what pyproject.toml declares."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "scripts").glob("*.sh")) + [ROOT / ".ci" / "run"]


def _externally_managed_python() -> str | None:
    """A python3 whose pip PEP 668 forbids (Debian's /usr/bin/python3), or None."""
    exe = shutil.which("python3", path="/usr/bin:/bin")
    if exe is None:
        return None
    probe = ('import os, sys, sysconfig; print(sys.prefix == sys.base_prefix and os.path.isfile('
             'os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")))')
    out = subprocess.run([exe, "-c", probe], capture_output=True, text=True, timeout=10)
    return exe if out.stdout.strip() == "True" else None


def _dry_run(tmp_path: Path, **env: str) -> tuple[str, str]:
    """Runs a copy of python_env.sh with tmp_path as the repository root; returns (interpreter, messages)."""
    (tmp_path / "scripts").mkdir(exist_ok=True)
    shutil.copy(ROOT / "scripts" / "python_env.sh", tmp_path / "scripts")
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "ASTERIA_PYTHON_QUIET")}
    out = subprocess.run(["bash", str(tmp_path / "scripts" / "python_env.sh")], capture_output=True, text=True,
                         timeout=10, cwd=tmp_path, env=base | {"ASTERIA_SETUP_DRY_RUN": "1"} | env)
    assert out.returncode == 0, out.stderr
    *messages, chosen = out.stdout.strip().splitlines()
    return chosen, "\n".join(messages)


def test_externally_managed_python_gets_a_venv(tmp_path):
    managed = _externally_managed_python()
    if managed is None:
        pytest.skip("no externally managed python3 here")
    chosen, messages = _dry_run(tmp_path, PYTHON=managed)
    assert chosen == str(tmp_path / ".venv" / "bin" / "python")
    assert f"would create {tmp_path / '.venv'} from {managed}" in messages and "externally managed" in messages
    assert not (tmp_path / ".venv").exists()  # a dry run creates nothing


def test_externally_managed_python3_on_path_gets_a_venv(tmp_path):
    managed = _externally_managed_python()
    if managed is None:
        pytest.skip("no externally managed python3 here")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(managed)
    chosen, messages = _dry_run(tmp_path, PATH=f"{bin_dir}:/usr/bin:/bin")
    assert chosen == str(tmp_path / ".venv" / "bin" / "python")
    assert "would create" in messages and not (tmp_path / ".venv").exists()


def test_python_that_may_install_is_used_as_is(tmp_path):
    chosen, messages = _dry_run(tmp_path, PYTHON=sys.executable)
    assert chosen == sys.executable
    assert "would" not in messages and not (tmp_path / ".venv").exists()


def test_existing_venv_is_used(tmp_path):
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").symlink_to(sys.executable)
    chosen, messages = _dry_run(tmp_path)
    assert chosen == str(tmp_path / ".venv" / "bin" / "python") and "would" not in messages


def test_python_that_does_not_run_is_refused(tmp_path):
    out = subprocess.run(["bash", str(ROOT / "scripts" / "python_env.sh")], capture_output=True, text=True,
                         timeout=10, env=os.environ | {"ASTERIA_SETUP_DRY_RUN": "1", "PYTHON": str(tmp_path / "none")})
    assert out.returncode != 0 and "does not run" in out.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=10)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib")
def test_setup_installs_what_pyproject_declares():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    base = project["project"]["dependencies"] + project["project"]["optional-dependencies"]["train"] \
        + project["build-system"]["requires"]
    test = project["project"]["optional-dependencies"]["test"] + project["project"]["optional-dependencies"]["fuzz"]
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    base_part, test_part = setup.split("if [ $with_test = 1 ]")
    for requirement in base:
        name = re.split(r"[<>=]", requirement)[0]
        if name != "torch":  # its own stage, pinned
            assert f'"{requirement}"' in base_part or f" {requirement} " in base_part, requirement
    for requirement in test:
        assert requirement in test_part and requirement not in base_part, requirement
