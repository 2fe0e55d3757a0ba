"""Smoke run of experiments/bench/bench_search_bound.py (the exact-search compute-bound benchmark) at a tiny size: the script
runs end to end, its float64 brute-force check passes on the kernel's output, and a vectors file of other sizes
is refused by name rather than benchmarked."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np

from tests.helpers.warm_python import warm_python

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "experiments" / "bench" / "bench_search_bound.py"


def run(*args, cwd):
    """The script in a process of its own, started warm (tests/helpers/warm_python.py: its commit line imports ``pretrain``,
    and with it transformers, ~8 CPU-s per cold start)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return subprocess.run([warm_python(), str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_bench_search_bound_smoke(tmp_path):
    vecs = tmp_path / "v.npy"
    small = ["--docs", "3000", "--dim", "16", "--queries", "40", "--ks", "50", "5", "--repeats", "1",
             "--block-size", "512", "--bound-seconds", "0.05", "--check-queries", "8"]
    res = run("--vectors", str(vecs), *small, cwd=tmp_path)
    assert res.returncode == 0, res.stderr + res.stdout
    assert "for all 8 checked queries" in res.stdout
    assert "| 50 |" in res.stdout and "| 5 |" in res.stdout
    # the fused path (the default) and the unfused one, timed in turn, rank alike
    for k in (50, 5):
        assert f"| {k} | fused |" in res.stdout and f"| {k} | unfused |" in res.stdout
        assert f"k={k}: fused and unfused return identical ids for 100.0% of the queries" in res.stdout
    assert "tiled" in res.stdout  # the bound's two arrangements
    assert "fused path: NOT taken at this shape" in res.stdout  # 40 queries: scored whole, as the kernel does
    made = np.load(vecs, mmap_mode="r")
    assert made.shape == (3000, 16) and made.dtype == np.float32
    again = run("--vectors", str(vecs), *small, cwd=tmp_path)  # reused, not re-made
    assert again.returncode == 0, again.stderr
    wrong = run("--vectors", str(vecs), *[a if a != "3000" else "3001" for a in small], cwd=tmp_path)
    assert wrong.returncode != 0 and "holds 3000 x 16 vectors" in wrong.stderr


def test_bench_search_bound_times_the_fused_path_where_the_kernel_takes_it(tmp_path):
    """128 queries by 16,384-row blocks (8 MiB of scores): the fused path is taken from the second block on, and its
    ranking equals the unfused path's and the float64 brute force's (up to float32 rounding)."""
    res = run("--vectors", str(tmp_path / "v.npy"), "--docs", "20000", "--dim", "16", "--queries", "128",
              "--ks", "50", "--repeats", "1", "--bound-seconds", "0.05", "--check-queries", "8", "--threads", "2",
              cwd=tmp_path)
    assert res.returncode == 0, res.stderr + res.stdout
    assert "fused path: taken (2 workers" in res.stdout
    assert "k=50: fused and unfused return identical ids for 100.0% of the queries" in res.stdout
    assert "k=50 fused: rankings equal to the float64 brute force's" in res.stdout
