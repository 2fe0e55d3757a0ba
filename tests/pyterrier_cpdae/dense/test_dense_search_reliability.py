"""Reliability 2 of search and its inputs: ties ordered as documented on every backend (class 4),
index metadata distrusted (class 9), meaningless inputs refused (class 10).

References: the tie order is checked against a naive full sort of every document by (-score, docid) in
float64 on vectors with small integer components, whose scores are exact in float32 too (so every backend
sees the same ties).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from pyterrier_cpdae import DenseIndex

DIM = 8
N_SAME = 40


def tie_corpus(seed: int = 0):
    """40 identical vectors (the best score for the all-ones query) scattered among 60 distinct small-integer
    vectors (which tie among themselves a lot), docnos in docid order."""
    rng = np.random.default_rng(seed)
    vecs = rng.integers(-1, 2, size=(100, DIM)).astype(np.float32)
    same = np.sort(rng.choice(100, size=N_SAME, replace=False))
    vecs[same] = 2.0
    return [{"docno": f"d{i:03d}", "doc_vec": vecs[i]} for i in range(100)], vecs


def tie_queries() -> np.ndarray:
    rng = np.random.default_rng(1)
    return np.vstack([np.ones(DIM), -np.ones(DIM), np.zeros(DIM),
                      rng.integers(-2, 3, size=(5, DIM))]).astype(np.float32)


def naive_order(vecs: np.ndarray, queries: np.ndarray, k: int):
    """All documents sorted by (-score, docid), cut at k: the documented order."""
    scores = queries.astype(np.float64) @ vecs.astype(np.float64).T
    ids = np.broadcast_to(np.arange(len(vecs)), scores.shape)
    order = np.lexsort((ids, -scores), axis=1)[:, :k]
    return np.take_along_axis(scores, order, axis=1), order


@pytest.fixture(scope="module")
def tie_indexes(tmp_path_factory):
    docs, vecs = tie_corpus()
    base = tmp_path_factory.mktemp("ties")
    single = DenseIndex(base / "single")
    single.indexer(batch_size=7).index(docs)
    views = {}
    for n in (2, 3):
        view = DenseIndex(base / f"shards{n}")
        for s in range(n):
            view.indexer(shard=s, num_shards=n, batch_size=5).index(docs)
        views[n] = view
    return single, views, vecs


@pytest.mark.parametrize("k", [1, 5, 39, 40, 41, 100, 150])
def test_ties_follow_ascending_docid_on_every_backend(tie_indexes, k):
    """40 identical vectors, k=5 gave numpy d35..d39, torch d25..d29."""
    single, views, vecs = tie_indexes
    queries = tie_queries()
    ref_scores, ref_ids = naive_order(vecs, queries, k)
    runs = {}
    for index, name in [(single, "single")] + [(v, f"{n} shards") for n, v in views.items()]:
        for bs in (1, 3, 16, 1000):
            for qbs in (1, 1024):
                runs[f"{name} numpy block_size={bs} query_batch_size={qbs}"] = index.search(
                    queries, k, backend="numpy", block_size=bs, query_batch_size=qbs)
        for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
            for cs in (1, 7, 1000):
                for resident in (False, True):  # streamed from the memmap / held as tensors on the device
                    runs[f"{name} torch {device} chunk_size={cs} resident={resident}"] = index.search(
                        queries, k, backend="torch", device=device, chunk_size=cs, resident=resident)
    topics = pd.DataFrame({"qid": [f"q{j}" for j in range(len(queries))], "query_vec": list(queries)})
    res = single.faiss_flat_retriever(num_results=k)(topics)
    runs["faiss flat"] = (np.stack([res[res.qid == q].score.to_numpy() for q in topics.qid]),
                          np.stack([res[res.qid == q].docid.to_numpy() for q in topics.qid]))
    for name, (scores, ids) in runs.items():
        np.testing.assert_array_equal(ids, ref_ids, err_msg=name)
        np.testing.assert_array_equal(scores, ref_scores.astype(np.float32), err_msg=name)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 7, 30])
def test_numpy_kernel_pools_survivors_and_filters_in_threads(threads, k, monkeypatch):
    """The numpy kernel's survivors of the running threshold are pooled and merged about every ``k`` columns,
    and its filter runs over row ranges in ``threads`` threads: the result is still the naive full sort's,
    ties by ascending id, over many small blocks and over two interleaved shard parts, and a run over many
    blocks merges fewer times than it has blocks."""
    from pyterrier_cpdae.dense import kernels

    rng = np.random.default_rng(7)
    for low, high in [(-2, 3), (-1000, 1001)]:  # small integers: many ties; wide ones: few (exact in float32)
        vecs = rng.integers(low, high, size=(3000, DIM)).astype(np.float32)
        queries = rng.integers(low, high, size=(20, DIM)).astype(np.float32)
        if high < 10:  # the all-ones, all-minus-ones and zero queries: every score of the last one ties
            queries = np.vstack([tie_queries(), queries])
        ref_scores, ref_ids = naive_order(vecs, queries, k)
        merges = []
        merge = kernels._NumpyTopK._merge
        monkeypatch.setattr(kernels._NumpyTopK, "_merge",
                            lambda self, s, i: (merges.append(s.shape[1]), merge(self, s, i)))
        scores, ids = kernels.numpy_search([(vecs, 0, 1)], queries, k, block_size=64, threads=threads)
        monkeypatch.undo()
        np.testing.assert_array_equal(ids, ref_ids)
        np.testing.assert_array_equal(scores, ref_scores.astype(np.float32))
        halves = [(vecs[0::2], 0, 2), (vecs[1::2], 1, 2)]  # round-robin shards: ids interleave across parts
        scores, ids = kernels.numpy_search(halves, queries, k, block_size=64, threads=threads)
        np.testing.assert_array_equal(ids, ref_ids)
    assert 0 < len(merges) < 3000 // 64 / 2, merges  # few ties: pooled, not one merge per block
    with pytest.raises(ValueError, match="threads"):
        kernels.numpy_search([(vecs, 0, 1)], queries, k, threads=0)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("k", [1, 30, 200])
def test_numpy_fused_path_scores_tiles_in_workers_and_ranks_as_the_naive_sort(threads, k, monkeypatch):
    """Once the running threshold is known, the numpy kernel scores each block tile by tile in ``threads`` workers
    (the BLAS on one thread meanwhile) and filters the tiles without writing the block's scores: with tiles of 64 rows
    (several per worker, the last one partial), float32 and float16 vectors and interleaved shard parts, the ranking
    is the naive full sort's (ties by ascending id) and the unfused path's; the BLAS threads are restored after."""
    from threadpoolctl import threadpool_info

    from pyterrier_cpdae.dense import kernels

    monkeypatch.setattr(kernels, "_TILE_SCORE_BYTES", 1)  # tiles of the minimum, 64 rows
    monkeypatch.setattr(kernels, "_FUSED_MIN_SCORE_BYTES", 0)  # fused at any number of queries
    monkeypatch.setattr(kernels, "_FIRST_BLOCK_ROWS", 40)  # a first block of max(40, 16 k) rows, then 500-row ones
    calls, limits = [], []
    fused = kernels._NumpyTopK.update_fused

    def watch(self, queries, block, ids):
        calls.append(len(block))
        limits.append({i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"})
        return fused(self, queries, block, ids)

    monkeypatch.setattr(kernels._NumpyTopK, "update_fused", watch)
    blas_before = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
    rng = np.random.default_rng(11)
    for low, high in [(-2, 3), (-1000, 1001)]:
        vecs = rng.integers(low, high, size=(3000, DIM)).astype(np.float32)
        queries = rng.integers(low, high, size=(20, DIM)).astype(np.float32)
        if high < 10:
            queries = np.vstack([tie_queries(), queries])
        ref_scores, ref_ids = naive_order(vecs, queries, k)
        for parts in ([(vecs, 0, 1)], [(vecs.astype(np.float16), 0, 1)] if high < 10 else [],
                      [(vecs[0::2], 0, 2), (vecs[1::2], 1, 2)]):
            if not parts:
                continue
            del calls[:]
            scores, ids = kernels.numpy_search(parts, queries, k, block_size=500, threads=threads)
            assert calls, "the fused path never ran"
            np.testing.assert_array_equal(ids, ref_ids)
            np.testing.assert_array_equal(scores, ref_scores.astype(np.float32))
            unfused = kernels.numpy_search(parts, queries, k, block_size=500, threads=threads, fused=False)
            np.testing.assert_array_equal(unfused[1], ids)
    assert all(lim == {1} for lim in limits), limits  # each BLAS call on one thread while the workers score
    assert [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"] == blas_before


def fused_calls(monkeypatch) -> list:
    """A list that grows by one entry at each block the numpy kernel scores on its fused path."""
    from pyterrier_cpdae.dense import kernels

    calls: list = []
    fused = kernels._NumpyTopK.update_fused
    monkeypatch.setattr(kernels._NumpyTopK, "update_fused", lambda self, *a: (calls.append(1), fused(self, *a))[1])
    return calls


def test_numpy_kernel_fuses_only_query_batches_whose_block_scores_outgrow_the_caches(monkeypatch):
    """Few queries' scores of a block fit in the caches (and their products are memory-bound): they are scored by one
    BLAS-threaded call per block; from 8 MiB of scores per block on (128 queries at 16,384 rows) the fused path runs.
    Both give the naive full sort's ranking."""
    from pyterrier_cpdae.dense import kernels

    calls = fused_calls(monkeypatch)
    rng = np.random.default_rng(5)
    vecs = rng.integers(-50, 51, size=(700, DIM)).astype(np.float32)
    for num_queries, block_size, expect in ((127, 16384, False), (128, 16384, True), (10, 200_000, False),
                                            (11, 200_000, True)):
        queries = rng.integers(-50, 51, size=(num_queries, DIM)).astype(np.float32)
        ref_scores, ref_ids = naive_order(vecs, queries, 5)
        del calls[:]
        # two parts of one block each: the first sets the running threshold, the second may take the fused path
        scores, ids = kernels.numpy_search([(vecs[:350], 0, 1), (vecs[350:], 350, 1)], queries, 5,
                                           block_size=block_size, threads=2)
        np.testing.assert_array_equal(ids, ref_ids)
        np.testing.assert_array_equal(scores, ref_scores.astype(np.float32))
        assert bool(calls) is expect, (num_queries, block_size)


