"""experiments/bench/bench_int8_msmarco_scale.py (the 8.8M x 768 int8 scenario) at a tiny size: the script builds an
int8 index through the indexer, searches it through the retriever, measures the int8 compute bound and checks the
ranking against an exact float search; its JSON holds every figure the record quotes. Its exact reference is checked
against a naive one (all scores, one sort) on vectors with exact ties."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.helpers.warm_python import warm_python

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from experiments.bench import bench_int8_msmarco_scale as scale  # noqa: E402

SCRIPT = ROOT / "experiments" / "bench" / "bench_int8_msmarco_scale.py"


def run(*args, cwd):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return subprocess.run([warm_python(), str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_scale_bench_smoke(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out.json"
    docs, dim = 3000, 32
    res = run("--workdir", str(work), "--docs", str(docs), "--dim", str(dim), "--queries", "16", "--ks", "10", "100",
              "--check-queries", "5", "--bound-seconds", "0.05", "--json", str(out), cwd=tmp_path)
    assert res.returncode == 0, res.stderr + res.stdout
    summary = json.loads(out.read_text())
    files = summary["build"]["files"]
    # the indexer wrote an int8 index: codes a quarter of the float copy, which it keeps
    assert files["codes.bin"] == docs * dim and files["vectors.bin"] == docs * dim * 4
    assert "calibration.npz" in files and summary["build"]["build_wall_s"] > 0
    assert summary["build"]["memory"]["VmHWM_gib"] > 0
    assert (summary["docs"], summary["dim"], summary["queries"]) == (docs, dim, 16)
    assert [r["k"] for r in summary["runs"]] == [10, 100]
    for r in summary["runs"]:
        assert r["queries_per_s"] > 0 and r["bound_gops_before"] > 0 and r["bound_gops_after"] > 0
        assert np.isclose(r["share_of_bound"], r["bound_s"] / r["search_wall_s"])
        # the proof rescored at least the k best of each query from the float copy, and not every document
        assert r["k"] <= r["float_rows_read_per_query"] < docs
        assert np.isclose(r["scan_s"] + r["rescore_s"] + r["other_s"], r["search_wall_s"]) and "product_pass_s" not in r
    assert summary["memory_after_searches"]["VmHWM_gib"] > 0
    assert summary["check"] == [{"k": 10, "queries": 5, "identical": 5}, {"k": 100, "queries": 5, "identical": 5}]
    assert summary["check_ok"] is True
    assert "| 100 | 16 |" in res.stdout and "5/5 |" in res.stdout and "share of the bound" in res.stdout
    # the search stage alone writes its --json too, with the build's record
    alone = tmp_path / "search.json"
    res = run("--workdir", str(work), "--docs", str(docs), "--dim", str(dim), "--queries", "4", "--ks", "10",
              "--check-queries", "2", "--bound-seconds", "0.05", "--stage", "search", "--json", str(alone),
              "--breakdown", "--cold-float-copy", cwd=tmp_path)
    assert res.returncode == 0, res.stderr + res.stdout
    searched = json.loads(alone.read_text())
    assert searched["build"]["files"] == files and searched["check"] == [{"k": 10, "queries": 2, "identical": 2}]
    # the search's own stats: its parts add up to its wall time; --breakdown times the scan's product alone
    b = searched["runs"][0]
    assert np.isclose(b["scan_s"] + b["rescore_s"] + b["other_s"], b["search_wall_s"])
    assert b["scan_s"] > 0 and b["rescore_s"] > 0 and b["product_pass_s"] > 0
    assert b["tile_rows"] == 16384  # 4 queries in one digit: their products fit the cache at the block size
    assert b["candidates_per_query"] >= b["float_rows_read_per_query"] >= 10
    assert np.isclose(b["scan_share_of_bound"], b["bound_s"] / b["scan_s"])
    assert np.isclose(b["product_pass_share_of_bound"], b["bound_s"] / b["product_pass_s"])
    assert "the scan's product alone" in res.stdout
    assert searched["command"].startswith("python experiments/bench/bench_int8_msmarco_scale.py --workdir")
    # a second run reuses the build; another size is refused by name; --clean deletes the data
    again = run("--workdir", str(work), "--docs", str(docs + 1), "--dim", str(dim), "--stage", "search", cwd=tmp_path)
    assert again.returncode != 0 and f"holds a {docs} x {dim} int8 index" in again.stderr
    assert run("--workdir", str(work), "--clean", cwd=tmp_path).returncode == 0
    assert not work.exists()


def test_exact_reference_against_a_naive_sort():
    rng = np.random.default_rng(3)
    vecs = rng.standard_normal((700, 24)).astype(np.float32)
    vecs[300:320] = vecs[5]  # exact ties: ordered by ascending id
    vecs[650] = vecs[5]
    queries = np.concatenate([rng.standard_normal((3, 24)), vecs[5:6]]).astype(np.float32)
    got = scale.exact_reference(vecs, queries, 50, chunk=64)  # chunks smaller than k: the merge is exercised
    scores = (queries.astype(np.float64) @ vecs.astype(np.float64).T).astype(np.float32)
    for j in range(len(queries)):
        naive = sorted(range(len(vecs)), key=lambda i: (-float(scores[j, i]), i))[:50]
        assert got[j].tolist() == naive
    assert got[3][:22].tolist() == [5] + list(range(300, 320)) + [650]


def test_synthetic_vectors_are_deterministic_with_bert_like_norms():
    gen = scale.Synthetic(64)
    docs = gen.documents(0, 4000)
    assert np.array_equal(scale.Synthetic(64).documents(1000, 1100), docs[1000:1100])
    norms = np.linalg.norm(docs, axis=1)
    assert abs(norms.mean() - scale.NORM_MEAN) < 0.1 and 0.03 < norms.std() / norms.mean() < 0.07
    unit = docs[:500] / norms[:500, None]
    cos = unit @ unit.T
    assert 0.3 < cos[np.triu_indices(500, 1)].mean() < 0.7  # the shared mean direction: scores not all near 0
