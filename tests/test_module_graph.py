"""The modules of ``pyterrier_cpdae`` import each other without a cycle (issue 11, item 4).

Which imports count: every ``import``/``from ... import`` statement anywhere in a module's source, at module level,
inside ``if TYPE_CHECKING:`` and inside functions.  A function-level import only *postpones* a cycle (the two
modules still depend on each other, and which one finishes initialising first depends on call order); an import
under ``TYPE_CHECKING`` is a cycle for type checkers and for the reader.  Both were how the old
``dense_index`` <-> ``_indexing`` <-> ``retrievers`` circle was hidden, so both count.  ``from pyterrier_cpdae import
X`` counts as an import of the module that ``pyterrier_cpdae.__init__`` lazily loads ``X`` from (its
``_EXPORTS``).  Only edges between modules of the package are considered (its ``__init__`` imports nothing
statically).
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Set

import pytest

import pyterrier_cpdae

PACKAGE = "pyterrier_cpdae"
PACKAGE_DIR = Path(pyterrier_cpdae.__file__).parent


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, current: str, is_package: bool) -> str:
    """The absolute module name of ``from <node.module> import ...`` written in module ``current``."""
    if not node.level:
        return node.module or ""
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(root: Path = PACKAGE_DIR, exports: Optional[Dict[str, str]] = None) -> Dict[str, Set[str]]:
    """``{module: {package modules it imports}}`` for every ``.py`` file under ``root`` (parsed, not imported)."""
    exports = getattr(pyterrier_cpdae, "_EXPORTS", {}) if exports is None else exports
    files = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: Dict[str, Set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        targets: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf8"), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node, name, is_package)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in files:  # from . import _index_io
                        targets.add(sub)
                    elif base == PACKAGE and alias.name in exports:  # from pyterrier_cpdae import DenseIndex
                        targets.add(exports[alias.name])
                    else:  # from ._store import DenseStore
                        targets.add(base)
        # `import a.b.c` also imports a.b; only package modules matter
        graph[name] = {t for t in targets if t in files and t != name and t != PACKAGE}
    return graph


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One import cycle ``[a, b, ..., a]`` of ``graph``, or ``None`` (iterative depth-first search)."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_find_cycle_on_hand_made_graphs():
    """The checker itself: it finds a cycle hidden behind an acyclic branch, and accepts a diamond."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}) is None  # diamond
    cycle = find_cycle({"a": {"b"}, "b": {"c", "x"}, "c": {"a"}, "x": set()})
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"}


def test_import_graph_counts_function_level_and_type_checking_imports(tmp_path):
    """A cycle made only of a function-level and a TYPE_CHECKING import (the old dense index's) is found."""
    pkg = tmp_path / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "core.py").write_text("from .writer import Writer\n")
    (pkg / "writer.py").write_text("def build():\n    from .core import Index\n")
    (pkg / "retr.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import core\n")
    (pkg / "api.py").write_text("from pyterrier_cpdae import Thing\nfrom pyterrier_cpdae.retr import x\n")
    graph = import_graph(pkg, exports={"Thing": f"{PACKAGE}.core"})
    assert graph == {PACKAGE: set(), f"{PACKAGE}.core": {f"{PACKAGE}.writer"}, f"{PACKAGE}.writer": {f"{PACKAGE}.core"},
                     f"{PACKAGE}.retr": {f"{PACKAGE}.core"}, f"{PACKAGE}.api": {f"{PACKAGE}.core", f"{PACKAGE}.retr"}}
    assert set(find_cycle(graph)) == {f"{PACKAGE}.core", f"{PACKAGE}.writer"}


def test_package_import_graph_has_no_cycle():
    graph = import_graph()
    assert f"{PACKAGE}.dense_index" in graph and graph[f"{PACKAGE}.dense_index"]  # the parse found the modules
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_dense_index_layers():
    """The store is below the writers and the retrievers, and none of them imports the index class's module
    except the retrievers (which attach their factories to it) and the public facade."""
    graph = import_graph()
    m = {k.rsplit(".", 1)[-1]: {t.rsplit(".", 1)[-1] for t in v} for k, v in graph.items()}
    assert "_dense_core" not in m["_store"] | m["_indexing"] | m["_retrieval"]
    assert "_store" in m["_indexing"] and "_store" in m["_exact_retr"] and "_store" in m["_dense_core"]
    assert {"_exact_retr", "_faiss_retr", "_dense_core"} <= m["dense_index"]
    assert "_index_io" in m["bm25"]  # the one pt_meta.json reader


@pytest.mark.parametrize("module", ["pyterrier_cpdae.dense", "pyterrier_cpdae.dense",
                                    "pyterrier_cpdae.dense.indexing", "pyterrier_cpdae.dense.faiss_retr"])
def test_module_imports_first_in_a_fresh_process(module):
    """``python -c "import <module>"`` works in a fresh interpreter (a cycle would fail on a partly initialised
    module), and afterwards ``DenseIndex`` (from its public home) has every retriever factory."""
    code = (f"import {module}; from pyterrier_cpdae.dense import DenseIndex; "
            "missing = [f for f in ('retriever', 'np_retriever', 'torch_retriever', 'scorer', 'faiss_flat_retriever', "
            "'faiss_hnsw_retriever', 'faiss_ivf_retriever') if not callable(getattr(DenseIndex, f, None))]; "
            "assert not missing, missing; print('ok')")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_DIR.parent)] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