def test_numpy_kernel_stays_unfused_when_the_blas_cannot_be_limited(monkeypatch):
    """Workers calling a BLAS that cannot be held to one thread would oversubscribe the cores: the kernel then scores
    whole blocks (one threaded matmul each), as it does with one worker (``threads=1``) anyway."""
    from pyterrier_cpdae.dense import kernels

    monkeypatch.setattr(kernels, "one_blas_thread", lambda: None)
    monkeypatch.setattr(kernels, "_FUSED_MIN_SCORE_BYTES", 0)
    calls = fused_calls(monkeypatch)
    rng = np.random.default_rng(3)
    vecs = rng.integers(-50, 51, size=(2000, DIM)).astype(np.float32)
    queries = rng.integers(-50, 51, size=(9, DIM)).astype(np.float32)
    ref_scores, ref_ids = naive_order(vecs, queries, 10)
    for threads, expect_fused in ((2, False), (1, False)):
        del calls[:]
        scores, ids = kernels.numpy_search([(vecs, 0, 1)], queries, 10, block_size=256, threads=threads)
        np.testing.assert_array_equal(ids, ref_ids)
        assert bool(calls) is expect_fused, threads


class _LastOfTiesFlat:
    """Stands in for a FAISS flat index that keeps the *largest* ids of equal scores at the cut (as a GPU
    k-selection may): exact scores, order by (-score, -docid)."""

    def __init__(self, vecs: np.ndarray):
        self.vecs = vecs

    def search(self, queries: np.ndarray, k: int):
        scores = queries.astype(np.float64) @ self.vecs.astype(np.float64).T
        ids = np.broadcast_to(np.arange(len(self.vecs)), scores.shape)
        order = np.lexsort((-ids, -scores), axis=1)[:, :k]
        return np.take_along_axis(scores, order, axis=1).astype(np.float32), order.astype(np.int64)


