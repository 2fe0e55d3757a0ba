"""Ties exact by construction on float vectors: duplicate stored vectors score equal bit for bit and come out in
ascending docid order on every backend (numpy fused and unfused, one thread, a 3-shard view, a float16 index, torch),
although a float32 BLAS product can score identical rows one unit in the last place apart (OpenBLAS's matrix-vector
product computes the last row of a block otherwise).

Reference: every document scored in float64 (exact products of the stored float32 values), sorted by
(-score, docid) in plain Python; duplicates tie exactly there.
"""
from __future__ import annotations

import numpy as np
import pytest

from pyterrier_cpdae import DenseIndex
from pyterrier_cpdae.dense import kernels

DIM = 48
N = 999
BLOCK = 333  # the last row of each block is where a matrix-vector product rounds otherwise


def float_corpus():
    """Random normal vectors; the rows at the end of each block and a few others copy rows 0..5 exactly."""
    rng = np.random.default_rng(3)
    vecs = rng.standard_normal((N, DIM)).astype(np.float32)
    for j, row in enumerate((BLOCK - 1, 2 * BLOCK - 1, N - 1, 100, 400, 700)):
        vecs[row] = vecs[j % 3]
    return vecs


def queries(vecs):
    """Queries near rows 0..2, so that their duplicates are at the top, plus random ones."""
    rng = np.random.default_rng(4)
    near = np.repeat(vecs[:3], 20, axis=0) + 0.3 * rng.standard_normal((60, DIM)).astype(np.float32)
    return np.concatenate([near, rng.standard_normal((20, DIM))]).astype(np.float32)


def naive_top(vecs, q, k):
    exact = vecs.astype(np.float64) @ q.astype(np.float64)
    return sorted(range(len(vecs)), key=lambda i: (-exact[i], i))[:k]


@pytest.fixture(scope="module")
def indexes(tmp_path_factory):
    vecs = float_corpus()
    root = tmp_path_factory.mktemp("ties")
    docs = [{"docno": f"d{i:04d}", "doc_vec": vecs[i]} for i in range(N)]
    single = DenseIndex(root / "single")
    single.indexer().index(docs)
    half = DenseIndex(root / "half")
    half.indexer(dtype="float16").index(docs)
    view = DenseIndex(root / "view")
    for s in range(3):
        view.indexer(shard=s, num_shards=3).index(docs)
    return vecs, {"single": single, "half": half, "view": view}


