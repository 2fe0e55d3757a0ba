"""The guard of ``../shared`` (tests/conftest.py, tests/_shared_guard/sitecustomize.py): a test that is not a
real-data test cannot open anything under it, in its own process or in a Python process it starts; a real-data test
can. The guard is active only where ``../shared`` exists (elsewhere there is nothing to read)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.warm_python import warm_python

HERE = Path(__file__).resolve().parents[1]  # tests/
SHARED = HERE.parents[0].parent / "shared"
SPEC = importlib.util.spec_from_file_location("_guard_under_test", HERE / "_shared_guard" / "sitecustomize.py")
guard = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(guard)   # without CPDAE_TESTS_SHARED_ROOT set first it adds no hook: only its functions

active = pytest.mark.skipif(not hasattr(sys, "_cpdae_shared_guard"),
                            reason=f"the guard is off: {SHARED} is absent, so no test can read it")


def test_touches_is_the_real_path_under_the_root(tmp_path, monkeypatch):
    root = tmp_path / "shared"
    (root / "data").mkdir(parents=True)
    (tmp_path / "shared2").mkdir()
    (tmp_path / "link").symlink_to(root / "data")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    r = os.path.realpath(root)
    assert guard.touches(str(root / "data" / "x.tsv"), r) and guard.touches(root, r)
    assert guard.touches(b"../shared/data/x", r)                       # relative, and bytes
    assert guard.touches(Path("../shared/data"), r)                    # path-like
    assert not guard.touches(str(tmp_path / "shared2" / "x"), r)       # a sibling that shares the prefix
    assert not guard.touches(str(tmp_path / "link" / "x"), r)          # not named "shared": the cheap test skips it
    assert not guard.touches(3, r) and not guard.touches("", r)        # file descriptors, nothing


@active
def test_a_test_that_is_not_a_real_data_test_cannot_open_shared():
    readme = SHARED / "data" / "README.md"
    seen = sys._cpdae_shared_guard
    with pytest.raises(RuntimeError, match="which only real-data tests may read"):
        readme.read_text()
    with pytest.raises(RuntimeError, match="which only real-data tests may read"):
        os.listdir(SHARED / "data")
    assert seen == [str(readme), str(SHARED / "data")]
    seen.clear()   # else conftest fails this test for the very accesses it checks
    assert readme.exists()   # looking whether the data is there is allowed: how real-data tests decide to skip


@active
@pytest.mark.parametrize("python", ["cold", "warm"])
def test_a_process_started_by_such_a_test_cannot_open_shared_either(python):
    exe = sys.executable if python == "cold" else warm_python()
    code = f"open({str(SHARED / 'data' / 'README.md')!r}).read()"
    proc = subprocess.run([exe, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "which only real-data tests may read" in proc.stderr, proc.stderr[-2000:]
    ok = subprocess.run([exe, "-c", f"print(len(open({str(HERE / 'conftest.py')!r}).read()) > 0)"],
                        capture_output=True, text=True, timeout=120)
    assert ok.stdout.strip() == "True", ok.stderr[-2000:]


@active
@pytest.mark.real_data
def test_a_real_data_test_reads_shared_in_its_process_and_children():
    readme = SHARED / "data" / "README.md"
    assert readme.read_text()
    proc = subprocess.run([warm_python(), "-c", f"print(len(open({str(readme)!r}).read()) > 0)"],
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "True", proc.stderr[-2000:]


def test_a_real_data_test_is_one_with_the_shared_data_fixture_or_the_mark():
    from types import SimpleNamespace

    from tests.conftest import is_real_data_test

    def item(fixtures, marks=()):
        return SimpleNamespace(fixturenames=fixtures, get_closest_marker=lambda name: name if name in marks else None)
    assert is_real_data_test(item(["tmp_path", "shared_data", "vaswani_dir"]))   # vaswani_dir asks for shared_data
    assert is_real_data_test(item(["tmp_path"], marks=("real_data",)))
    assert not is_real_data_test(item(["tmp_path", "tiny_bert_dir"], marks=("slow",)))
