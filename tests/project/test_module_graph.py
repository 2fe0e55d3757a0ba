"""The modules of ``pyterrier_cpdae``, ``pretrain`` and ``experiments`` import each other without a cycle,
no experiment script imports another script, and the layout keeps its shape.

Which imports count: every ``import``/``from ... import`` statement anywhere in a module's source, at module level,
inside ``if TYPE_CHECKING:`` and inside functions.  A function-level import only *postpones* a cycle (the two
modules still depend on each other, and which one finishes initialising first depends on call order); an import
under ``TYPE_CHECKING`` is a cycle for type checkers and for the reader.  Both were how the old
``dense_index`` <-> ``_indexing`` <-> ``retrievers`` circle was hidden, so both count.  ``from pyterrier_cpdae import
X`` counts as an import of the module that ``pyterrier_cpdae.__init__`` lazily loads ``X`` from (its
``_EXPORTS``), and likewise for the wings' lazy ``__init__`` (``pyterrier_cpdae.encoder``, ``pyterrier_cpdae.bm25``).
Only edges between modules of one package are considered, not edges to the top-level package itself.
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
REPO = PACKAGE_DIR.parent
PACKAGES = ["pyterrier_cpdae", "pretrain", "experiments"]
WINGS = ["dense", "encoder", "bm25", "datasets"]
#: modules directly in pyterrier_cpdae/ that every wing may import (and that import no wing)
SHARED = ["_artifact", "_checks", "_files", "_lazy", "_locking", "_moved", "_producers"]


def package_exports() -> Dict[str, Dict[str, str]]:
    """``{package module: its _EXPORTS}`` of the packages whose ``__init__`` loads names lazily."""
    import importlib

    out = {}
    for name in (PACKAGE, f"{PACKAGE}.encoder", f"{PACKAGE}.bm25"):
        out[name] = dict(getattr(importlib.import_module(name), "_EXPORTS", {}))
    return out


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
    """``{module: {package modules it imports}}`` for every ``.py`` file under ``root`` (parsed, not imported).

    ``exports``: the top-level package's lazy names (default: those of every lazy ``__init__`` of ``pyterrier_cpdae``).
    A plain ``import name`` of a module that sits beside the importing file (a script that put its own directory on
    ``sys.path``) counts as an import of that module.
    """
    package = root.name
    if exports is None:
        lazy = package_exports() if package == PACKAGE else {}
    else:
        lazy = {package: exports}
    files = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: Dict[str, Set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        targets: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf8"), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    sibling = ".".join(name.split(".")[:-1] + [alias.name])
                    targets.add(sibling if "." not in alias.name and sibling in files else alias.name)
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node, name, is_package)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in files:  # from . import format
                        targets.add(sub)
                    elif alias.name in lazy.get(base, {}):  # from pyterrier_cpdae import DenseIndex
                        targets.add(lazy[base][alias.name])
                    else:  # from .store import DenseStore
                        targets.add(base)
        # `import a.b.c` also imports a.b; only package modules matter
        graph[name] = {t for t in targets if t in files and t != name and t != package}
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


@pytest.mark.parametrize("package", PACKAGES)
def test_package_import_graph_has_no_cycle(package):
    graph = import_graph(REPO / package)
    assert len(graph) > 10 and any(graph.values())  # the parse found the modules and their imports
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_dense_index_layers():
    """The store is below the writers and the retrievers, and none of them imports the index class's module
    except the retrievers (which attach their factories to it) and the wing's public face."""
    graph = import_graph()
    m = {k[len("pyterrier_cpdae."):]: {t[len("pyterrier_cpdae."):] for t in v} for k, v in graph.items()
         if k.startswith("pyterrier_cpdae.")}
    assert "dense.index" not in m["dense.store"] | m["dense.indexing"] | m["dense.retrieval"]
    assert {"dense.store"} <= m["dense.indexing"] & m["dense.exact_retr"] & m["dense.index"]
    assert {"dense.exact_retr", "dense.faiss_retr", "dense.index"} <= m["dense"]
    assert "_artifact" in m["bm25.index"] and "_artifact" in m["dense.format"]  # the one pt_meta.json reader


