"""``docs/architecture.md`` is a true map of the three packages, and the layout keeps its shape.

* every module of ``pyterrier_cpdae``, ``pretrain`` and ``experiments`` is named in the map's trees, and every module
  the trees name exists;
* a module docstring names only modules that exist (``pkg.module[.name]`` and ``pkg/path/module.py``);
* at most 8 ``.py`` files directly in ``pretrain/``; no module of ``pyterrier_cpdae/`` or ``pretrain/`` over 700
  lines unless it is one class; exactly one module registers an attention function with transformers.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Set

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("pyterrier_cpdae", "pretrain", "experiments")
MAP = REPO / "docs" / "architecture.md"
MAX_LINES = 700

_ENTRY = re.compile(r"[A-Za-z_][\w.]*(?:/|\.py)")


def package_modules(package: str) -> Set[str]:
    """Repository-relative paths of the ``.py`` files of ``package`` (recorded results left out)."""
    root = REPO / package
    return {str(p.relative_to(REPO)) for p in root.rglob("*.py")
            if "results" not in p.relative_to(root).parts and "__pycache__" not in p.parts}


def map_entries(text: str) -> Set[str]:
    """The paths the directory trees of ``text`` name: a tree is a fenced block whose first line is ``<package>/``;
    each line names entries (``name.py`` or ``name/``, several separated by commas) before its description, two
    spaces of indentation per level.  A named directory stands for its ``__init__.py``."""
    found: Set[str] = set()
    blocks, block = [], None
    for line in text.split("\n"):
        if line.startswith("```"):
            block = [] if block is None else blocks.append(block)  # opening fence / closing fence (-> None)
        elif block is not None:
            block.append(line)
    for lines in blocks:
        if not lines or lines[0].strip() not in {f"{p}/" for p in PACKAGES}:
            continue
        stack = [lines[0].strip()]
        for line in lines[1:]:
            content = line.lstrip(" ")
            if not content:
                continue
            depth = (len(line) - len(content)) // 2  # 1: directly in the package
            names = [n.strip() for n in re.split(r"\s{2,}", content, maxsplit=1)[0].split(",")]
            names = [n for n in names if n]
            if not names or not all(_ENTRY.fullmatch(n) for n in names) or depth < 1 or depth > len(stack):
                continue  # a description (or its continuation)
            del stack[depth:]
            for name in names:
                path = "".join(stack) + name
                if name.endswith("/"):
                    found.add(path + "__init__.py")
                    stack.append(name)
                else:
                    found.add(path)
    return found


def test_map_parser_on_a_hand_made_tree():
    text = ("```\npretrain/\n  cli.py           the command\n  data/            what the model reads\n"
            "    corpus.py        the cache\n    a.py, b.py,\n    c.py\n                     one each\n"
            "  model/\n    heads.py         heads, checks,\n                     losses.py in words\n```\n")
    assert map_entries(text) == {"pretrain/cli.py", "pretrain/data/__init__.py", "pretrain/data/corpus.py",
                                 "pretrain/data/a.py", "pretrain/data/b.py", "pretrain/data/c.py",
                                 "pretrain/model/__init__.py", "pretrain/model/heads.py"}


@pytest.mark.parametrize("package", PACKAGES)
def test_architecture_map_names_every_module(package):
    named = {p for p in map_entries(MAP.read_text(encoding="utf8")) if p.startswith(package + "/")}
    modules = package_modules(package)
    # the package's own __init__ is the tree's first line; a folder of data (data/sample/, configs/) names a folder
    missing = sorted(modules - named - {f"{package}/__init__.py"})
    assert not missing, f"modules missing from docs/architecture.md: {missing}"
    ghosts = sorted(p for p in named - modules if not (p.endswith("/__init__.py") and (REPO / p).parent.is_dir()))
    assert not ghosts, f"docs/architecture.md names modules that do not exist: {ghosts}"


def _module_files() -> List[Path]:
    return sorted(REPO / m for pkg in PACKAGES for m in package_modules(pkg))


def _defined_names(path: Path) -> Set[str]:
    """Names a module defines or imports at its top level, plus the string constants of a package ``__init__``
    (the lazy ``_EXPORTS`` tables name what it exports)."""
    tree = ast.parse(path.read_text(encoding="utf8"))
    names: Set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try)):
            names.update(n.name for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.ClassDef)))
            names.update((a.asname or a.name).split(".")[0] for n in ast.walk(node)
                         if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names)
    if path.name == "__init__.py":
        names.update(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str))
    return names


def dotted_problem(dotted: str) -> str | None:
    """Why ``pkg.a.b...`` names no module (or no name of one) of the repository; ``None`` when it does."""
    parts = dotted.split(".")
    path = REPO / parts[0]
    for i, part in enumerate(parts[1:], 1):
        if (path / part).is_dir() and (path / part / "__init__.py").is_file():
            path = path / part
        elif (path / f"{part}.py").is_file():
            path = path / f"{part}.py"
            rest = parts[i + 1:]
            if rest and rest[0] not in _defined_names(path):
                return f"{'.'.join(parts[:i + 1])} has no {rest[0]!r}"
            return None
        elif path.is_dir():
            if part in _defined_names(path / "__init__.py"):
                return None
            return f"no module {'.'.join(parts[:i + 1])}"
    return None


_DOTTED = re.compile(r"(?<![\w./-])((?:pyterrier_cpdae|pretrain|experiments)(?:\.[A-Za-z_]\w*)+)")
_PATH = re.compile(r"(?<![\w./-])((?:pyterrier_cpdae|pretrain|experiments)/[\w/]*?\w+\.py)\b")


#: what a dotted name ending in one of these is: a file name (``experiments.md``), not a module
_FILE_SUFFIXES = {"md", "py", "json", "csv", "txt", "sh", "yaml", "yml", "png", "log", "jsonl", "tsv"}


def _config_keys() -> Set[str]:
    """Dotted key paths of the experiment configs (``pretrain.base_model``: a key, not a module)."""
    import json

    keys: Set[str] = set()

    def walk(obj, prefix):
        if isinstance(obj, dict):
            for k, v in obj.items():
                keys.add(prefix + k)
                walk(v, prefix + k + ".")
    for f in (REPO / "experiments" / "configs").glob("*.json"):
        walk(json.loads(f.read_text(encoding="utf8")), "")
    return keys


def docstring_problems(path: Path, config_keys: Set[str] = frozenset()) -> List[str]:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf8"))) or ""
    problems = []
    for dotted in sorted(set(_DOTTED.findall(doc))):
        parts = dotted.rstrip(".").split(".")
        if parts[-1] in _FILE_SUFFIXES or not (parts[1][0].islower() or parts[1][0] == "_"):
            continue  # a file name, or a class of the package's Java helper (pyterrier_cpdae.BlobIndexer)
        if dotted.rstrip(".") in config_keys:
            continue
        why = dotted_problem(dotted.rstrip("."))
        if why:
            problems.append(f"{dotted}: {why}")
    for rel in sorted(set(_PATH.findall(doc))):
        if not (REPO / rel).is_file():
            problems.append(f"{rel}: no such file")
    return problems


def test_docstring_checker_on_hand_made_docstrings(tmp_path):
    assert dotted_problem("pyterrier_cpdae.dense.kernels") is None
    assert dotted_problem("pyterrier_cpdae.dense.DenseIndex") is None  # a name the package exports
    assert dotted_problem("pretrain.training.trainer.Trainer") is None
    assert dotted_problem("pretrain.trainer") == "no module pretrain.trainer"
    assert dotted_problem("pretrain.training.trainer.NoSuchThing") == "pretrain.training.trainer has no 'NoSuchThing'"
    f = tmp_path / "m.py"
    f.write_text('"""See :mod:`pyterrier_cpdae._exact_search`, pretrain/unpadded.py; '
                 'pretrain/model/unpadded.py is fine."""\n')
    problems = docstring_problems(f)
    assert problems == ["pyterrier_cpdae._exact_search: no module pyterrier_cpdae._exact_search",
                        "pretrain/unpadded.py: no such file"], problems


