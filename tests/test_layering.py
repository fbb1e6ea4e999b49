"""The package's layering: every import goes down the table below (never up, never in a circle, at module
level or inside a function), and every module imports alone in a fresh interpreter: as shipped, with the
top package's ``__init__`` emptied (a cycle hidden by the order in which ``asteria/__init__`` loads things
then shows as "partially initialized module"), and with every package ``__init__`` emptied.

The table is the one ``docs/architecture.md`` opens with:
``_core``, ``blas``, ``errors`` -> ``config``, ``cpus``, ``memory`` -> ``checks``, ``functional`` -> ``pipeline``
-> ``distributed`` -> ``optim`` -> ``hooks``, ``testing``, the ``asteria`` face -> ``train``."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import asteria

ROOT = Path(asteria.__file__).parent

# Lower layers first; a module may import its own layer or a lower one (its own layer acyclically).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("asteria._core", "asteria.blas", "asteria.errors"),
    ("asteria.config", "asteria.cpus", "asteria.memory"),
    ("asteria.checks", "asteria.functional"),
    ("asteria.pipeline",),
    ("asteria.distributed",),
    ("asteria.optim",),
    ("asteria.hooks", "asteria.testing"),
    ("asteria",),
    ("asteria.train",),
)


def _layer(module: str) -> int:
    """The layer of a module: the longest entry of the table that is it or a package above it."""
    best, found = -1, None
    for index, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, found = len(name), index
    if found is None:
        raise AssertionError(f"module {module} has no layer in LAYERS; add it to the table and the docs")
    return found


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = ("asteria", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()
KNOWN = set(MODULES) | {"asteria._core"}


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside ``if TYPE_CHECKING:``: names for annotations only, never executed."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return True
    return False


def _imports(module: str, path: Path) -> list[tuple[str, int]]:
    """Every ``asteria`` module that ``module`` imports, wherever the import stands, with its line. ``from P
    import n`` counts as an import of ``P.n`` where that is a module."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in KNOWN else base for a in node.names]
        else:
            continue
        if _type_checking_only(node, parents):
            continue
        found += [(t, node.lineno) for t in targets if t == "asteria" or t.startswith("asteria.")]
    return found


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def test_every_import_goes_down_the_layers():
    upward = [f"{m}:{line} imports {t} (layer {_layer(t)} above its own {_layer(m)})"
              for m, edges in GRAPH.items() for t, line in edges if _layer(t) > _layer(m)]
    assert upward == []


def test_no_import_cycle_at_module_level_or_inside_functions():
    edges = {m: sorted({t for t, _ in targets if t in MODULES and t != m}) for m, targets in GRAPH.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in edges[node]:
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for module in edges:
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_scan_sees_the_imports_it_checks():
    # A scan that found nothing would pass both tests above.
    assert ("asteria.pipeline.timeline", 0) in [(t, 0) for t, _ in GRAPH["asteria.pipeline.refresh"]]
    assert any(t == "asteria._core" for t, _ in GRAPH["asteria.errors"])
    assert len(MODULES) > 40


# Run in one fresh interpreter that imports torch and numpy once, then forks a child per module and mode:
# a child starts from an interpreter that has loaded nothing of the package.
_ALONE = r"""
import importlib, json, os, sys, traceback, types
import numpy, torch
modules, packages = json.loads(sys.argv[1]), json.loads(sys.argv[2])
top = min(packages, key=len)
failures = {}
for name in modules:
    for emptied in ("nothing", top, "every package"):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            try:
                for package, folder in packages.items():
                    if emptied in (package, "every package"):  # the package as if its __init__ were empty
                        bare = types.ModuleType(package)
                        bare.__path__ = [folder]  # its submodules still import from its folder
                        sys.modules[package] = bare
                importlib.import_module(name)
                os._exit(0)
            except BaseException:
                os.write(write, traceback.format_exc(limit=4).encode()[-4000:])
                os._exit(1)
        os.close(write)
        message = b""
        while chunk := os.read(read, 65536):
            message += chunk
        os.close(read)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            failures[f"{name} (emptied: {emptied})"] = message.decode()[-800:]
print(json.dumps(failures))
"""


def _import_alone(modules: dict[str, Path], path: Path) -> dict[str, str]:
    """The modules that fail to import alone, each with the tail of its traceback."""
    packages = {m: str(p.parent) for m, p in modules.items() if p.name == "__init__.py"}
    done = subprocess.run([sys.executable, "-c", _ALONE, json.dumps(sorted(modules)), json.dumps(packages)],
                          capture_output=True, text=True, timeout=280,
                          env={**os.environ, "PYTHONPATH": str(path)})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_module_imports_alone_in_a_fresh_interpreter():
    assert _import_alone(MODULES, ROOT.parent) == {}


def test_a_cycle_hidden_by_the_order_of_the_package_init_is_found(tmp_path):
    # The fault this file guards against: the package __init__ loads `a` first, so `a` <-> `b` works there,
    # while `import pkg.b` on its own meets a partially initialized `pkg.b`.
    files = {"pkg/__init__.py": "from pkg.a import A\n", "pkg/a.py": "A = 1\nfrom pkg.b import B\n",
             "pkg/b.py": "from pkg.a import A\nB = A + 1\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    modules = {"pkg": tmp_path / "pkg/__init__.py", "pkg.a": tmp_path / "pkg/a.py", "pkg.b": tmp_path / "pkg/b.py"}
    failures = _import_alone(modules, tmp_path)
    assert sorted(failures) == ["pkg.b (emptied: every package)", "pkg.b (emptied: pkg)"]
    assert "partially initialized" in failures["pkg.b (emptied: pkg)"]
