"""Exact search of an int8 index: an int8 scan, a bound on each score's quantisation error, float32 rescoring of the
candidates from the float copy, and a per-query proof that no other document can enter the top ``k``.

The codes (:mod:`~pyterrier_cpdae.dense.codes`) store each vector ``x`` as ``x = s * c + r``: ``s`` the per-dimension
scales, ``c`` an int8 code, ``r`` the residual, whose norm ``|r|`` is stored (rounded up) with ``|c|``. A query ``q``
is scaled by ``s`` (``q~ = q * s``, exact in float64) and quantised to int8 with one scale ``t`` per query
(``q~ = t p + e``). Then, exactly::

    q . x = t (p . c) + e . c + q . r,   so   |q . x - t (p . c)| <= |e| |c| + |q| |r|   (Cauchy-Schwarz)

``p . c`` is an integer (int8 products summed in int32, or in float32 where every partial sum is an integer that
float32 holds), so ``U = t (p . c) + |q| |r| + |e| |c|`` (the norms rounded up and inflated by 1%, plus the float32
rounding of ``U``) bounds the true inner product from above, per query and document. For each query:

1. the scan keeps the ``M`` documents with the largest ``U`` (ties by ascending id); any other document has a true
   score at most the ``M``-th ``U``, ``U_out``;
2. the ``k`` kept documents with the largest ``U`` are rescored from the float copy (:func:`.ties.reference_scores`'
   arithmetic: exact products, one float64 sum, one rounding: the scores that order the float32 index's near ties);
   their ``k``-th score minus the reference's rounding bound ``tol`` (:func:`.ties.tolerance`), ``thr``, is at most
   the true score of ``k`` documents;
3. every kept document whose ``U`` reaches ``thr`` has the query's share of the bound taken out: ``q~ . c`` is
   computed from its code in float32, with its rounding bound (``q . x = q~ . c + q . r``, so the bound is
   ``|q| |r|`` and that rounding alone), and those still
   reaching ``thr`` are rescored; a document that is not rescored has a true score below ``thr``, hence a reference
   score below the ``k``-th rescored one: it can neither enter the top ``k`` nor tie with its last entry;
4. the cut is proved when ``U_out < thr``; the top ``k`` of the rescored documents by (score, ascending id) is then
   the float32 index's ranking, ties by docid included. A query that is not proved is scanned again keeping four
   times as many documents (in the end every document: no ``U_out``): never a wrong result, only a slower one.

The float32 index orders its results by the same reference scores wherever two of them are near
(:mod:`~pyterrier_cpdae.dense.ties`) and by scores within ``tol`` of them elsewhere, so the rankings are identical;
the returned scores are the reference scores (they may differ from the float32 index's by a unit in the last place
where that index kept its BLAS score).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from .._checks import check_int, default_num_threads
from .codes import QMAX, CodePart, scan
from .ties import _rescore, tolerance

#: unit roundoff of float32
U32 = 2.0 ** -24

#: retries of a query whose cut is not proved, each keeping four times as many documents (the last keeps them all)
MAX_TRIES = 8


def kept_for(k: int) -> int:
    """Documents a query keeps from the scan (the first try): ``16 k + 256``. The scan's bounds are loose (Cauchy-Schwarz
    on the query's and the documents' quantisation errors), so the documents that may reach the ``k``-th score are
    many more than ``k``; a shorter list means scanning again (measured on 1M x 384: at k = 1000, 4 k + 256 scanned
    again for 80% of the queries, 16 k + 256 for none)."""
    return 16 * k + 256


def quantise_queries(queries: np.ndarray, scales: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(p, t, e, q~)``: the int8 queries ``p`` of ``q~ = queries * scales`` (``(q, dim)``), their scales ``t``
    (``(q,)`` float64: ``max |q~| / 127``), an upper bound ``e`` on the norm of the quantisation error ``q~ - t p``, and
    ``q~`` (float64)."""
    scaled = queries.astype(np.float64) * scales.astype(np.float64)  # exact: 24 + 24 bits in 53
    top = np.abs(scaled).max(axis=1) if scaled.shape[1] else np.zeros(len(scaled))
    t = np.where(top > 0, top / QMAX, 1.0)
    p = np.clip(np.rint(scaled / t[:, None]), -QMAX, QMAX)
    norm = np.linalg.norm(scaled, axis=1)
    err = np.linalg.norm(scaled - p * t[:, None], axis=1) * (1 + 2.0 ** -40) + norm * 2.0 ** -48
    return p.astype(np.int8), t, err, scaled