def test_module_docstrings_name_modules_that_exist():
    keys = _config_keys()
    problems = {str(p.relative_to(REPO)): docstring_problems(p, keys) for p in _module_files()}
    problems = {k: v for k, v in problems.items() if v}
    assert not problems, f"module docstrings naming modules that do not exist: {problems}"


def test_pretrain_top_level_holds_at_most_8_modules():
    files = sorted(p.name for p in (REPO / "pretrain").glob("*.py"))
    assert len(files) <= 8, f"{len(files)} .py files directly in pretrain/ (at most 8): {files}"


def _one_class(tree: ast.Module, lines: int) -> bool:
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    return len(classes) == 1 and classes[0].end_lineno - classes[0].lineno + 1 >= 0.8 * lines


@pytest.mark.parametrize("package", ["pyterrier_cpdae", "pretrain"])
def test_no_module_over_700_lines_unless_one_class(package):
    long = {}
    for m in sorted(package_modules(package)):
        text = (REPO / m).read_text(encoding="utf8")
        lines = len(text.splitlines())
        if lines > MAX_LINES and not _one_class(ast.parse(text), lines):
            long[m] = lines
    assert not long, f"modules over {MAX_LINES} lines (split them along their concepts): {long}"


def _registers_attention(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "register"
                and ast.unparse(node.func.value).split(".")[-1] == "AttentionInterface"):
            return True
    return False


def test_exactly_one_module_registers_an_attention_function():
    assert _registers_attention(ast.parse("from transformers import AttentionInterface\n"
                                          "AttentionInterface.register('x', f)\n"))
    registering = sorted(str(p.relative_to(REPO)) for p in _module_files()
                         if _registers_attention(ast.parse(p.read_text(encoding="utf8"))))
    assert registering == ["pyterrier_cpdae/encoder/attention.py"], registering