def test_wings_import_only_themselves_and_the_shared_helpers():
    """dense/, encoder/, bm25/ and datasets/ do not reach into each other; the shared helpers import no wing (so no
    wing holds something another wing needs)."""
    graph = import_graph()
    shared = {f"{PACKAGE}.{s}" for s in SHARED}
    for module, targets in graph.items():
        wing = next((w for w in WINGS if module == f"{PACKAGE}.{w}" or module.startswith(f"{PACKAGE}.{w}.")), None)
        if wing is not None:
            own = {t for t in targets if t == f"{PACKAGE}.{wing}" or t.startswith(f"{PACKAGE}.{wing}.")}
            assert targets - own <= shared, f"{module} imports another wing: {sorted(targets - own - shared)}"
        elif module in shared:
            assert targets <= shared, f"{module} imports a wing: {sorted(targets - shared)}"


def test_pretrain_arguments_import_no_objective():
    """The options module composes a run's options through the registry, not by importing the objectives."""
    graph = import_graph(REPO / "pretrain")
    assert graph["pretrain.arguments"] <= {"pretrain.registry"}
    assert not {t for t in graph["pretrain.registry"] if t.startswith("pretrain.")}
    assert "pretrain.arguments" in graph["pretrain.objectives.base"]


def test_pretrain_wings_import_one_way():
    """The data, model and training wings of ``pretrain`` stand below the objectives and the commands: they import
    one another not at all, and of the top only the registry (model: the heads load the objectives that register
    their modules)."""
    graph = import_graph(REPO / "pretrain")
    below = {"data": set(), "model": {"pretrain.registry"}, "training": set()}
    for module, targets in graph.items():
        wing = next((w for w in below if module == f"pretrain.{w}" or module.startswith(f"pretrain.{w}.")), None)
        if wing is not None:
            outside = {t for t in targets if not t.startswith(f"pretrain.{wing}.")}
            assert outside <= below[wing], f"{module} imports {sorted(outside - below[wing])}"


def _is_script(path: Path) -> bool:
    """Whether a module of ``experiments/`` is a program: it has a ``__main__`` guard or runs code when imported
    (anything at module level other than imports, definitions, assignments, docstrings and ``if``/``try`` blocks)."""
    tree = ast.parse(path.read_text(encoding="utf8"))
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return True
        if isinstance(node, (ast.For, ast.While, ast.With)) or (
                isinstance(node, ast.Expr) and not isinstance(node.value, ast.Constant)):
            return True
    return False


def experiment_scripts() -> Dict[str, Path]:
    """Modules of ``experiments/`` that are programs, outside the ``experiments.paper`` package (a library with one
    entry point, ``python -m experiments.paper``)."""
    root = REPO / "experiments"
    return {_module_name(p, root): p for p in sorted(root.rglob("*.py"))
            if p.name not in ("__init__.py", "__main__.py") and "paper" not in p.relative_to(root).parts[:1]
            and _is_script(p)}


def test_script_detection():
    scripts = experiment_scripts()
    assert {"experiments.main", "experiments.bench.bench_objectives", "experiments.studies.encode_rank_noise",
            "experiments.studies.low_resource", "experiments.gpu.bench_gpu"} <= set(scripts)
    assert "experiments.studies.common" not in scripts and "experiments.bench.objective_runs" not in scripts


def test_no_experiment_script_imports_another_script():
    graph = import_graph(REPO / "experiments")
    scripts = set(experiment_scripts())
    offenders = {m: sorted(graph[m] & scripts) for m in graph if graph[m] & scripts}
    assert not offenders, f"scripts imported by other modules (move the shared code into a library module): {offenders}"


@pytest.mark.parametrize("folder, limit", [("pyterrier_cpdae", 8), ("experiments", 12)])
def test_file_count_limits(folder, limit):
    """The top of the plugin shows its wings, not a lobby of modules; experiments/ keeps its scripts in bench/,
    studies/, gpu/ and paper/."""
    files = sorted(p.name for p in (REPO / folder).glob("*.py"))
    assert len(files) <= limit, f"{len(files)} .py files directly in {folder}/ (at most {limit}): {files}"


@pytest.mark.parametrize("module", ["pyterrier_cpdae.dense", "pyterrier_cpdae.dense.index",
                                    "pyterrier_cpdae.dense.indexing", "pyterrier_cpdae.dense.faiss_retr",
                                    "pyterrier_cpdae.dense.exact_retr"])
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