@pytest.mark.parametrize("k", [1, 5, 39, 40, 41])
def test_faiss_flat_resolves_ties_its_index_left_arbitrary(tie_indexes, monkeypatch, k):
    """FAISS leaves the subset of equal scores at the cut unspecified: the flat retriever asks for one result
    more, and answers queries whose k-th and (k+1)-th scores are equal with the exact kernel."""
    single, _, vecs = tie_indexes
    retriever = single.faiss_flat_retriever(num_results=k)
    monkeypatch.setattr(retriever, "faiss_index", lambda: _LastOfTiesFlat(vecs))
    queries = tie_queries()
    _, ref_ids = naive_order(vecs, queries, k)
    res = retriever(pd.DataFrame({"qid": [f"q{j}" for j in range(len(queries))], "query_vec": list(queries)}))
    got = np.stack([res[res.qid == f"q{j}"].docid.to_numpy() for j in range(len(queries))])
    np.testing.assert_array_equal(got, ref_ids)


class _GpuFlat(_LastOfTiesFlat):
    """A FAISS GPU index: its k-selection refuses more than ``limit`` results per query."""

    def __init__(self, vecs: np.ndarray, limit: int):
        super().__init__(vecs)
        self.limit = limit

    def search(self, queries: np.ndarray, k: int):
        if k > self.limit:
            raise RuntimeError(f"k > {self.limit} is unsupported on the GPU")  # as faiss-gpu's assertion does
        return super().search(queries, k)


