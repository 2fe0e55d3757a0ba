"""The int8 scan's mechanics (int8.py): tau seeded from the first block, tiles shared by worker threads, the candidates'
dense and sorted merges. Each checked against a naive float64 top-k with ties by docid (the float32 ranking), on
adversarial near ties and on vectors with one huge dimension, and the candidates against a naive computation."""
from __future__ import annotations

import numpy as np
import pytest

from pyterrier_cpdae.dense import DenseIndex
from pyterrier_cpdae.dense import int8 as int8_search
from tests.helpers.dense import vector_frame as frame


def naive_ids(vecs: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """Each query's top k: float64 inner products rounded once to float32 (the float32 index's scores), descending,
    ties by ascending docid."""
    scores = (queries.astype(np.float64) @ vecs.astype(np.float64).T).astype(np.float32)
    ids = np.broadcast_to(np.arange(len(vecs)), scores.shape)
    return np.lexsort((ids, -scores), axis=1)[:, :k]


def near_ties(n: int, dim: int, seed: int) -> np.ndarray:
    """Exact copies, copies one float32 ulp apart and copies that differ by less than the int8 step in one
    coordinate (same code, another float32 score), among noise."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((n // 6, dim)).astype(np.float32)
    step = base.copy()
    step[:, 0] += np.float32(1e-3)
    vecs = np.concatenate([base, np.nextafter(base, np.float32(np.inf)), base.copy(), step,
                           rng.standard_normal((n - 4 * (n // 6), dim)).astype(np.float32)])
    return vecs[rng.permutation(len(vecs))]


def one_huge_dimension(n: int, dim: int, seed: int) -> np.ndarray:
    """A few documents a million times larger in one dimension: every other document's code of it is 0."""
    rng = np.random.default_rng(seed)
    vecs = rng.standard_normal((n, dim)).astype(np.float32) * 0.1
    vecs[::300, 3] = 1e5
    return vecs


def queries_for(vecs: np.ndarray, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dim = vecs.shape[1]
    q = rng.standard_normal((14, dim)).astype(np.float32)
    q[:3, 3] *= 1e-4  # weighs the huge dimension a little
    return np.concatenate([q, vecs[:5], np.zeros((1, dim), np.float32)])  # stored vectors (copies tie), a zero query


@pytest.mark.parametrize("vectors", ["near_ties", "one_huge_dimension", "wide"])
def test_seeded_tiled_threaded_scan_equals_naive_topk(tmp_path, monkeypatch, vectors):
    """Every combination of the scan's mechanisms returns the naive top k: tau seeded from first blocks of the
    block size, of exactly k and of 3 k rows (and none: shards shorter than k), tiles of a few hundred rows shared
    by one or two workers, both scans, one and two query digits, k from 1 to every document, the candidates merged
    and selected through a dense matrix or a sort."""
    vecs = {"near_ties": lambda: near_ties(3000, 40, 21),
            "one_huge_dimension": lambda: one_huge_dimension(2400, 32, 22),
            "wide": lambda: near_ties(900, 1100, 23)}[vectors]()  # wide: float32 products of the numpy scan inexact
    index = DenseIndex(tmp_path / "i8")
    index.indexer(dtype="int8").index(frame(vecs))
    view = DenseIndex(tmp_path / "view")  # two shards: at k = every document, each part is shorter than k
    for s in range(2):
        view.indexer(dtype="int8", shard=s, num_shards=2).index(frame(vecs))
    queries = queries_for(vecs, 24)
    monkeypatch.setattr(int8_search, "TILE_BYTES", 1)  # tiles of the 256-row minimum
    for seed_blocks, dense in ((1, True), (3, False)):  # (the candidates merged and selected by both ways)
        monkeypatch.setattr(int8_search, "SEED_BLOCKS", seed_blocks)
        monkeypatch.setattr(int8_search, "_dense", lambda num_q, width, entries, dense=dense: dense)
        for k in (1, 10, 150, 700, len(vecs)):
            want = naive_ids(vecs, queries, k)
            for scan in ("torch", "numpy"):
                for threads, searched in ((1, index), (2, index), (2, view)):
                    stats = {}
                    _, got = searched.search(queries, k, scan=scan, threads=threads, chunk_size=400, stats=stats)
                    np.testing.assert_array_equal(got, want, err_msg=f"{vectors} k={k} {scan} threads={threads} "
                                                                     f"seed_blocks={seed_blocks} {searched.path}")
                    assert stats["rescored"] >= k * (len(queries) - 1)


@pytest.mark.parametrize("dense", [True, False])
def test_candidates_merges_against_naive(monkeypatch, dense):
    """Both merges of _Candidates (a dense matrix, or a sort where it would be mostly empty), with one query holding
    most entries and equal bounds at the cut, entries added from two threads and dropped on the way: tau is each
    query's k-th largest lower bound over all entries, and the kept entries are those whose upper bound reaches it;
    a seed below that tau changes neither."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(int8_search, "_dense", lambda num_q, width, entries: dense)
    monkeypatch.setattr(int8_search, "DROP_FROM", 1)  # drops during the adds too
    rng = np.random.default_rng(31)
    num_q, k, n = 7, 6, 3000
    mid = rng.standard_normal((num_q, n))
    mid[3, :40] = 1.5  # equal bounds at the cut
    eps = rng.random((num_q, n)) * 0.3
    upper, lower = mid + eps, mid - eps
    added = np.zeros((num_q, n), bool)  # what the threads below add (before the filter by the current tau)
    added[0] = True
    for s in range(0, n, 100):
        added[1:, s:s + 100:10] = True
    want_tau = np.array([np.sort(lower[q, added[q]])[::-1][k - 1] for q in range(num_q)])
    cand = int8_search._Candidates(num_q, k)
    cand.refresh = 11
    cand.seed(want_tau - 0.5)

    def add(a):  # query 0 gets every entry of the block, the others a tenth
        for s in range(a, n, 200):
            for q in range(num_q):
                cols = np.arange(s, min(n, s + 100)) if q == 0 else np.arange(s, min(n, s + 100), 10)
                cols = cols[upper[q, cols] >= cand.tau[q]]
                cand.add(np.full(len(cols), q), cols.astype(np.int64), upper[q, cols], lower[q, cols])

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(add, [0, 100]))
    rows, ids, _, _ = cand.update()
    np.testing.assert_array_equal(cand.tau, want_tau)
    for q in range(num_q):
        np.testing.assert_array_equal(np.sort(ids[rows == q]), np.flatnonzero(added[q] & (upper[q] >= want_tau[q])))


def test_worker_threads_set_torch_thread_count_back(tmp_path):
    """The scan's workers (one torch thread each) leave torch's thread count as the caller set it: a thread started
    after a threaded search (in a fresh process, where torch sets each thread's count from a process-wide value
    when the thread first uses it) and the caller's thread get the count they had."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    vecs = np.random.default_rng(41).standard_normal((20000, 24)).astype(np.float32)  # tiles for two workers
    DenseIndex(tmp_path / "i8").indexer(dtype="int8").index(frame(vecs))
    np.save(tmp_path / "q.npy", vecs[:20])
    script = textwrap.dedent(f"""
        import threading, numpy as np, torch
        from pyterrier_cpdae.dense import DenseIndex
        torch.set_num_threads(2)
        DenseIndex({str(tmp_path / "i8")!r}).search(np.load({str(tmp_path / "q.npy")!r}), 50, scan="torch",
                                                    threads=2, chunk_size=256)
        seen = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start(); t.join()
        print(seen[0], torch.get_num_threads())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[3])
    assert out.stdout.split() == ["2", "2"], out.stdout + out.stderr
