"""The package's layering holds: import-linter's contracts (pyproject.toml) pass, and no module
imports itself back through a chain (no import cycles)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    exe = Path(sys.executable).parent / "lint-imports"
    assert exe.exists(), "import-linter is a test dependency: pip install -e '.[test]'"
    proc = subprocess.run([str(exe), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in graph.modules or not w.startswith("pasta_engine"):
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for m in sorted(graph.modules):
        if m.startswith("pasta_engine") and m not in index:
            visit(m)
    return out


def test_no_import_cycles():
    graph = grimp.build_graph("pasta_engine", cache_dir=None)
    assert len([m for m in graph.modules if m.startswith("pasta_engine.")]) > 30
    assert _cycles(graph) == []
