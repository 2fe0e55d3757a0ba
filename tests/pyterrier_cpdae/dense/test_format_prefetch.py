"""format.prefetch_rows and prefetch_ids (the reads of a rescoring queued together): the page runs advised against a
naive per-page reference, the ids of a sharded view split over its parts, the skip when a sample is in memory, and the
int8 and binary searches that prefetch returning what they return without it."""
from __future__ import annotations

import mmap

import numpy as np
import pytest

from pyterrier_cpdae.dense import DenseIndex
from pyterrier_cpdae.dense import format as io


def naive_runs(rows, row_bytes, page):
    """The runs of consecutive pages that hold the given rows (a set of page numbers, then its runs)."""
    pages = sorted({p for r in rows for p in range(r * row_bytes // page, -(-(r + 1) * row_bytes // page))})
    runs, start = [], None
    for i, p in enumerate(pages):
        if start is None:
            start = p
        if i + 1 == len(pages) or pages[i + 1] != p + 1:
            runs.append((start * page, (p + 1 - start) * page))
            start = None
    return runs


@pytest.fixture
def advised(monkeypatch):
    calls = []
    monkeypatch.setattr(io, "_advise", lambda mapping, start, length: calls.append((start, length)))
    return calls


@pytest.mark.parametrize("dim", [96, 768, 1500])  # rows of 384 B (several a page), 3 KiB (across pages), ~6 KiB
def test_runs_advised_are_the_pages_of_the_rows(tmp_path, monkeypatch, advised, dim):
    monkeypatch.setattr(io, "_resident", lambda vectors, rows: False)
    n = 600
    np.arange(n * dim, dtype=np.float32).tofile(tmp_path / "v.bin")
    vectors = np.memmap(tmp_path / "v.bin", dtype=np.float32, mode="r", shape=(n, dim))
    rows = np.array([5, 3, 3, 4, 40, 41, 300, 599, 0, 302])  # unsorted, repeated, adjacent, the first and last rows
    assert io.prefetch_rows(vectors, rows) == len(advised)
    assert advised == naive_runs(sorted(set(rows.tolist())), dim * 4, mmap.PAGESIZE)


def test_skipped_when_the_rows_are_in_memory(tmp_path, advised):
    vectors_path = tmp_path / "v.bin"
    np.ones((256, 64), dtype=np.float32).tofile(vectors_path)
    vectors = np.memmap(vectors_path, dtype=np.float32, mode="r", shape=(256, 64))
    assert float(np.asarray(vectors).sum()) == 256 * 64  # every page read: in the page cache and mapped
    assert io._resident(vectors, np.arange(256))
    assert io.prefetch_rows(vectors, np.arange(0, 256, 3)) == 0 and advised == []
    # not a memmap, or no rows: nothing to advise
    assert io.prefetch_rows(np.ones((4, 4), np.float32), np.arange(4)) == 0
    assert io.prefetch_rows(vectors, np.array([], dtype=np.int64)) == 0 and advised == []


def test_a_real_advice_is_accepted(tmp_path, monkeypatch):
    """The system call itself (no stand-in): the advised runs are accepted and the rows read back unchanged."""
    monkeypatch.setattr(io, "_resident", lambda vectors, rows: False)
    values = np.random.default_rng(0).standard_normal((3000, 200)).astype(np.float32)
    values.tofile(tmp_path / "v.bin")
    vectors = np.memmap(tmp_path / "v.bin", dtype=np.float32, mode="r", shape=values.shape)
    rows = np.array([7, 8, 1000, 2999])
    assert io.prefetch_rows(vectors, rows) == 3
    assert np.array_equal(vectors[rows], values[rows])


def test_int8_search_prefetching_keeps_the_float32_ranking(tmp_path, monkeypatch):
    """A search that advises every rescoring round (the rows reported out of memory) against the float32 index."""
    import pandas as pd

    monkeypatch.setattr(io, "_resident", lambda vectors, rows: False)
    seen = []
    real = io._advise
    monkeypatch.setattr(io, "_advise", lambda mapping, start, length: (seen.append(length), real(mapping, start, length)))
    rng = np.random.default_rng(4)
    vecs = rng.standard_normal((4000, 48)).astype(np.float32)
    vecs[100:110] = vecs[7]  # exact ties
    frame = pd.DataFrame({"docno": [f"d{i}" for i in range(len(vecs))], "doc_vec": list(vecs)})
    indexes = {}
    for dtype in ("float32", "int8"):
        indexes[dtype] = DenseIndex(tmp_path / dtype)
        indexes[dtype].indexer(dtype=dtype).index(frame.to_dict("records"))
    queries = np.concatenate([rng.standard_normal((6, 48)), vecs[7:8]]).astype(np.float32)
    for k in (5, 150):
        f_scores, f_ids = indexes["float32"].store.search(queries, k)
        stats = {}
        i_scores, i_ids = indexes["int8"].store.search(queries, k, stats=stats)
        assert np.array_equal(i_ids, f_ids)
        assert stats["rescored"] >= k * len(queries)
    assert seen  # the rounds were advised


def test_binary_search_prefetches_its_candidates(tmp_path, monkeypatch):
    """The binary index's rescoring advises its candidates' rows too (its results unchanged by the advice)."""
    import pandas as pd

    rng = np.random.default_rng(5)
    vecs = rng.standard_normal((3000, 64)).astype(np.float32)
    frame = pd.DataFrame({"docno": [f"d{i}" for i in range(len(vecs))], "doc_vec": list(vecs)})
    index = DenseIndex(tmp_path / "b")
    index.indexer(dtype="binary").index(frame.to_dict("records"))
    queries = rng.standard_normal((5, 64)).astype(np.float32)
    plain = index.store.search(queries, 10, rescore_multiplier=4)
    monkeypatch.setattr(io, "_resident", lambda vectors, rows: False)
    asked = []
    monkeypatch.setattr(io, "prefetch_ids", lambda parts, ids: asked.append(np.sort(ids)) or 0)
    advised = index.store.search(queries, 10, rescore_multiplier=4)
    assert len(asked) == 1 and len(asked[0]) == 5 * 40  # k x the multiplier candidates of each query
    assert np.array_equal(advised[1], plain[1]) and np.array_equal(advised[0], plain[0])


def test_prefetch_ids_splits_a_sharded_views_ids_over_its_parts(monkeypatch):
    """Global ids ``row * stride + offset`` go to their part as its rows (two shards: even ids to the first)."""
    seen = []
    monkeypatch.setattr(io, "prefetch_rows", lambda vectors, rows: seen.append((vectors, sorted(rows.tolist()))) or 1)
    parts = [("part0", 0, 2), ("part1", 1, 2)]
    assert io.prefetch_ids(parts, np.array([9, 0, 4, 7, 2])) == 2
    assert seen == [("part0", [0, 1, 2]), ("part1", [3, 4])]
    seen.clear()
    assert io.prefetch_ids([("single", 0, 1)], np.array([5, 3])) == 1 and seen == [("single", [3, 5])]