@pytest.mark.parametrize("k", [5, 7, 8, 20])
def test_faiss_on_the_gpu_beyond_its_k_limit_gives_the_same_exact_ranking(tie_indexes, monkeypatch, k):
    """FAISS's GPU k-selection stops at 2048 (here patched to 8); the flat retriever asks for k + 1 to see ties,
    so from k = 2048 on the GPU it answers with the exact torch kernel instead; IVF says so in a clear error."""
    from pyterrier_cpdae.dense import faiss_retr

    single, _, vecs = tie_indexes
    monkeypatch.setattr(faiss_retr, "FAISS_GPU_MAX_K", 8)
    retriever = single.faiss_flat_retriever(num_results=k)
    fake = _GpuFlat(vecs, limit=8)

    def load():
        retriever._faiss_on_gpu = True
        return fake
    monkeypatch.setattr(retriever, "faiss_index", load)
    queries = tie_queries()
    _, ref_ids = naive_order(vecs, queries, k)
    res = retriever(pd.DataFrame({"qid": [f"q{j}" for j in range(len(queries))], "query_vec": list(queries)}))
    got = np.stack([res[res.qid == f"q{j}"].docid.to_numpy() for j in range(len(queries))])
    np.testing.assert_array_equal(got, ref_ids)
    if k > 8:  # IVF asks for k itself (no tie check): its limit is k > 8
        ivf = single.faiss_ivf_retriever(num_results=k, n_list=2)
        monkeypatch.setattr(ivf, "faiss_index", lambda: (setattr(ivf, "_faiss_on_gpu", True), fake)[1])
        with pytest.raises(ValueError, match=f"num_results={k}: FAISS on the GPU returns at most 8"):
            ivf(pd.DataFrame({"qid": ["q0"], "query_vec": [queries[0]]}))


# ------------------------------------------------------------------------------- class 9: metadata distrusted
def small_docs(n: int = 30):
    return [{"docno": f"d{i}", "doc_vec": np.full(4, i, np.float32)} for i in range(n)]


def make_view(path: Path, num_shards: int = 3) -> DenseIndex:
    view = DenseIndex(path)
    for s in range(num_shards):
        view.indexer(shard=s, num_shards=num_shards).index(small_docs())
    return view


def rewrite_meta(path: Path, **changes) -> None:
    meta = json.loads((path / "pt_meta.json").read_text())
    meta.update(changes)
    (path / "pt_meta.json").write_text(json.dumps(meta))