CASES = [("single", "numpy", dict(fused=False, threads=1, query_batch_size=1, block_size=BLOCK)),
         ("single", "numpy", dict(fused=False, threads=1, block_size=BLOCK)),
         ("single", "numpy", dict(fused=True, threads=2, query_batch_size=1, block_size=BLOCK)),
         ("single", "numpy", dict(fused=True, threads=2, block_size=BLOCK)),
         ("view", "numpy", dict(fused=False, threads=1, query_batch_size=1, block_size=BLOCK // 3)),
         ("half", "numpy", dict(fused=False, threads=1, query_batch_size=1, block_size=BLOCK)),
         ("half", "numpy", dict(fused=True, threads=2, block_size=BLOCK)),
         ("single", "torch", dict(device="cpu", chunk_size=BLOCK)),
         ("view", "torch", dict(device="cpu", chunk_size=BLOCK // 3)),
         ("half", "torch", dict(device="cpu", chunk_size=BLOCK))]


@pytest.mark.parametrize("which,backend,kwargs", CASES)
@pytest.mark.parametrize("k", [2, 5, 40])
def test_duplicate_float_vectors_tie_bit_for_bit_in_docid_order_on_every_backend(indexes, which, backend, kwargs, k,
                                                                                  monkeypatch):
    vecs, built = indexes
    monkeypatch.setattr(kernels, "_FUSED_MIN_SCORE_BYTES", 0)  # the fused path at this size too
    index = built[which]
    stored = vecs.astype(np.float16).astype(np.float32) if which == "half" else vecs
    qs = queries(vecs)
    scores, ids = index.search(qs, k, backend=backend, **kwargs)
    for r, q in enumerate(qs):
        assert ids[r].tolist() == naive_top(stored, q, k), (r, ids[r].tolist())
        for a in range(k - 1):
            if np.array_equal(stored[ids[r, a]], stored[ids[r, a + 1]]):
                assert scores[r, a] == scores[r, a + 1]  # bit for bit


def test_every_backend_returns_the_same_scores_for_duplicates(indexes):
    vecs, built = indexes
    qs = queries(vecs)
    a = built["single"].search(qs, 10, backend="numpy", fused=False, threads=1, query_batch_size=1,
                               block_size=BLOCK)
    b = built["view"].search(qs, 10, backend="torch", device="cpu")
    np.testing.assert_array_equal(a[1], b[1])


def test_a_band_of_duplicates_wider_than_the_candidates_is_cut_by_docid(tmp_path):
    """50 copies of one vector across the block tails, k=10: the cut falls inside the band; the first ten ids."""
    rng = np.random.default_rng(5)
    vecs = rng.standard_normal((500, DIM)).astype(np.float32)
    copies = np.sort(rng.choice(500, 50, replace=False))
    vecs[copies] = vecs[copies[0]]
    index = DenseIndex(tmp_path / "i")
    index.indexer().index([{"docno": f"d{i}", "doc_vec": v} for i, v in enumerate(vecs)])
    q = (vecs[copies[0]] + 0.01 * rng.standard_normal(DIM)).astype(np.float32)[None]
    for bs in (7, 49, 333):
        scores, ids = index.search(q, 10, backend="numpy", query_batch_size=1, block_size=bs, threads=1)
        assert ids[0].tolist() == copies[:10].tolist()
        assert len(set(scores[0].tolist())) == 1


@pytest.mark.parametrize("which", ["single", "half"])
@pytest.mark.parametrize("k", [2, 5, 40])
def test_faiss_flat_orders_duplicate_float_vectors_as_the_exact_kernels(indexes, which, k, monkeypatch):
    """FAISS's own products score these duplicates alike here (its BLAS rounds them alike); the scores of the copies
    at the block ends are raised by one unit in the last place, as the BLAS of the numpy kernel does."""
    import pandas as pd
    pytest.importorskip("faiss")
    from pyterrier_cpdae.dense import FaissRetriever
    tails = np.array([BLOCK - 1, 2 * BLOCK - 1, N - 1])

    class OneUlpApart:
        def __init__(self, idx):
            self.idx = idx

        def search(self, q, width):
            s, i = self.idx.search(q, width)
            return np.where(np.isin(i, tails), np.nextafter(s, np.float32(np.inf)), s).astype(np.float32), i

    real = FaissRetriever.faiss_index
    monkeypatch.setattr(FaissRetriever, "faiss_index", lambda self: OneUlpApart(real(self)))
    vecs, built = indexes
    stored = vecs.astype(np.float16).astype(np.float32) if which == "half" else vecs
    qs = queries(vecs)
    topics = pd.DataFrame({"qid": [f"q{r}" for r in range(len(qs))], "query_vec": list(qs)})
    res = built[which].faiss_flat_retriever(num_results=k, query_batch_size=1)(topics)
    for r, q in enumerate(qs):
        rows = res[res["qid"] == f"q{r}"]
        assert rows["docid"].tolist() == naive_top(stored, q, k)
        dup = [a for a in range(k - 1) if np.array_equal(stored[rows["docid"].iloc[a]], stored[rows["docid"].iloc[a + 1]])]
        assert all(rows["score"].iloc[a] == rows["score"].iloc[a + 1] for a in dup)


def test_a_zero_query_is_answered_by_ascending_docid_without_searching_again(indexes, monkeypatch):
    vecs, built = indexes
    calls = []
    real = kernels.numpy_search
    monkeypatch.setattr("pyterrier_cpdae.dense.store.numpy_search",
                        lambda parts, q, k, **kw: calls.append(k) or real(parts, q, k, **kw))
    scores, ids = built["single"].search(np.zeros((2, DIM), np.float32), 5, backend="numpy")
    assert ids.tolist() == [[0, 1, 2, 3, 4]] * 2 and not scores.any()
    assert len(calls) == 1


@pytest.mark.parametrize("which", ["single", "half", "view"])
def test_rescoring_in_slices_and_threads_gives_the_reference_score_of_each_pair(indexes, which, monkeypatch):
    """The settling's re-scoring (query by query, ids ascending, small slices, two threads, a 3-shard view) gives each
    (query, document) pair exactly :func:`ties.reference_scores` of that pair alone, in the order asked."""
    from pyterrier_cpdae.dense import ties
    vecs, built = indexes
    stored = vecs.astype(np.float16).astype(np.float32) if which == "half" else vecs
    monkeypatch.setattr(ties, "_PAIRS_PER_THREAD", 1)
    qs = queries(vecs)
    rng = np.random.default_rng(8)
    rows = np.sort(rng.integers(0, len(qs), 3000))
    ids = rng.integers(0, N, 3000)  # unsorted, repeated
    got = ties._rescore(qs, rows, ids, built[which].store.vectors_of, threads=2, read=7, chunk=3)
    want = np.array([ties.reference_scores(qs[r], stored[i][None])[0] for r, i in zip(rows, ids)])
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))


@pytest.mark.parametrize("which", ["single", "half", "view"])
def test_vectors_of_returns_the_stored_rows_in_the_order_asked(indexes, which):
    vecs, built = indexes
    stored = vecs.astype(np.float16).astype(np.float32) if which == "half" else vecs
    rng = np.random.default_rng(9)
    for ids in (np.arange(N), np.sort(rng.integers(0, N, 500)), rng.integers(0, N, 500), np.array([], np.int64)):
        got = built[which].store.vectors_of(ids)
        assert got.dtype == np.float32 and got.shape == (len(ids), DIM)
        np.testing.assert_array_equal(got, stored[ids])


def test_only_chains_reaching_the_kth_entry_are_rescored_beyond_it():
    """Entries after the k-th are re-scored only when a chain of near ties links them to it: a near tie wholly after
    the k-th entry can neither enter the top k nor move its last score."""
    from pyterrier_cpdae.dense import ties
    s = np.array([[10.0, 9.0, 8.0, 7.995, 7.99, 5.0, 4.0, 3.995],
                  [10.0, 9.0, 8.0, 7.0, 5.0, 4.995, 3.0, 2.995]], dtype=np.float32)
    mask = ties._needed(s, np.array([0.01, 0.01]), 3)
    assert mask.tolist() == [[False, False, True, True, True, False, False, False],
                             [False, False, False, False, False, False, False, False]]
    assert ties._needed(s, np.array([0.01, 0.01]), 8)[1].tolist() == [False] * 4 + [True] * 4
