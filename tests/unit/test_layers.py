"""The package's layers point only down (docs/architecture.md): the import-linter
contract in pyproject.toml, function-level imports included, run here so that an
upward import or a new cycle across layers fails the unit tier."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "sglang_kvguard"


def _lint_imports() -> str:
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        found = shutil.which("lint-imports")
        if found is None:
            pytest.fail("import-linter is not installed (pip install -e '.[test]' installs it)")
        exe = Path(found)
    return str(exe)


def _run(cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, KVGUARD_AUTO_INSTALL="0", PYTHONPATH=str(cwd))
    return subprocess.run([_lint_imports(), "--config", str(cwd / "pyproject.toml"), "--no-cache"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_layers_contract_is_kept_with_no_exceptions():
    text = (REPO / "pyproject.toml").read_text()
    assert "ignore_imports" not in text, "the layers contract lists exceptions"
    cp = _run(REPO)
    assert cp.returncode == 0 and "0 broken" in cp.stdout, cp.stdout[-4000:] + cp.stderr[-2000:]


def test_an_upward_import_breaks_the_contract(tmp_path):
    """The check can fail: a copy of the package where the engine imports a guard."""
    shutil.copytree(PKG, tmp_path / "sglang_kvguard", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    victim = tmp_path / "sglang_kvguard" / "engine" / "manifest.py"
    victim.write_text(victim.read_text() + "\n\ndef _upward():\n    from ..guards import admission_drain  # noqa: F401\n")
    cp = _run(tmp_path)
    assert cp.returncode != 0 and "1 broken" in cp.stdout, cp.stdout[-4000:]
    assert "sglang_kvguard.engine.manifest -> sglang_kvguard.guards.admission_drain" in cp.stdout, cp.stdout[-4000:]


def test_no_module_imports_the_package_root_back():
    """``sglang_kvguard/__init__.py`` re-exports and auto-installs; nothing in the package
    imports a name from it (``__version__`` lives in ``engine/version.py``); importing a
    subpackage through it (``from .. import guards``) is importing that subpackage."""
    graph = _import_graph()
    offenders = sorted(m for m, deps in graph.items() if "sglang_kvguard" in deps and m != "sglang_kvguard")
    assert not offenders, offenders


def _import_graph() -> dict:
    """module -> modules of the package it imports (any import statement, function-level
    included; imports under ``if TYPE_CHECKING:`` are annotations only and left out)."""
    mods = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(REPO).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        mods[name] = path
    graph = {m: set() for m in mods}

    def resolve(cur: str, node) -> list:
        is_pkg = mods[cur].name == "__init__.py"
        if isinstance(node, ast.Import):
            cands = [a.name for a in node.names]
        else:
            if node.level:
                base = cur if is_pkg else cur.rsplit(".", 1)[0]
                for _ in range(node.level - 1):
                    base = base.rsplit(".", 1)[0]
                base = base + ("." + node.module if node.module else "")
            else:
                base = node.module or ""
            cands = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        out = []
        for c in cands:
            while c and c not in mods and "." in c:
                c = c.rsplit(".", 1)[0]
            if c in mods and c != cur:
                out.append(c)
        return out

    for cur, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
                skip.update(id(n) for b in node.body for n in ast.walk(b))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip:
                graph[cur].update(resolve(cur, node))
    return graph


def test_no_import_cycle_anywhere_in_the_package():
    graph = _import_graph()
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"