def test_num_shards_beyond_the_shard_directories_is_refused_at_once(tmp_path):
    """Num_shards=1e9 ran 34 s into a MemoryError."""
    make_view(tmp_path / "v")
    rewrite_meta(tmp_path / "v", num_shards=10**9)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"num_shards=1000000000, but .*shards holds 3 shard directories"):
        len(DenseIndex(tmp_path / "v"))
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("changes, said", [
    ({"count": 31, "num_docs": 31}, r"says count=31, but its 3 shards hold count=30"),
    ({"count": 3, "num_docs": 3}, r"says count=3, but its 3 shards hold count=30"),
    ({"dim": 5}, r"says dim=5, but its 3 shards hold dim=4"),
    ({"dtype": "float16"}, r"says dtype='float16', but its 3 shards hold dtype='float32'"),
])
def test_a_view_whose_metadata_disagrees_with_its_shards_is_refused(tmp_path, changes, said):
    """A wrong top-level count/dim gave a wrong len() or numpy's "mismatch in its core
    dimension"."""
    make_view(tmp_path / "v")
    rewrite_meta(tmp_path / "v", **changes)
    view = DenseIndex(tmp_path / "v")
    for use in (lambda: len(view), lambda: view.dim,
                lambda: view.search(np.ones((1, changes.get("dim", 4)), np.float32), 5, backend="numpy")):
        with pytest.raises(ValueError, match=said + r"; delete .*pt_meta.json and rewrite it by resuming"):
            use()
    # the advice works: the resumed shard writes the top-level file again from the shards
    (tmp_path / "v" / "pt_meta.json").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "shard 0 is already completely built"
        view.indexer(shard=0, num_shards=3, mode="resume").index(small_docs())
    assert len(DenseIndex(tmp_path / "v")) == 30


_OPEN_IN_CHILD = textwrap.dedent("""
    import sys
    from pyterrier_cpdae import DenseIndex
    from pyterrier_cpdae.bm25 import BM25Index
    index = BM25Index(sys.argv[1]) if sys.argv[2] == "bm25" else DenseIndex(sys.argv[1])
    try:
        len(index)
    except ValueError as ex:
        print("ValueError:", ex)
""")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("what, victim", [("dense", "pt_meta.json"), ("dense", "vectors.bin"),
                                          ("dense", "docnos.npids"), ("dense", "shards/1/pt_meta.json"),
                                          ("bm25", "pt_meta.json")])
