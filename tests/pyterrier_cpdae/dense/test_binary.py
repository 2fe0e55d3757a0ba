"""DenseIndex(dtype="binary"): sign bits, a Hamming scan and float32 rescoring of the best k * rescore_multiplier,
checked against a naive reference (Hamming distances counted bit by bit from np.packbits, the k * multiplier nearest
by (distance, docid), rescored by float64 products rounded once to float32, ordered by (score, docid)) on every scan
(FAISS popcount, numpy bit counts, torch +-1 products), with ties at the Hamming cut and near-equal scores, sharded
and single; and against the float32 index (recall; its ranking once every document is rescored)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pyterrier_cpdae.dense import DenseIndex
from pyterrier_cpdae.dense import binary as binsearch
from tests.helpers.dense import vector_frame as frame

SCANS = ("faiss", "numpy", "torch")


def naive_candidates(vecs, q, width):
    """The width documents nearest to q in Hamming distance (bits counted one by one), ties by smaller id."""
    ham = np.unpackbits(np.packbits(vecs > 0, axis=1) ^ np.packbits(q > 0), axis=1).sum(axis=1)
    return np.lexsort((np.arange(len(vecs)), ham))[:width]


def naive(vecs, queries, k, multiplier):
    """Per query: the k * multiplier nearest in Hamming distance, scored by float64 products rounded to float32 (the
    float32 index's reference arithmetic), the top k by (score, smaller id)."""
    out = []
    for q in queries:
        cand = naive_candidates(vecs, q, k * multiplier)
        scores = (vecs[cand].astype(np.float64) @ q.astype(np.float64)).astype(np.float32)
        out.append(cand[np.lexsort((cand, -scores))][:k])
    return np.array(out)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((40, 37)).astype(np.float32)  # (37 bits: a last byte only partly used)
    vecs = (centres[rng.integers(0, 40, 3000)] + 0.6 * rng.standard_normal((3000, 37))).astype(np.float32)
    vecs[100:110] = vecs[99]  # duplicates: equal Hamming distances and equal scores, cut by docid
    queries = (centres[:12] + 0.6 * rng.standard_normal((12, 37))).astype(np.float32)
    queries[0] = vecs[99]
    path = tmp_path_factory.mktemp("binary")
    f32 = DenseIndex(path / "f32")
    f32.indexer().index(frame(vecs))
    binary = DenseIndex(path / "bin")
    binary.indexer(dtype="binary").index(frame(vecs))
    return vecs, queries, f32, binary


@pytest.mark.parametrize("multiplier", [1, 4])
def test_equals_naive_reference(data, multiplier):
    vecs, queries, _, binary = data
    for k in (1, 10, 50):
        expected = naive(vecs, queries, k, multiplier)
        for scan in SCANS:
            _, ids = binary.search(queries, k, scan=scan, rescore_multiplier=multiplier)
            np.testing.assert_array_equal(ids, expected, err_msg=f"k={k} {scan}")


@pytest.mark.parametrize("dim", [8, 70, 128])
def test_hamming_ties_at_the_cut_go_to_smaller_ids(tmp_path, dim):
    """Few distinct distances (8 bits: 9 of them) and many equal codes: most cuts fall inside a run of equal
    distances; every scan keeps the nearest by (distance, smaller id), as the bit-by-bit count does."""
    rng = np.random.default_rng(dim)
    vecs = rng.standard_normal((2500, dim)).astype(np.float32)
    vecs[rng.integers(0, 2500, 800)] = vecs[rng.integers(0, 2500, 800)]  # repeated codes (and vectors)
    index = DenseIndex(tmp_path / "b")
    index.indexer(dtype="binary").index(frame(vecs))
    queries = np.concatenate([rng.standard_normal((6, dim)), vecs[:2], np.zeros((1, dim))]).astype(np.float32)
    bits = np.packbits(queries > 0, axis=1)
    for width in (1, 7, 100, 999):
        expected = [set(naive_candidates(vecs, q, width)) for q in queries]
        for scan in SCANS:
            for threads in (1, 2):
                found = binsearch.nearest(index.store.code_parts(), bits, width, scan=scan, dim=dim, block_size=256,
                                          threads=threads)
                assert found.shape == (len(queries), width)
                assert [set(row) for row in found] == expected, (scan, width, threads)


def near_ties(n=2400, dim=24, seed=0):
    """Blocks of identical vectors and copies one float32 ulp apart (the same sign bits, scores equal or one
    rounding apart), among noise."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((n // 6, dim)).astype(np.float32)
    ulp = np.nextafter(base, np.float32(np.inf))
    noise = rng.standard_normal((n - 3 * len(base), dim)).astype(np.float32)
    vecs = np.concatenate([base, ulp, base, noise])
    return vecs[rng.permutation(len(vecs))]


def test_near_ties_ordered_as_the_float32_index(tmp_path):
    """Rescored candidates are ordered by the float32 index's arithmetic (ties.reference_scores), duplicates by
    docid: against that reference on the naive candidates, and equal to the float32 index once all are rescored."""
    from pyterrier_cpdae.dense.ties import reference_scores

    vecs = near_ties()
    f32 = DenseIndex(tmp_path / "f32")
    f32.indexer().index(frame(vecs))
    binary = DenseIndex(tmp_path / "bin")
    binary.indexer(dtype="binary").index(frame(vecs))
    rng = np.random.default_rng(1)
    queries = np.concatenate([rng.standard_normal((10, 24)), vecs[:5], np.zeros((1, 24))]).astype(np.float32)
    for k, m in ((5, 3), (20, 10)):
        expected = []
        for q in queries:
            cand = naive_candidates(vecs, q, k * m)
            scores = reference_scores(q, vecs[cand])
            expected.append(cand[np.lexsort((cand, -scores))][:k])
        for scan in SCANS:
            np.testing.assert_array_equal(binary.search(queries, k, scan=scan, rescore_multiplier=m)[1],
                                          np.array(expected), err_msg=f"k={k} m={m} {scan}")
    scores, ids = binary.search(queries, 30, rescore_multiplier=len(vecs))
    s0, i0 = f32.search(queries, 30, backend="numpy")
    np.testing.assert_array_equal(ids, i0)
    np.testing.assert_allclose(scores, s0, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ids[-1], np.arange(30))  # the zero query: every score 0, docids in order


def test_sharded_view_equals_single_index(tmp_path):
    vecs = near_ties(1800, 40, seed=5)
    single = DenseIndex(tmp_path / "single")
    single.indexer(dtype="binary").index(frame(vecs))
    view = DenseIndex(tmp_path / "view")
    for s in range(3):
        view.indexer(dtype="binary", shard=s, num_shards=3).index(frame(vecs))
    assert view.num_shards == 3 and view.dtype == "binary"
    queries = np.concatenate([np.random.default_rng(6).standard_normal((12, 40)), vecs[:3]]).astype(np.float32)
    for k, m in ((1, 1), (10, 4), (50, 2)):
        expected = naive(vecs, queries, k, m)
        for scan in SCANS:
            np.testing.assert_array_equal(view.search(queries, k, scan=scan, rescore_multiplier=m)[1], expected,
                                          err_msg=f"k={k} m={m} {scan}")
        np.testing.assert_array_equal(single.search(queries, k, rescore_multiplier=m)[1], expected)
    view.merge_shards()
    np.testing.assert_array_equal(view.search(queries, 10)[1], naive(vecs, queries, 10, 4))


def test_recall_against_float32_and_full_rescoring(data):
    vecs, queries, f32, binary = data
    k = 10
    _, exact = f32.search(queries, k, backend="numpy")
    recalls = {}
    for m in (1, 4, 16):
        ids = binary.search(queries, k, rescore_multiplier=m)[1]
        recalls[m] = np.mean([len(set(a) & set(b)) / k for a, b in zip(ids, exact)])
        reference = naive(vecs, queries, k, m)
        assert recalls[m] == pytest.approx(np.mean([len(set(a) & set(b)) / k for a, b in zip(reference, exact)]))
    assert recalls[1] < recalls[16] and recalls[1] <= recalls[4] <= recalls[16]
    np.testing.assert_array_equal(binary.search(queries, k, rescore_multiplier=len(vecs))[1], exact)


def test_retriever_option_and_refusals(data, tmp_path):
    vecs, queries, f32, binary = data
    topics = pd.DataFrame({"qid": [f"q{i}" for i in range(len(queries))], "query": "x", "query_vec": list(queries)})
    res = binary.binary_retriever(num_results=5, rescore_multiplier=3)(topics)
    expected = naive(vecs, queries, 5, 3)
    assert list(res["docno"]) == [f"d{i}" for i in expected.reshape(-1)]
    for scan in SCANS:
        assert list(binary.binary_retriever(num_results=5, rescore_multiplier=3, scan=scan)(topics)["docno"]) == \
            list(res["docno"])
    assert list(binary.retriever(num_results=5)(topics)["docno"]) == \
        list(binary.binary_retriever(num_results=5, rescore_multiplier=4)(topics)["docno"])
    with pytest.raises(ValueError, match="scan must be 'faiss', 'numpy' or 'torch' for a binary index, got 'gpu'"):
        binary.search(queries, 3, scan="gpu")
    with pytest.raises(ValueError, match="scan must be 'faiss', 'numpy' or 'torch' for a binary index, got 'gpu'"):
        binary.binary_retriever(num_results=5, scan="gpu")
    with pytest.raises(ValueError, match="rescore_multiplier must be"):
        binary.binary_retriever(num_results=5, rescore_multiplier=0)
    with pytest.raises(ValueError, match="searches dtype='binary' indexes"):
        f32.binary_retriever(num_results=5)(topics)
    i8 = DenseIndex(tmp_path / "i8")
    i8.indexer(dtype="int8").index(frame(vecs[:50]))
    with pytest.raises(ValueError, match="rescore_multiplier applies to dtype='binary'"):
        i8.search(queries, 3, rescore_multiplier=2)
    with pytest.raises(ValueError, match="scan must be 'numpy' or 'torch', got 'faiss'"):
        i8.search(queries, 3, scan="faiss")
    assert binary.meta()["format_version"] == 2 and (binary.path / "codes.bin").stat().st_size == len(vecs) * 5
