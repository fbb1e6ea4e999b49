# Picks the Python interpreter that Asteria's scripts install into and run with, and sets PY to it.
# Sourced by setup.sh, demo.sh, test.sh and wheels.sh, so that all of them use the same one. Order:
#   1. $PYTHON, if set;  2. an existing .venv/bin/python;  3. python3, if pip may install into it;
#   4. otherwise a new .venv made with `python3 -m venv` (Debian's python3-venv is installed first when
#      its venv module is missing).
# "pip may install" is PEP 668's rule: inside a venv or conda env, or no EXTERNALLY-MANAGED file in the
# interpreter's stdlib. Debian's /usr/bin/python3 has that file, and pip there stops with
# "error: externally-managed-environment"; an externally managed $PYTHON gets a .venv based on it likewise.
# ASTERIA_SETUP_DRY_RUN=1 says what would be done and which interpreter, creating nothing:
#   ASTERIA_SETUP_DRY_RUN=1 bash scripts/python_env.sh      (run, not sourced, it prints the choice last)
# ASTERIA_PYTHON_QUIET=1 silences the choice (demo.sh and test.sh, after setup.sh has said it).

_asteria_venv=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv

_asteria_say() { [ "${ASTERIA_PYTHON_QUIET:-0}" = 1 ] || echo "setup: $*"; }

# Prints "ok" (pip may install), "managed" (PEP 668 forbids it), "old" (before 3.10) or "missing".
_asteria_pip_status() {
  "$1" -c 'import os, sys, sysconfig
in_env = sys.prefix != sys.base_prefix or os.path.isdir(os.path.join(sys.prefix, "conda-meta"))
managed = os.path.isfile(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))
print("old" if sys.version_info < (3, 10) else "ok" if in_env or not managed else "managed")' 2>/dev/null ||
    echo missing
}

# Makes .venv from interpreter $1 ($2: why), or in a dry run says that it would.
_asteria_make_venv() {
  local base=$1 why=$2 t0=$SECONDS sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  # Debian moves ensurepip (which `venv` needs for pip) out of python3 into python3-venv; a bare
  # Debian may lack python3 itself, which python3-venv brings.
  local need_apt=0
  "$base" -c 'import venv, ensurepip' 2>/dev/null || need_apt=1
  if [ "${ASTERIA_SETUP_DRY_RUN:-0}" = 1 ]; then
    [ $need_apt = 0 ] || _asteria_say "would apt-get install python3-venv"
    _asteria_say "would create $_asteria_venv from $base ($why)"
    return
  fi
  printf 'setup: creating .venv from %s (%s) ... ' "$base" "$why"
  if [ $need_apt = 1 ]; then
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
    hash -r
  fi
  "$base" -m venv "$_asteria_venv"
  echo "ok ($((SECONDS - t0)) s)"
}

_asteria_choose_python() {
  local base why
  if [ -n "${PYTHON:-}" ]; then
    base=$PYTHON why="PEP 668: \$PYTHON=$PYTHON is externally managed"
  elif [ -x "$_asteria_venv/bin/python" ]; then
    PY=$_asteria_venv/bin/python
    _asteria_say "python: $PY (the existing .venv)"
    return
  else
    base=$(command -v python3 || echo python3) why="PEP 668: python3 is externally managed"
  fi
  case $(_asteria_pip_status "$base") in
    ok) PY=$base; _asteria_say "python: $PY"; return ;;
    old) echo "setup: $base is older than Python 3.10; set PYTHON to a newer one" >&2; return 1 ;;
    missing)
      if [ -n "${PYTHON:-}" ]; then echo "setup: PYTHON=$PYTHON does not run" >&2; return 1; fi
      base=/usr/bin/python3 why="no python3 yet" ;;  # what python3-venv installs
  esac
  PY=$_asteria_venv/bin/python
  if [ -x "$PY" ]; then _asteria_say "python: $PY ($why; using the existing .venv)"; return; fi
  _asteria_make_venv "$base" "$why"
  _asteria_say "python: $PY"
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then  # run rather than sourced: print the choice
  set -euo pipefail
  _asteria_choose_python
  echo "$PY"
else
  _asteria_choose_python
fi
