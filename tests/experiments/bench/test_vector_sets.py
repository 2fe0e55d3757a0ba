"""The compressed-index benchmarks' vectors (``experiments/bench/vector_sets.py``): the same seed gives the vectors
the benchmarks were measured on before the generator had one home (pinned by a SHA-256 taken from bench_int8.py's
and bench_binary.py's own copies, which gave equal digests), both benchmarks use this one generator, and the
helpers check against hand-computed values."""
from __future__ import annotations

import hashlib

import numpy as np

from experiments.bench import bench_binary, bench_int8, vector_sets

#: SHA-256 of synthetic_batches(1000, 24, batch=300, seed=3)'s vectors and docnos, then synthetic_queries(50, 24,
#: seed=3), as the two benchmarks' copies of the generator produced them
BEFORE = "6b64347ff0ba12e018be3a605c0d8f421b17991a4f3d499bfad000f9f23c2d63"


def _digest(batches, queries) -> str:
    h = hashlib.sha256()
    for frame in batches:
        h.update(np.stack(frame["doc_vec"]).tobytes())
        h.update(",".join(frame["docno"]).encode())
    h.update(queries.tobytes())
    return h.hexdigest()


def test_the_same_seed_gives_the_vectors_of_before():
    batches = list(vector_sets.synthetic_batches(1000, 24, batch=300, seed=3))
    assert [len(f) for f in batches] == [300, 300, 300, 100]
    assert list(batches[-1]["docno"])[-1] == "d999" and batches[1]["docno"].iloc[0] == "d300"
    queries = vector_sets.synthetic_queries(50, 24, seed=3)
    assert queries.shape == (50, 24) and queries.dtype == np.float32
    assert _digest(batches, queries) == BEFORE
    # another seed, other vectors
    assert _digest(vector_sets.synthetic_batches(1000, 24, batch=300, seed=4),
                   vector_sets.synthetic_queries(50, 24, seed=4)) != BEFORE


def test_both_benchmarks_use_the_one_generator():
    for bench in (bench_int8, bench_binary):
        assert bench.synthetic_batches is vector_sets.synthetic_batches
        assert bench.synthetic_queries is vector_sets.synthetic_queries
        assert bench.build is vector_sets.build and bench.recall is vector_sets.recall
        assert bench.load_set is vector_sets.load_set


def test_recall_and_build(tmp_path):
    ref = np.array([[1, 2], [3, 4]])
    ids = np.array([[2, 9, 1], [5, 6, 3]])  # recall@2: query 0 finds 2 of {1, 2}, query 1 neither
    assert vector_sets.recall(ids, ref) == (0.5 + 0.0) / 2
    index = vector_sets.build(tmp_path / "f32", vector_sets.synthetic_batches(40, 8, batch=16), "float32")
    assert len(index) == 40
    again = vector_sets.build(tmp_path / "f32", iter(()), "float32")  # built already: kept, not rebuilt
    assert len(again) == 40
