"""Exact ties whatever the backend: near-equal scores of a top-k re-scored in one position-free arithmetic.

A float32 BLAS product does not compute every entry of a score matrix the same way: the sum of ``dim`` products is
blocked and ordered by the entry's place in the microkernel's tile, so two identical stored vectors can get scores one
unit in the last place apart inside one ``sgemm`` (OpenBLAS does), and a kernel that orders by (score, id) then puts
the larger id first. Here the kernel's scores only select candidates; every candidate whose score is within
``2 * tol`` of a neighbour's (chains of near-ties, which include the cut at the ``k``-th entry) is scored again by
:func:`reference_scores`: float32 values multiplied exactly in float64, summed in float64 along the row in a fixed
order, rounded once to float32, so the result depends only on the two vectors, never on where they sat in a block.

``tol`` bounds how far a kernel's float32 score can be from that reference: ``(dim + 2) u |q| M`` (``u = 2**-24``,
``M`` the largest stored norm, the float32 accumulation of ``dim`` products plus the reference's one rounding;
inflated by 1%). So:

* entries not in a chain are more than ``2 tol`` from every other candidate, and their kernel order is the reference
  order; entries in a chain are ordered by reference score, ties by ascending id: duplicate vectors score equal bit
  for bit and come out in docid order on every backend;
* a document outside the ``k + extra`` candidates has a kernel score at most the last candidate's, ``s_last``, so a
  reference score at most ``s_last + tol``; when ``s_last + 2 tol`` is below the ``k``-th settled score no such
  document can enter the top ``k`` or tie with its last entry. A query where that does not hold (a band of
  near-equal scores at the cut, e.g. many duplicates) is searched again with four times the candidates, up to all
  documents: never a wrong cut, only a slower one.

Only the candidates near a tie are re-read and re-scored, beyond the ``k``-th entry only those chained to it; they
are read query by query in ascending id order and scored in small cache-sized slices, so the cost beside a search
over many documents is small (``experiments/results/bench_ties.md``).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from .._checks import default_num_threads

#: unit roundoff of float32
U32 = 2.0 ** -24
#: fewest pairs to re-score that are worth a thread of their own
_PAIRS_PER_THREAD = 16384


def extra_candidates(k: int) -> int:
    """Candidates a query keeps beyond ``k`` (the first try): enough that the cut is usually proved at once."""
    return max(8, k // 32)


def tolerance(queries: np.ndarray, max_norm: float) -> np.ndarray:
    """Per query, the bound on ``|kernel score - reference score|`` (module docstring)."""
    dim = queries.shape[1]
    norms = np.linalg.norm(queries.astype(np.float64), axis=1)
    return (dim + 2) * U32 * 1.01 * norms * float(max_norm) + 1e-37


def reference_scores(query: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """float32 inner products of ``query`` ``(dim,)`` with each row of ``vectors`` ``(m, dim)``: exact float64
    products, one float64 pairwise sum per row (the same order for every row), one rounding to float32."""
    prod = np.multiply(vectors, np.asarray(query, dtype=np.float64), dtype=np.float64)
    return np.add.reduce(prod, axis=1).astype(np.float32)


def _rescore(queries: np.ndarray, rows: np.ndarray, ids: np.ndarray,
             vectors_of: Callable[[np.ndarray], np.ndarray], threads: int = 1, read: int = 8192,
             chunk: int = 256) -> np.ndarray:
    """:func:`reference_scores` of ``queries[rows[i]]`` with the stored vector of ``ids[i]`` (``rows`` ascending).

    Pairs are taken query by query, each query's documents in ascending id order (the memmap's pages in sequence;
    ``vectors_of`` reads ascending ids without sorting them again), ``read`` rows per call, scored ``chunk`` rows at a
    time so that the float64 products stay in a core's cache; only the 1-D scores go back to the asked order; the
    queries are split over ``threads`` workers (numpy releases the GIL). Bit for bit the values of
    :func:`reference_scores`: the same exact products, the same float64 sum along each row, one rounding."""
    out = np.empty(len(rows), dtype=np.float32)
    if not len(rows):
        return out
    order = np.lexsort((ids, rows))
    rows, ids = rows[order], ids[order]
    sorted_out = np.empty(len(rows), dtype=np.float32)
    bounds = np.flatnonzero(np.diff(rows)) + 1
    starts, ends = np.concatenate([[0], bounds]), np.concatenate([bounds, [len(rows)]])

    def score(span: Tuple[int, int]) -> None:
        buf = np.empty((chunk, queries.shape[1]), dtype=np.float64)
        for lo, hi in zip(starts[span[0]:span[1]], ends[span[0]:span[1]]):
            query = queries[rows[lo]].astype(np.float64)
            for first in range(lo, hi, read):
                vectors = vectors_of(ids[first:min(first + read, hi)])
                for a in range(0, len(vectors), chunk):
                    prod = buf[:len(vectors[a:a + chunk])]
                    np.copyto(prod, vectors[a:a + chunk])  # float32 values, exact in float64
                    np.multiply(prod, query, out=prod)  # exact: 24 + 24 bits of mantissa fit in 53
                    sorted_out[first + a:first + a + len(prod)] = np.add.reduce(prod, axis=1)

    workers = max(1, min(threads, len(rows) // _PAIRS_PER_THREAD, len(starts)))
    if workers == 1:
        score((0, len(starts)))
    else:  # query ranges of about equal numbers of pairs
        cuts = np.searchsorted(starts, np.arange(1, workers) * len(rows) // workers)
        spans = list(zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [len(starts)]])))
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(score, spans))
    out[order] = sorted_out
    return out


def largest_norm(arrays: Sequence[np.ndarray], block: int = 65536) -> float:
    """The largest row norm of the ``(n, dim)`` arrays (read ``block`` rows at a time), inflated by ``1e-4`` for its
    own rounding; NaN when a row is not finite."""
    top = 0.0
    for vectors in arrays:
        for s in range(0, len(vectors), block):
            rows = np.asarray(vectors[s:s + block], dtype=np.float32)
            sq = np.einsum("ij,ij->i", rows, rows, dtype=np.float64)
            if len(sq) and not np.isfinite(sq).all():
                return float("nan")
            top = max(top, float(sq.max()) if len(sq) else 0.0)
    return float(np.sqrt(top)) * 1.0001


def _needed(scores: np.ndarray, tol: np.ndarray, k: int) -> np.ndarray:
    """``(q, w)`` mask of the entries to re-score: those within ``2 tol`` of an adjacent entry of their (descending)
    row (chains of near-ties), except the chains that lie wholly after the ``k``-th entry.

    Such a chain starts more than ``2 tol`` below the end of the chain through the ``k``-th entry (or below that
    entry), so its reference scores, at most its kernel scores plus ``tol``, stay below every settled score up to
    there, whether re-scored or not: neither the top ``k`` nor the ``k``-th settled score (the test of the cut)
    depends on them."""
    mask = np.zeros(scores.shape, dtype=bool)
    if scores.shape[1] < 2:
        return mask
    near = (scores[:, :-1] - scores[:, 1:]) <= 2 * tol[:, None]
    mask[:, :-1] |= near
    mask[:, 1:] |= near
    if 0 < k < scores.shape[1]:  # entry j >= k is linked to the k-th iff every gap between them is near
        mask[:, k:] &= np.logical_and.accumulate(near[:, k - 1:], axis=1)
    return mask


def settle(search: Callable[[np.ndarray, int], Tuple[np.ndarray, np.ndarray]],
           vectors_of: Callable[[np.ndarray], np.ndarray], queries: np.ndarray, k: int, count: int,
           max_norm: float, ties_by_id: bool = True,
           threads: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
    """The top ``k`` of each query by (reference score, ascending id), scores as the kernel's except near ties.

    Args:
        search: ``search(rows, width)``: the kernel's sorted top ``width`` ``(scores, ids)`` of ``queries[rows]``.
        vectors_of: float32 stored vectors of global document ids.
        queries: ``(q, dim)`` float32 queries (checked finite by the caller).
        k: results per query, ``<= count``.
        count: number of documents.
        max_norm: the largest norm of a stored vector (finite).
        ties_by_id: the kernel cuts equal scores by ascending id (numpy, torch; FAISS does not): a zero query, whose
            every score is exactly 0, is then answered by the kernel's first try.
        threads: workers re-scoring near ties (default: the cores this process may run on).
    """
    num_q = len(queries)
    threads = default_num_threads() if threads is None else max(1, int(threads))
    tol = tolerance(queries, max_norm)
    zero = ~np.any(queries, axis=1) if ties_by_id else np.zeros(len(queries), dtype=bool)
    out_scores = np.empty((num_q, k), dtype=np.float32)
    out_ids = np.empty((num_q, k), dtype=np.int64)
    todo = np.arange(num_q)
    width = min(count, k + extra_candidates(k))
    while len(todo):
        scores, ids = search(todo, width)
        scores = np.array(scores, dtype=np.float32)
        ids = np.asarray(ids, dtype=np.int64)
        if not np.isfinite(scores).all():  # a corrupt stored vector: the caller names it
            out_scores[todo], out_ids[todo] = scores[:, :k], ids[:, :k]
            return out_scores, out_ids
        last = scores[:, -1].copy()  # the kernel's: every document left out scores at most this there
        mask = _needed(scores, tol[todo], k)
        rows, cols = np.nonzero(mask)
        if len(rows):
            scores[rows, cols] = _rescore(queries[todo], rows, ids[rows, cols], vectors_of, threads)
        order = np.lexsort((ids, -scores), axis=1)
        scores = np.take_along_axis(scores, order, axis=1)
        ids = np.take_along_axis(ids, order, axis=1)
        if width >= count:
            done = np.ones(len(todo), dtype=bool)
        else:  # (a zero query scores every document exactly 0 everywhere: the kernel's cut by id is exact)
            done = (last + 2 * tol[todo] < scores[:, k - 1]) | zero[todo]
        out_scores[todo[done]], out_ids[todo[done]] = scores[done, :k], ids[done, :k]
        todo = todo[~done]
        width = min(count, width * 4)
    return out_scores, out_ids
