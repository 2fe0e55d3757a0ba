"""How the suite itself runs (docs/development.md, "Test layout, fixtures and parallelism"): the README's command is
parallel (pytest-xdist, whole files per worker), the heaviest files go first, and the docs pages run once each
whichever way the tests are handed out."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

from tests import conftest
from tests.project import test_docs_examples as docs_examples

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]


def _pyproject() -> dict:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def test_the_readme_command_runs_on_two_workers_whole_files_each():
    """addopts gives ``-n 2 --dist loadfile``, and the test extra installs the plugin those options need (without
    it the README's command would stop at 'unrecognized arguments: -n')."""
    cfg = _pyproject()
    opts = shlex.split(cfg["tool"]["pytest"]["ini_options"]["addopts"])
    assert opts[opts.index("-n") + 1] == "2" and opts[opts.index("--dist") + 1] == "loadfile", opts
    assert any(req.replace(" ", "").startswith("pytest-xdist") for req in cfg["project"]["optional-dependencies"]["test"])


def test_heavy_files_exist_and_are_moved_to_the_front_whole_and_in_order():
    for name in conftest.HEAVY_FIRST:
        assert (REPO / "tests" / name).is_file(), f"tests/{name} is in HEAVY_FIRST but does not exist"
    heavy = conftest.HEAVY_FIRST[:2]
    files = ["test_a.py", heavy[1], "test_b.py", heavy[0], "test_c.py"]
    items = [SimpleNamespace(path=REPO / "tests" / f, name=f"{f}::t{i}") for f in files for i in range(2)]
    conftest.pytest_collection_modifyitems(None, items)
    assert [it.name for it in items] == [f"{f}::t{i}" for f in [heavy[0], heavy[1], "test_a.py", "test_b.py",
                                                                  "test_c.py"] for i in range(2)]


def _config(worker: bool, dist: str = "no"):
    cfg = SimpleNamespace(getoption=lambda name, default=None: {"dist": dist}.get(name, default))
    if worker:
        cfg.workerinput = {"workerid": "gw0"}
    return cfg


def test_docs_pages_start_together_only_where_this_process_runs_the_whole_file():
    whole = docs_examples._whole_file_on_this_process
    assert whole(_config(worker=False))                       # one process (-n 0)
    assert whole(_config(worker=True, dist="loadfile")) and whole(_config(worker=True, dist="loadscope"))
    assert not whole(_config(worker=True, dist="load")) and not whole(_config(worker=True, dist="worksteal"))


def test_lazy_page_runs_start_a_page_when_its_test_asks_and_only_once():
    submitted = []

    class Pool:
        def submit(self, fn, page, root):
            submitted.append((fn, page, root))
            return f"future of {page}"

    runs = docs_examples._LazyRuns(Pool(), lambda page: f"/tmp/{page}")
    assert submitted == []
    assert runs["a.md"] == "future of a.md" and runs["a.md"] == "future of a.md"
    assert submitted == [(docs_examples.run_page, "a.md", "/tmp/a.md")]