def search(parts: Sequence[CodePart], queries: np.ndarray, k: int, vectors_of: Callable[[np.ndarray], np.ndarray], *,
           backend: str = "numpy", block_size: int = 16384, query_batch_size: int = 1024,
           threads: Optional[int] = None, stats: Optional[dict] = None) -> Tuple[np.ndarray, np.ndarray]:
    """The exact top ``k`` ``(scores, ids)`` (``(q, min(k, count))``, scores descending, ties by ascending id) of the
    float32 ``queries`` (finite, checked by the caller) over the int8 ``parts`` (module docstring).

    Args:
        vectors_of: float32 stored vectors (the float copy) of global document ids.
        backend: the scan's products: ``"torch"`` (``torch._int_mm``) or ``"numpy"`` (float32 BLAS), see
            :func:`.codes.scan`.
        stats: when given, counts ``rescored`` (documents rescored), ``retries`` (queries scanned again).
    """
    k = check_int(k, "k")
    block_size = check_int(block_size, "block_size")
    query_batch_size = check_int(query_batch_size, "query_batch_size")
    threads = default_num_threads() if threads is None else check_int(threads, "threads")
    count = sum(len(c.codes) for c, _, _ in parts)
    k = min(k, count)
    num_q = len(queries)
    out_scores = np.empty((num_q, k), dtype=np.float32)
    out_ids = np.empty((num_q, k), dtype=np.int64)
    if k == 0 or num_q == 0:
        return out_scores, out_ids
    stats = {} if stats is None else stats
    stats.setdefault("rescored", 0)
    stats.setdefault("retries", 0)
    # the candidates' arrays are (queries, kept) float64 each: batches small enough that each stays near 128 MB
    query_batch_size = max(1, min(query_batch_size, (16 << 20) // kept_for(k)))
    for qs in range(0, num_q, query_batch_size):
        s, i = _search_batch(parts, queries[qs:qs + query_batch_size], k, count, vectors_of, backend, block_size,
                             threads, stats)
        out_scores[qs:qs + len(s)], out_ids[qs:qs + len(s)] = s, i
    return out_scores, out_ids


def _first_ids(parts: Sequence[CodePart], k: int) -> np.ndarray:
    """The ``k`` smallest global ids (what a zero query, whose every score is exactly 0, returns: ties by id)."""
    ids = np.concatenate([np.arange(min(k, len(c.codes)), dtype=np.int64) * stride + offset
                          for c, offset, stride in parts])
    return np.sort(ids)[:k]


def _search_batch(parts, queries, k, count, vectors_of, backend, block_size, threads, stats):
    num_q, dim = queries.shape
    max_norm = max(c.max_norm for c, _, _ in parts)
    qnorm = np.linalg.norm(queries.astype(np.float64), axis=1)
    tol = tolerance(queries, max_norm)
    quantised = [quantise_queries(queries, c.scales) for c, _, _ in parts]
    out_scores = np.zeros((num_q, k), dtype=np.float32)
    out_ids = np.empty((num_q, k), dtype=np.int64)
    zero = ~np.any(queries, axis=1)
    out_ids[zero] = _first_ids(parts, k)
    todo = np.flatnonzero(~zero)
    width = kept_for(k)
    largest = max(len(c.codes) for c, _, _ in parts)
    for attempt in range(MAX_TRIES):
        if not len(todo):
            break
        if attempt == MAX_TRIES - 1:
            width = largest  # the last try keeps every document: nothing is left out
        # the scan ranks each document by the upper bound of its true score, t (p . c) + |q| |r| + |e| |c| (float32)
        coeffs = [_upper_coefficients(queries[todo], t[todo], err[todo], codes)
                  for (codes, _, _), (_, t, err, _) in zip(parts, quantised)]

        def upper_bound(j, scores, start, stop):
            t32, qn32, e32, codes = coeffs[j]
            scores *= t32[:, None]
            scores += np.multiply.outer(qn32, codes.residual_norms[start:stop])
            scores += np.multiply.outer(e32, codes.code_norms[start:stop])

        found = scan(parts, [p[todo] for p, _, _, _ in quantised], width, decode=lambda rows: rows, backend=backend,
                     block_size=block_size, threads=threads, transform=upper_bound)
        upper, ids, outside = [], [], np.full(len(todo), -np.inf)
        for (codes, offset, stride), (_, t, err, _), (bounds, part_ids) in zip(parts, quantised, found):
            t, err = t[todo], err[todo]
            # the float32 rounding of the scan's bounds (a few units in the last place of their largest terms)
            slack = 2.0 ** -18 * (t * QMAX * QMAX * dim + qnorm[todo] * codes.max_residual_norm
                                  + err * codes.max_code_norm) + 1e-300
            upper.append(bounds.astype(np.float64) + slack[:, None])
            ids.append(part_ids)
            if bounds.shape[1] < len(codes.codes):  # documents left out of this part: bounds at most its last
                outside = np.maximum(outside, bounds[:, -1].astype(np.float64) + slack)
        upper, ids = np.concatenate(upper, 1), np.concatenate(ids, 1)
        # 1. the k best by their bounds, rescored
        first = np.argpartition(-upper, k - 1, axis=1)[:, :k] if upper.shape[1] > k else \
            np.broadcast_to(np.arange(upper.shape[1]), upper.shape)
        rescored = np.zeros(upper.shape, dtype=bool)
        np.put_along_axis(rescored, first, True, axis=1)
        ref = np.full(upper.shape, -np.inf, dtype=np.float32)
        rows, cols = np.nonzero(rescored)
        ref[rows, cols] = _rescore(queries[todo], rows, ids[rows, cols], vectors_of, threads)
        threshold = ref[rescored].reshape(len(todo), k).min(axis=1).astype(np.float64) - tol[todo]
        # 2. every kept document whose bound reaches the threshold: the query's share of the bound taken out (q~ . c
        # computed from the code, with its rounding margin, leaving |q| |r|), and those still reaching it rescored
        maybe = (upper >= threshold[:, None]) & ~rescored
        rows, cols = np.nonzero(maybe)
        if len(rows):
            code_score, margin = _code_scores(parts, quantised, todo, rows, ids[rows, cols])
            local_r = _residual_norms(parts, ids[rows, cols])
            tight = code_score + margin + qnorm[todo][rows] * local_r * 1.01 + 1e-300
            keep = tight >= threshold[rows]
            rows, cols = rows[keep], cols[keep]
        more = np.zeros_like(maybe)
        more[rows, cols] = True
        ref[rows, cols] = _rescore(queries[todo], rows, ids[rows, cols], vectors_of, threads)
        stats["rescored"] += int(rescored.sum() + more.sum())
        # 3. the cut: nothing left out of the scan may reach the threshold
        done = outside < threshold
        order = np.lexsort((ids, -ref), axis=1)[:, :k]
        top_scores = np.take_along_axis(ref, order, axis=1)
        top_ids = np.take_along_axis(ids, order, axis=1)
        out_scores[todo[done]], out_ids[todo[done]] = top_scores[done], top_ids[done]
        todo = todo[~done]
        stats["retries"] += len(todo)
        width = min(largest, width * 4)
    return out_scores, out_ids


def _upper_coefficients(queries: np.ndarray, t: np.ndarray, err: np.ndarray, codes):
    """The float32 factors of the scan's bound ``t (p . c) + |q| |r| + |e| |c|`` (``|q|`` and ``|e|`` rounded up)."""
    from .codes import _round_up32

    qnorm = np.linalg.norm(queries.astype(np.float64), axis=1) * (1 + 2.0 ** -40)
    return t.astype(np.float32), _round_up32(qnorm * 1.01), _round_up32(err * 1.01), codes


def _locate(parts: Sequence[CodePart], ids: np.ndarray):
    """For global ids, ``(part index, local row)`` (parts are round-robin shards: id = row * n + part)."""
    n = len(parts)
    if n == 1:
        return np.zeros(len(ids), dtype=np.int64), ids
    return ids % n, ids // n


def _residual_norms(parts: Sequence[CodePart], ids: np.ndarray) -> np.ndarray:
    which, local = _locate(parts, ids)
    out = np.empty(len(ids), dtype=np.float64)
    for j, (codes, _, _) in enumerate(parts):
        mask = which == j
        out[mask] = codes.residual_norms[local[mask]]
    return out


def _code_scores(parts: Sequence[CodePart], quantised, todo: np.ndarray, rows: np.ndarray,
                 ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """``(q~ . c, margin)`` for the pairs (query ``todo[rows[i]]``, document ``ids[i]``): float32 products of ``q~``
    (rounded to float32) and the codes, read from memory in ascending row order query by query; ``margin`` bounds
    their distance from the exact ``q~ . c``: ``(dim + 4) u |q~| |c|`` (the rounding of ``q~`` and the float32
    accumulation of ``dim`` products), inflated by 2%."""
    which, local = _locate(parts, ids)
    out = np.empty(len(ids), dtype=np.float64)
    margin = np.empty(len(ids), dtype=np.float64)
    for j, (codes, _, _) in enumerate(parts):
        scaled = quantised[j][3]
        mask = np.flatnonzero(which == j)
        if not len(mask):
            continue
        dim = scaled.shape[1]
        qnorm = np.linalg.norm(scaled, axis=1)
        margin[mask] = (dim + 4) * U32 * 1.02 * qnorm[todo[rows[mask]]] * codes.code_norms[local[mask]]
        order = mask[np.lexsort((local[mask], rows[mask]))]
        bounds = np.flatnonzero(np.diff(rows[order])) + 1
        for group in np.split(order, bounds):
            q = scaled[todo[rows[group[0]]]].astype(np.float32)
            out[group] = np.asarray(codes.codes[local[group]]).astype(np.float32) @ q
    return out, margin
