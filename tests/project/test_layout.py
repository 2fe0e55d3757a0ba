"""The tests mirror the packages: a test file's path names the module it tests (docs/development.md, "Test layout").

``tests/<folder>/test_<module>.py`` or ``tests/<folder>/test_<module>_<aspect>.py``, where ``<folder>`` is a folder
of ``pyterrier_cpdae``, ``pretrain`` or ``experiments`` and ``<module>`` one of its modules (``_locking.py`` is named
``locking``, ``__main__.py`` ``main``) or sub-folders, or the folder itself (tests of the wing as a whole, e.g.
``tests/pyterrier_cpdae/bm25/test_bm25_reliability.py``). Checks of the whole checkout (the architecture map, the
docs' runnable blocks, the suite's own machinery) are the named files of ``tests/project/``. Every folder of tests is a
package (``__init__.py``), so that two folders may each hold a ``test_cpdae.py``."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
PACKAGES = ("pyterrier_cpdae", "pretrain", "experiments")
#: folders of tests/ that hold no tests: helper modules, checked-in inputs, the guard of ../shared
NOT_TESTS = ("helpers", "fixtures", "_shared_guard")
#: the checks of the whole checkout, in tests/project/ (test_<name>.py)
PROJECT = ("architecture_map", "module_graph", "front_door", "docs_examples", "environment_lock", "suite_layout",
           "shared_guard", "warm_python", "gpu", "layout")


def _modules(folder: Path) -> set[str]:
    """The names a test file may use for what ``folder`` holds: its modules, its sub-folders, itself."""
    names = {folder.name}
    for p in folder.iterdir():
        if p.is_dir() and p.name != "__pycache__" and any(p.rglob("*.py")):
            names.add(p.name)
        elif p.suffix == ".py":
            names.add(p.stem.strip("_") if p.stem != "__init__" else folder.name)
    return names


def _names(stem: str) -> list[str]:
    """``test_store_reliability`` -> ``["store", "store_reliability"]``: the module names its stem may start with."""
    parts = stem.removeprefix("test_").split("_")
    return ["_".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _candidates(stem: str, repo: Path) -> list[str]:
    """Where a file named ``stem`` could go: every package folder with a module its name starts with."""
    out = []
    for package in PACKAGES:
        for folder in sorted([repo / package, *(p for p in (repo / package).rglob("*") if p.is_dir())]):
            if folder.name == "__pycache__" or "results" in folder.relative_to(repo).parts:
                continue
            if set(_names(stem)) & (_modules(folder) - {folder.name}):
                out.append(f"tests/{folder.relative_to(repo).as_posix()}/{stem}.py")
    return out


def misplaced(path: Path, repo: Path = REPO) -> Optional[str]:
    """Why the test file ``path`` (under ``repo/tests``) is not where the layout puts it, or ``None``."""
    rel = path.relative_to(repo / "tests")
    stem, folder = path.stem, rel.parent
    shown = f"tests/{rel.as_posix()}"
    if folder.parts and folder.parts[0] == "project":
        if len(folder.parts) == 1 and stem.removeprefix("test_") in PROJECT:
            return None
        return (f"{shown}: tests/project/ holds only the checks of the whole checkout ({', '.join(PROJECT)}); "
                f"a test of a module goes beside it, tests/<package folder>/test_<module>[_<aspect>].py")
    source = repo / folder
    if folder.parts and folder.parts[0] in PACKAGES and source.is_dir():
        if set(_names(stem)) & _modules(source):
            return None
        return (f"{shown}: its name names no module of {folder.as_posix()}/ (test_<module>.py or "
                f"test_<module>_<aspect>.py, <module> one of {', '.join(sorted(_modules(source)))})")
    where = _candidates(stem, repo)
    return (f"{shown}: a test file lives in the folder of tests/ that mirrors the package folder of the module it "
            f"tests, named test_<module>[_<aspect>].py (e.g. tests/pyterrier_cpdae/dense/test_store.py for "
            f"pyterrier_cpdae/dense/store.py)"
            + (f"; by its name: {' or '.join(where)}" if where else "; rename it after the module it tests"))


def _test_files(tests: Path = TESTS) -> list[Path]:
    return sorted(p for p in tests.rglob("test_*.py")
                  if p.relative_to(tests).parts[0] not in NOT_TESTS and "__pycache__" not in p.parts)


# ---------------------------------------------------------------------------------------------------- the checks
def test_every_test_file_is_named_after_the_module_it_tests():
    files = _test_files()
    assert len(files) > 100
    wrong = [why for why in map(misplaced, files) if why]
    assert not wrong, "\n".join(wrong)


def test_every_folder_of_tests_is_a_package():
    folders = {p.parent for p in _test_files()} | {TESTS / "helpers"}
    for folder in sorted(folders):
        for f in [folder, *folder.parents]:
            if f == TESTS.parent:
                break
            assert (f / "__init__.py").is_file(), f"{f.relative_to(REPO)}/ has no __init__.py (see this file's doc)"


def test_every_project_check_exists():
    for name in PROJECT:
        assert (TESTS / "project" / f"test_{name}.py").is_file(), f"tests/project/test_{name}.py is listed but absent"


def test_a_flat_or_misnamed_file_fails_naming_its_place():
    """The check itself: a new flat file, a name that names no module and a stray project file are refused with the
    place they belong; well-placed names (a module, a module with an aspect, a private module, a sub-folder, the
    wing itself) pass."""
    flat = misplaced(TESTS / "test_store.py")
    assert flat and "tests/pyterrier_cpdae/dense/test_store.py" in flat, flat
    flat = misplaced(TESTS / "test_store_reliability.py")
    assert flat and "tests/pyterrier_cpdae/dense/test_store_reliability.py" in flat, flat
    assert "rename it" in misplaced(TESTS / "test_no_such_thing_at_all.py")
    assert "names no module of pyterrier_cpdae/dense/" in misplaced(TESTS / "pyterrier_cpdae/dense/test_stores.py")
    assert "tests/project/ holds only" in misplaced(TESTS / "project/test_store.py")
    assert "rename it" not in misplaced(TESTS / "nowhere/test_store.py")
    for ok in ("pyterrier_cpdae/dense/test_store.py", "pyterrier_cpdae/dense/test_store_reliability.py",
               "pyterrier_cpdae/dense/test_exact_retr_ties.py", "pyterrier_cpdae/test_locking.py",
               "pyterrier_cpdae/test_bm25.py", "pyterrier_cpdae/bm25/test_bm25_reliability.py",
               "experiments/paper/test_main_jobs.py", "project/test_layout.py"):
        assert misplaced(TESTS / ok) is None, ok