def test_index_files_that_are_fifos_are_refused_without_hanging(tmp_path, what, victim):
    """A pt_meta.json that is a FIFO hung every reader forever."""
    path = tmp_path / "ix"
    if what == "bm25":
        path.mkdir()
    elif victim.startswith("shards/"):
        make_view(path)
    else:
        DenseIndex(path).indexer().index(small_docs())
    target = path / victim
    target.unlink(missing_ok=True)
    os.mkfifo(target)
    out = subprocess.run([sys.executable, "-c", _OPEN_IN_CHILD, str(path), what], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"{target} is a FIFO (named pipe), not a regular file" in out.stdout


def test_oversized_or_non_regular_metadata_is_refused(tmp_path):
    DenseIndex(tmp_path / "ix").indexer().index(small_docs())
    meta = json.loads((tmp_path / "ix" / "pt_meta.json").read_text())
    meta["padding"] = "x" * (2 << 20)
    (tmp_path / "ix" / "pt_meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"pt_meta.json is \d+ bytes, more than the 1048576"):
        len(DenseIndex(tmp_path / "ix"))
    (tmp_path / "ix" / "pt_meta.json").unlink()
    (tmp_path / "ix" / "pt_meta.json").mkdir()
    with pytest.raises(ValueError, match=r"pt_meta.json is a directory, not a regular file"):
        len(DenseIndex(tmp_path / "ix"))
    assert not DenseIndex(tmp_path / "ix").built()


# ---------------------------------------------------------------- class 10: inputs that cannot mean anything
@pytest.fixture(scope="module")
def small_index(tmp_path_factory):
    index = DenseIndex(tmp_path_factory.mktemp("small") / "ix")
    index.indexer().index(small_docs())
    return index


@pytest.mark.parametrize("vec, what", [
    (np.array([1 + 2j, 0, 0, 0]), r"complex numbers \(dtype complex128\)"),
    (np.array(["1", "2", "3", "4"]), r"strings \(dtype <U1\)"),
    (["1", "2", "3", "4"], r"strings \(dtype <U1\)"),
    ([1.0, None, 2.0, 3.0], r"non-numeric Python objects \(dtype object\)"),
])
def test_query_vectors_that_are_not_real_numbers_are_refused(small_index, vec, what):
    """A complex query_vec lost its imaginary part, a string one was parsed as numbers."""
    topics = pd.DataFrame({"qid": ["q1"], "query_vec": [vec]})
    for retriever in (small_index.np_retriever(), small_index.torch_retriever(device="cpu"),
                      small_index.faiss_flat_retriever()):
        with pytest.raises(ValueError, match=r"query_vec of qid 'q1' must hold real numbers, got " + what):
            retriever(topics)
    with pytest.raises(ValueError, match=r"query_vecs must hold real numbers, got " + what):
        small_index.search(np.array([vec]), 3)


def test_documents_with_complex_vectors_are_refused_naming_the_docno(tmp_path):
    docs = small_docs(3) + [{"docno": "bad", "doc_vec": np.array([1j, 0, 0, 0])}]
    with pytest.raises(ValueError, match=r"doc_vec of docno 'bad' must hold real numbers, got complex"):
        DenseIndex(tmp_path / "ix").indexer().index(docs)


def test_vectors_whose_scores_could_overflow_float32_are_refused_where_they_enter(tmp_path, small_index):
    """Finite vectors of norm 1e30 were indexed, then every search said "vectors.bin is
    corrupt". The bound: norms <= 2**63, so |q.d| <= |q| |d| <= 2**126 < float32's largest value."""
    big = np.array([1e30, 0, 0, 0], np.float32)
    q, d = big.astype(np.float64), big.astype(np.float64)
    with np.errstate(over="ignore"):
        assert np.isfinite(big).all() and not np.isfinite(np.float32(q @ d))  # what would have happened
    docs = small_docs(3) + [{"docno": "huge", "doc_vec": big}]
    with pytest.raises(ValueError, match=r"doc_vec of docno\(s\) 'huge' \(norm 1e\+30\) exceed\(s\) the largest norm"):
        DenseIndex(tmp_path / "ix").indexer().index(docs)
    topics = pd.DataFrame({"qid": ["q9"], "query_vec": [big]})
    with pytest.raises(ValueError, match=r"query_vec of qid\(s\) 'q9' \(norm 1e\+30\) exceed"):
        small_index.np_retriever()(topics)
    with pytest.raises(ValueError, match=r"query vector of row\(s\) 0 \(norm 1e\+30\) exceed"):
        small_index.search(big[None], 3)
    # at the bound every score stays finite: the extreme case of two vectors of norm 2**63
    edge = np.array([2.0 ** 63, 0, 0, 0], np.float32)
    ok = DenseIndex(tmp_path / "edge")
    ok.indexer().index([{"docno": "e", "doc_vec": edge}])
    scores, _ = ok.search(edge[None], 1)
    assert scores[0, 0] == np.float32(2.0 ** 126)


# -------------------------------------------------------------------------------- BM25 queries and pickling
@pytest.fixture(scope="module")
def bm25_index(tmp_path_factory):
    from pyterrier_cpdae.bm25 import BM25Index

    index = BM25Index(tmp_path_factory.mktemp("bm25") / "ix")
    index.indexer().index([{"docno": "a", "text": "apple banana"}, {"docno": "b", "text": "cherry apple"},
                           {"docno": "c", "text": "cherry"}])
    return index


@pytest.mark.parametrize("queries", [[""], ["   "], ["", " \t\n"], ["apple", ""], ["", "cherry", "  "]])
def test_blank_bm25_queries_get_no_rows_and_the_others_still_run(bm25_index, queries):
    """A batch of only blank queries failed with pandas' "Per-column arrays must each be
    1-dimensional". Reference: each query retrieved alone (Pyserini gives a blank query no hits)."""
    bm25 = bm25_index.bm25()
    topics = pd.DataFrame({"qid": [f"q{i}" for i in range(len(queries))], "query": queries})
    res = bm25(topics)
    assert list(res.columns) == ["qid", "query", "docno", "docid", "score", "rank"]
    for i, q in enumerate(queries):
        got = res[res.qid == f"q{i}"]
        if not q.strip():
            assert got.empty
        else:
            alone = bm25(topics.iloc[[i]])
            assert not alone.empty and got.docno.tolist() == alone.docno.tolist()


def test_a_used_bm25_retriever_and_text_loader_can_be_pickled(bm25_index):
    """After its first search a BM25 retriever held a Java object: "no default __reduce__"."""
    import pickle

    topics = pd.DataFrame({"qid": ["1", "2"], "query": ["apple", "cherry"]})
    bm25 = bm25_index.bm25(num_results=2)
    pipeline = bm25 >> bm25_index.text_loader()
    before = pipeline(topics)
    copy = pickle.loads(pickle.dumps(pipeline))
    pd.testing.assert_frame_equal(copy(topics), before)
    assert bm25.searcher() is not None  # the original still works after being pickled


# -------------------------------------------------------------------------------------- BEIR with a BOM
def test_beir_jsonl_and_qrels_with_a_utf8_byte_order_mark_are_read(tmp_path):
    """A BEIR corpus.jsonl saved with a BOM was refused ("not valid JSON"); the BOM of a qrels file
    would have become part of its header."""
    from pyterrier_cpdae.datasets import load_dataset

    plain, bom = tmp_path / "plain", tmp_path / "bom"
    files = {"corpus.jsonl": '{"_id": "d1", "title": "T", "text": "body"}\n{"_id": "d2", "text": "more"}\n',
             "queries.jsonl": '{"_id": "q1", "text": "query"}\n',
             "qrels/test.tsv": "query-id\tcorpus-id\tscore\nq1\td1\t1\n"}
    for folder, prefix in ((plain, ""), (bom, "\ufeff")):
        for name, text in files.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(prefix + text, encoding="utf-8")
    ref, got = load_dataset(f"beir:{plain}"), load_dataset(f"beir:{bom}")
    assert list(got.get_corpus_iter()) == list(ref.get_corpus_iter())
    pd.testing.assert_frame_equal(got.get_topics(), ref.get_topics())
    pd.testing.assert_frame_equal(got.get_qrels(), ref.get_qrels())
    assert (bom / "corpus.jsonl").read_bytes().startswith(b"\xef\xbb\xbf")


def test_overlapping_fused_searches_leave_the_blas_threads_as_they_were(monkeypatch):
    """Two searches in two threads hold the BLAS to one thread in overlapping spans (the first to start ends first):
    the BLAS's own thread counts come back only when the last one ends, never stay at one for the whole process,
    and both rankings are the naive sort's. Plain nested threadpoolctl limits would restore them under the second
    search and have it restore "one thread" at its end."""
    import threading

    from threadpoolctl import threadpool_info

    from pyterrier_cpdae.dense import kernels

    def blas():
        return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]

    before = blas()
    a, b = kernels.one_blas_thread(), kernels.one_blas_thread()
    if a is None:
        pytest.skip("no BLAS threadpoolctl can control")
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)  # the first ends while the second is still inside
    assert blas() == [1] * len(before)
    b.__exit__(None, None, None)
    assert blas() == before

    monkeypatch.setattr(kernels, "_FUSED_MIN_SCORE_BYTES", 0)
    rng = np.random.default_rng(9)
    vecs = rng.integers(-100, 101, size=(6000, DIM)).astype(np.float32)
    queries = rng.integers(-100, 101, size=(30, DIM)).astype(np.float32)
    ref_scores, ref_ids = naive_order(vecs, queries, 20)
    results, errors = [], []

    def search():
        try:
            for _ in range(5):
                results.append(kernels.numpy_search([(vecs, 0, 1)], queries, 20, block_size=256, threads=2)[1])
        except Exception as e:  # pragma: no cover (reported below)
            errors.append(e)

    workers = [threading.Thread(target=search) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors and len(results) == 15
    for ids in results:
        np.testing.assert_array_equal(ids, ref_ids)
    assert blas() == before


@pytest.mark.parametrize("count", [30, 2000])
def test_docnos_of_repeated_ids_equal_the_stored_order(tie_indexes, count, monkeypatch):
    """docnos_of maps ids to docnos by the documented order (docid i is the i-th document indexed: d000, d001, ...)
    on a single index and on 2- and 3-shard views, both for few ids (looked up one by one) and for more ids than
    half the documents, which repeat (each distinct id looked up once, then spread back in the given order)."""
    from pyterrier_cpdae.dense import store

    monkeypatch.setattr(store, "_DISTINCT_FROM", 10)
    single, views, _ = tie_indexes
    ids = np.random.default_rng(count).integers(0, 100, size=count)
    expected = np.array([f"d{i:03d}" for i in ids], dtype=object)
    for index in [single, *views.values()]:
        got = index.store.docnos_of(ids)
        assert got.dtype == object and got.shape == ids.shape
        np.testing.assert_array_equal(got, expected)
