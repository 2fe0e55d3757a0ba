"""Exact search of an int8 index: an int8 scan that bounds every document's float32 score from both sides, float32
rescoring from the float copy of the documents whose upper bound reaches the ``k``-th best lower bound, and with it a
per-query proof that no other document can enter the top ``k``.

The codes (:mod:`~pyterrier_cpdae.dense.codes`) store each vector ``x`` as ``x = s * c + r``: ``s`` the per-dimension
scales, ``c`` an int8 code, ``r`` the residual, whose norm ``|r|`` is stored (rounded up) with ``|c|``. A query ``q``
is scaled by ``s`` (``q~ = q * s``, exact in float64) and written as two int8 *digits* (:func:`split_queries`):
``q~ = t1 p1 + t2 p2 + e``, ``p1`` the query quantised with one scale ``t1`` per query, ``p2`` its rounding error
quantised again with ``t2`` (about ``t1 / 254``), ``e`` what is left (about 254 times smaller than one digit's error).
Then, exactly::

    q . x = t1 (p1 . c) + t2 (p2 . c) + e . c + q . r,   so   |q . x - A| <= |e| |c| + |q| |r|   (Cauchy-Schwarz)

with ``A = t1 (p1 . c) + t2 (p2 . c)``. ``p1 . c`` and ``p2 . c`` are integers (one int8 product of the ``2 q``
digit rows with the codes, summed in int32, or in float32 where every partial sum is an integer that float32
holds). The scan's bounds ``L = A - eps`` and ``U = A + eps`` (``eps = |e| |c| + |q| |r|``, the norms rounded up and
inflated by 1%, plus the float32 rounding of ``A`` and the distance ``tol`` of :func:`.ties.tolerance` between the
true inner product and the reference score of :func:`.ties.reference_scores`) therefore hold for the *reference*
score ``R`` of every (query, document). For each query:

1. ``tau`` is kept while the scan runs (it only rises), never above the ``k``-th largest ``L`` of the documents
   scanned so far: first the ``k``-th largest ``A - E`` over the first block's documents, ``E`` the largest ``eps``
   of that block (so ``A - E <= L`` for each of them), then the ``k``-th largest ``L`` over the candidates; a
   document whose ``U`` is below the current ``tau`` is dropped at once, the others are kept as candidates;
2. at least ``k`` documents have ``R >= L >= tau`` (the final ``tau``), and every dropped document has
   ``R <= U < tau``: it is strictly below the ``k``-th best reference score, so it can neither enter the top ``k``
   nor tie with its last entry (a stale ``tau``, read while another thread raises it, is lower: it drops fewer);
3. the candidates whose ``U`` reaches the final ``tau`` are rescored from the float copy (the reference arithmetic:
   exact products, one float64 sum, one rounding), and their top ``k`` by (reference score, ascending id) is the
   float32 index's ranking, ties by docid included. No query is ever scanned twice.

The two digits cost twice the int8 products of one, and shrink the bound's query share, the larger on vectors
whose per-dimension spread makes the scaled query uneven, so that the candidates are a few times ``k`` instead of
tens of times (``experiments/results/bench_int8.md``). The queries get them from ``k = TWO_DIGITS_FROM``, and below
it where a first look at the documents shows one digit too loose (:func:`query_digits`).

The float32 index orders its results by the same reference scores wherever two of them are near
(:mod:`~pyterrier_cpdae.dense.ties`) and by scores within ``tol`` of them elsewhere, so the rankings are identical;
the returned scores are the reference scores (they may differ from the float32 index's by a unit in the last place
where that index kept its BLAS score).
"""
from __future__ import annotations

import contextlib
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from .._checks import check_int, default_num_threads
from .codes import QMAX, CodePart, _float_product, _round_up32
from .ties import _rescore, tolerance

#: unit roundoff of float32
U32 = 2.0 ** -24

#: the smallest ``k`` whose queries are always written in two int8 digits (module docstring); below it,
#: :func:`query_digits` looks at the first ``PROBE_ROWS`` documents to decide
TWO_DIGITS_FROM = 100

#: documents of the first part whose products with both digits decide, below ``TWO_DIGITS_FROM``, whether the queries
#: need the second (:func:`query_digits`)
PROBE_ROWS = 4096

#: what one more candidate costs a query (its filter survival, bookkeeping and share of the rescoring), in the scan's
#: int8 multiply-adds, an order of magnitude (about a microsecond of a core against a few 10**11 multiply-adds a
#: second): on the benchmarks' vectors it chooses one digit where one was the faster and two where one kept far too
#: many candidates (``experiments/results/bench_int8.md``, ``bench_int8_msmarco_scale.md``)
CANDIDATE_MACS = 1 << 19

#: the first block of a query batch's scan has at least this many times k rows (and at least the block size): the
#: k-th largest of its rows' estimates less the block's largest error bound seeds tau (measured: a seed from fewer
#: rows leaves more candidates to keep)
SEED_BLOCKS = 16

#: the first round of the rescoring takes each query's k + k // FIRST_EXTRA best candidates by their estimate
#: (measured: about 5% fewer rescored in all than with k)
FIRST_EXTRA = 10

#: the first block's float64 estimates take about this at most (fewer rows than SEED_BLOCKS x k for large batches
#: and k; never fewer than k rows)
SEED_BYTES = 1 << 26

#: the int32 products of one tile of the scan (after its first block), at most: a core's L2 cache
TILE_BYTES = 2 << 20

#: the candidates kept during a scan are dropped below tau once they number four times this, at least (a drop copies
#: them; before it they take about 32 bytes each)
DROP_FROM = 1 << 19


def quantise_queries(queries: np.ndarray, scales: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(p, t, e, q~)``: the int8 queries ``p`` of ``q~ = queries * scales`` (``(q, dim)``), their scales ``t``
    (``(q,)`` float64 values that float32 holds: ``max |q~| / 127`` rounded up), an upper bound ``e`` on the norm of
    the quantisation error ``q~ - t p``, and ``q~`` (float64)."""
    scaled = queries.astype(np.float64) * scales.astype(np.float64)  # exact: 24 + 24 bits in 53
    p, t, err = _digit(scaled)
    return p, t, err, scaled


def _digit(values: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(p, t, e)``: ``values`` (float64 ``(q, dim)``) as ``t p`` (int8 ``p``, per-row float32-representable scale
    ``t``) and a bound ``e`` on the norm of ``values - t p`` (inflated for its float64 evaluation)."""
    top = np.abs(values).max(axis=1) if values.shape[1] else np.zeros(len(values))
    t = _round_up32(np.where(top > 0, top / QMAX, 1.0)).astype(np.float64)
    p = np.clip(np.rint(values / t[:, None]), -QMAX, QMAX)
    norm = np.linalg.norm(values, axis=1)
    err = np.linalg.norm(values - p * t[:, None], axis=1) * (1 + 2.0 ** -40) + norm * 2.0 ** -48
    return p.astype(np.int8), t, err


def split_queries(queries: np.ndarray, scales: np.ndarray):
    """``(p1, t1, p2, t2, e, q~)``: the two int8 digits of ``q~ = queries * scales`` (module docstring),
    ``q~ = t1 p1 + t2 p2 + e``, with an upper bound ``e`` on ``|e|`` (float64 ``(q,)``)."""
    scaled = queries.astype(np.float64) * scales.astype(np.float64)
    p1, t1, _ = _digit(scaled)
    rest = scaled - p1 * t1[:, None]  # the first digit's error (rounded in float64: the bound below covers it)
    p2, t2, _ = _digit(rest)
    norm = np.linalg.norm(scaled, axis=1)
    err = np.linalg.norm(scaled - p1 * t1[:, None] - p2 * t2[:, None], axis=1) * (1 + 2.0 ** -40) + norm * 2.0 ** -46
    return p1, t1, p2, t2, err, scaled


def search(parts: Sequence[CodePart], queries: np.ndarray, k: int, vectors_of: Callable[[np.ndarray], np.ndarray], *,
           backend: str = "numpy", block_size: int = 16384, query_batch_size: int = 512,
           threads: Optional[int] = None, stats: Optional[dict] = None,
           prefetch: Optional[Callable[[np.ndarray], object]] = None) -> Tuple[np.ndarray, np.ndarray]:
    """The exact top ``k`` ``(scores, ids)`` (``(q, min(k, count))``, scores descending, ties by ascending id) of the
    float32 ``queries`` (finite, checked by the caller) over the int8 ``parts`` (module docstring).

    Args:
        vectors_of: float32 stored vectors (the float copy) of global document ids.
        prefetch: when given, called with the global ids of each round of rescoring before ``vectors_of`` reads
            them (the store's :func:`~pyterrier_cpdae.dense.format.prefetch_ids`: their reads queued together).
        backend: the scan's products: ``"torch"`` (``torch._int_mm``) or ``"numpy"`` (float32 BLAS of the widened
            codes); the same results.
        stats: when given, counts ``rescored`` (documents rescored from the float copy), ``candidates`` (documents
            kept by the scans, before the rescoring's rounds) and ``retries`` (queries scanned again: always 0, kept for
            the callers that read it), holds ``digits`` (the most query digits a batch was written in,
            :func:`query_digits`), and adds up the wall time of the scans (``scan_s``: the int8 products, their
            filter and the candidates) and of the rescoring (``rescore_s``: reading the float copy and scoring).
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
    stats = {} if stats is None else stats
    for key in ("rescored", "candidates", "retries", "scan_s", "rescore_s"):
        stats.setdefault(key, 0)
    if k == 0 or num_q == 0:
        return out_scores, out_ids
    for qs in range(0, num_q, query_batch_size):
        s, i = _search_batch(parts, queries[qs:qs + query_batch_size], k, vectors_of, backend, block_size,
                             threads, stats, prefetch)
        out_scores[qs:qs + len(s)], out_ids[qs:qs + len(s)] = s, i
    return out_scores, out_ids


def query_digits(parts: Sequence[CodePart], queries: np.ndarray, k: int, backend: str = "torch") -> int:
    """How many int8 digits (1 or 2) the scan writes ``queries`` (float32, finite) in at ``k``: two from
    ``TWO_DIGITS_FROM``; below it, two when the first ``PROBE_ROWS`` documents of the first part show that the
    documents only one digit would let through cost more than the second digit's products: their share of the
    documents times ``CANDIDATE_MACS`` above ``dim``. Those are the probe's documents whose one-digit upper bound
    reaches a threshold that two digits' upper bounds do not, the threshold being the probe's two-digit lower bound
    of the rank the ``k``-th best of the whole index has in a sample of the probe's size (``k`` times the probe's
    rows over all documents, at least 1), so that the count stands for the scan's, whose threshold rises to the
    ``k``-th best of all. One digit's bound is loose where the scaled query
    is uneven (per-dimension scales far apart, a few wide dimensions): then it keeps a sizeable share of the
    documents as candidates (their memory and rescoring), where two keep a few times ``k``. Either choice gives the
    same results."""
    if k >= TWO_DIGITS_FROM:
        return 2
    codes = next((c for c, _, _ in parts if len(c.codes)), None)
    rows = 0 if codes is None else min(len(codes.codes), PROBE_ROWS)
    if rows <= k or not len(queries):
        return 1
    num_q, dim = queries.shape
    p1, t1, p2, t2, e2, _ = split_queries(queries, codes.scales)
    e1 = quantise_queries(queries, codes.scales)[2]
    ints = int_products(np.asarray(codes.codes[:rows]), product_operand(np.concatenate([p1, p2]), backend), backend)
    first = t1 * ints[:, :num_q]
    both = first + t2 * ints[:, num_q:]
    residual = np.linalg.norm(queries.astype(np.float64), axis=1) * np.asarray(codes.residual_norms[:rows])[:, None]
    cnorm = np.asarray(codes.code_norms[:rows], dtype=np.float64)[:, None]
    eps2 = e2 * cnorm + residual
    count = sum(len(c.codes) for c, _, _ in parts)
    rank = min(k, max(1, -(-k * rows // count)))  # (the k-th best of all documents, in a sample of `rows` of them)
    tau = np.partition(both - eps2, rows - rank, axis=0)[rows - rank]
    one = np.count_nonzero(first + e1 * cnorm + residual >= tau)
    two = np.count_nonzero(both + eps2 >= tau)
    return 2 if (one - two) / (rows * num_q) * CANDIDATE_MACS > dim else 1


def product_operand(digit_rows: np.ndarray, backend: str):
    """The int8 query digit rows (``(rows, dim)``) as :func:`int_products` takes them: for ``"torch"`` transposed and
    contiguous as the product's right operand (the codes its left: the document-major product measured 2-4x faster
    than the query-major one, oneDNN with VNNI), for ``"numpy"`` as float32."""
    if backend == "torch":
        import torch

        return torch.from_numpy(np.ascontiguousarray(digit_rows.T))
    return digit_rows.astype(np.float32)


def int_products(codes: np.ndarray, operand, backend: str) -> np.ndarray:
    """The integer products ``(len(codes), digit rows)`` of int8 ``codes`` with the query digits ``operand``
    (:func:`product_operand`): ``torch._int_mm`` (int32), or float32 BLAS of the widened codes, exact in float32."""
    if backend != "torch":
        return _float_product(operand, codes).T
    import torch

    with warnings.catch_warnings():  # (a read-only memmap: torch only reads it)
        warnings.simplefilter("ignore", UserWarning)
        block = torch.from_numpy(codes)
    if len(block) < 17:  # (oneDNN int8 products want more than 16 rows)
        block = torch.cat([block, torch.zeros((17 - len(block), block.shape[1]), dtype=torch.int8)])
    return torch._int_mm(block, operand)[:len(codes)].numpy()


def tile_rows(num_q: int, digits: int, block_size: int) -> int:
    """Rows of the scan's tiles after its first block for ``num_q`` queries written in ``digits`` int8 digits: int32
    products of about ``TILE_BYTES`` (a core's L2 cache), at least 256 rows and at most ``block_size``."""
    return min(block_size, max(256, TILE_BYTES // (4 * digits * num_q)))


def _first_ids(parts: Sequence[CodePart], k: int) -> np.ndarray:
    """The ``k`` smallest global ids (what a zero query, whose every score is exactly 0, returns: ties by id)."""
    ids = np.concatenate([np.arange(min(k, len(c.codes)), dtype=np.int64) * stride + offset
                          for c, offset, stride in parts])
    return np.sort(ids)[:k]


class _Candidates:
    """The documents a query batch keeps during the scan: ``(row, id, upper, lower)`` entries, and each query's
    ``tau`` (the ``k``-th largest lower bound seen so far; ``-inf`` until ``k`` are known; module docstring, step 1).

    Each query's ``k`` largest lower bounds are kept apart, as a dense ``(queries, k)`` matrix: the lower bounds added
    since are pooled and merged into it (one partition of each row) once they number ``refresh``, which sets the new
    ``tau`` (a merge never sorts the kept candidates again); the candidates themselves are only appended, and those
    whose upper bound is below ``tau`` are dropped when they have grown fourfold since the last drop (and number four
    times ``DROP_FROM`` at least), and at the end. ``add`` may be called from several threads (a lock orders them);
    ``tau`` may be read at any time: it only rises, and a stale one lets through a superset."""

    def __init__(self, num_q: int, k: int):
        self.num_q, self.k = num_q, k
        self.tau = np.full(num_q, -np.inf)
        self.top = np.full((num_q, k), -np.inf)  # each query's k largest lower bounds merged so far (any order)
        self.chunks: List[Tuple[np.ndarray, ...]] = []
        self.pool: List[Tuple[np.ndarray, np.ndarray]] = []  # (rows, lower) not merged into top yet
        self.fresh = 0  # entries in pool
        self.size = 0  # entries in chunks
        self.pruned = 0  # entries in chunks after the last drop
        self.refresh = max(num_q * k, 1 << 16)
        self.lock = threading.Lock()

    def add(self, rows: np.ndarray, ids: np.ndarray, upper: np.ndarray, lower: np.ndarray) -> None:
        if not len(rows):
            return
        with self.lock:
            self.chunks.append((rows, ids, upper, lower))
            self.pool.append((rows, lower))
            self.fresh += len(rows)
            self.size += len(rows)
            if self.fresh >= self.refresh:
                self._merge()
                if self.size >= 4 * max(self.pruned, self.refresh, DROP_FROM):
                    self._drop()

    def seed(self, tau: np.ndarray) -> None:
        """Raises ``tau`` to ``tau`` where higher: each value must be at most the ``k``-th largest lower bound of
        ``k`` documents that the scan adds or drops (the caller's proof)."""
        with self.lock:
            self.tau = np.maximum(self.tau, tau)

    def _merge(self) -> None:
        """Merges the pooled lower bounds into each query's ``k`` largest; raises ``tau``."""
        if not self.pool:
            return
        rows = np.concatenate([p[0] for p in self.pool])
        lower = np.concatenate([p[1] for p in self.pool])
        self.pool, self.fresh = [], 0
        counts = np.bincount(rows, minlength=self.num_q)
        if _dense(self.num_q, self.k + int(counts.max()), self.top.size + len(rows)):
            # each query's bounds as a row of a dense matrix (grouped by query with a radix sort), its k largest by a
            # partition
            order = _by_row(rows, self.num_q)
            starts = np.cumsum(counts) - counts
            by_row = rows[order]
            dense = np.full((self.num_q, self.k + int(counts.max())), -np.inf)
            dense[:, :self.k] = self.top
            dense[by_row, self.k + np.arange(len(rows)) - starts[by_row]] = lower[order]
            self.top = -np.partition(-dense, self.k - 1, axis=1)[:, :self.k]
        else:  # (a few queries hold most of the bounds: one sort instead of a mostly empty matrix)
            rows = np.concatenate([np.repeat(np.arange(self.num_q), self.k), rows])
            lower = np.concatenate([self.top.ravel(), lower])
            order = np.lexsort((-lower, rows))
            self.top = lower[order[_starts(rows, self.num_q)[:, None] + np.arange(self.k)]]
        self.tau = np.maximum(self.tau, self.top.min(axis=1))

    def _drop(self) -> None:
        """Drops the candidates whose upper bound is below ``tau``."""
        kept = []
        for rows, ids, upper, lower in self.chunks:  # chunk by chunk: only what is kept is copied
            keep = upper >= self.tau[rows]
            kept.append((rows[keep], ids[keep], upper[keep], lower[keep]))
        self.chunks = [tuple(np.concatenate(a) for a in zip(*kept))]
        self.size = self.pruned = len(self.chunks[0][0])

    def update(self) -> Tuple[np.ndarray, ...]:
        """Merges the pool (the final ``tau``), drops the entries below it; returns the kept ``(rows, ids, upper,
        lower)``."""
        with self.lock:
            if not self.chunks:
                empty = np.empty(0, np.int64)
                return empty, empty, np.empty(0, np.float32), np.empty(0, np.float32)
            self._merge()
            self._drop()
            return self.chunks[0]


def _by_row(rows: np.ndarray, num_q: int) -> np.ndarray:
    """The order that groups ``rows`` (query rows ``< num_q``) by row, stable (numpy sorts small integer keys stably
    with a radix sort: int16 keys sort several times faster than int64 ones)."""
    return np.argsort(rows.astype(np.int16) if num_q < 1 << 15 else rows, kind="stable")


def _starts(rows: np.ndarray, num_q: int) -> np.ndarray:
    """Where each row's entries start once ``rows`` are sorted."""
    counts = np.bincount(rows, minlength=num_q)
    return np.cumsum(counts) - counts


def _dense(num_q: int, width: int, entries: int) -> bool:
    """Whether a dense ``(num_q, width)`` matrix of ``entries`` values is small enough to partition its rows (rather
    than sort the entries): at most four times their number, or a MiB of float64."""
    return num_q * width <= 4 * entries + (1 << 17)


def _search_batch(parts, queries, k, vectors_of, backend, block_size, threads, stats, prefetch=None):
    num_q, dim = queries.shape
    max_norm = max(c.max_norm for c, _, _ in parts)
    qnorm = np.linalg.norm(queries.astype(np.float64), axis=1)
    tol = tolerance(queries, max_norm)
    out_scores = np.zeros((num_q, k), dtype=np.float32)
    out_ids = np.empty((num_q, k), dtype=np.int64)
    zero = ~np.any(queries, axis=1)
    out_ids[zero] = _first_ids(parts, k)
    todo = np.flatnonzero(~zero)
    if not len(todo):
        return out_scores, out_ids
    sub = queries[todo]
    cand = _Candidates(len(todo), k)
    started = time.perf_counter()
    digits = query_digits(parts, sub, k, backend)
    stats["digits"] = max(stats.get("digits", 0), digits)
    for codes, offset, stride in parts:
        _scan_part(codes, offset, stride, sub, qnorm[todo], tol[todo], cand, backend, block_size, digits,
                   threads)
    rows, ids, upper, lower = cand.update()
    scanned = time.perf_counter()
    stats["scan_s"] += scanned - started
    stats["candidates"] += len(rows)
    # 3. the candidates that may reach the k-th best reference score, rescored from the float copy in two rounds:
    # first each query's k + k / FIRST_EXTRA best by the middle of their bounds, whose k-th best reference score R1
    # is at most the k-th best; then only the others whose upper bound reaches R1 (a candidate below it cannot reach
    # the k-th best)
    nq = len(todo)
    counts = np.bincount(rows, minlength=nq)  # every query has at least k candidates (step 2)
    starts = np.cumsum(counts) - counts
    width = min(int(counts.min()), k + k // FIRST_EXTRA)  # (a few more than k: R1 then nearer the k-th best)
    if _dense(nq, int(counts.max()), len(rows)):
        by_row = _by_row(rows, nq)
        sorted_rows = rows[by_row]
        mid = np.full((nq, int(counts.max())), np.inf)  # minus the middles, query by query, inf past each query's
        mid[sorted_rows, np.arange(len(rows)) - starts[sorted_rows]] = -(upper + lower)[by_row]
        first = by_row[(starts[:, None] + np.argpartition(mid, width - 1, axis=1)[:, :width]).reshape(-1)]
    else:  # (a few queries hold most of the candidates: one sort instead of a mostly empty matrix)
        first = np.lexsort((-(upper + lower), rows))[(starts[:, None] + np.arange(width)).reshape(-1)]
    ref = np.full(len(rows), -np.inf, dtype=np.float32)
    if prefetch is not None:
        prefetch(ids[first])
    ref[first] = _rescore(sub, rows[first], ids[first], vectors_of, threads)
    r1 = -np.partition(-ref[first].reshape(nq, width), k - 1, axis=1)[:, k - 1]
    scored = np.zeros(len(rows), dtype=bool)
    scored[first] = True
    rest = np.flatnonzero((upper >= r1[rows]) & ~scored)
    if prefetch is not None and len(rest):
        prefetch(ids[rest])
    ref[rest] = _rescore(sub, rows[rest], ids[rest], vectors_of, threads)
    scored[rest] = True
    stats["rescored"] += len(first) + len(rest)
    stats["rescore_s"] += time.perf_counter() - scanned
    done = np.flatnonzero(scored)  # query by query: reference score descending, ties by ascending id
    order = done[np.lexsort((ids[done], -ref[done], rows[done]))]
    take = order[(_starts(rows[done], nq)[:, None] + np.arange(k)).reshape(-1)]
    out_scores[todo] = ref[take].reshape(len(todo), k)
    out_ids[todo] = ids[take].reshape(len(todo), k)
    return out_scores, out_ids


def _scan_part(codes, offset: int, stride: int, queries: np.ndarray, qnorm: np.ndarray, tol: np.ndarray,
               cand: _Candidates, backend: str, block_size: int, digits: int, threads: int = 1) -> None:
    """Scans one part (rows with ids ``row * stride + offset``) for the candidates of ``cand`` (steps 1-2), the
    queries written in ``digits`` (1 or 2) int8 digits.

    Each block's integer products are filtered first on the first digit's alone: ``U >= tau`` implies
    ``t1 (p1 . c) >= tau - D`` with ``D`` the block's largest ``t2 (p2 . c)`` plus its largest ``eps``, one
    comparison of the int32 products with a per-query integer threshold (lowered by a margin for the float32
    products of the numpy scan); only the documents that pass have their bounds computed, in float64.

    The first block (``SEED_BLOCKS x k`` rows at least, while the batch has no ``tau``) seeds ``tau`` (step 1); the
    rest is scanned in tiles of about ``TILE_BYTES`` of products (a core's L2 cache), shared by ``threads`` workers
    that each run their products on one thread, so that the filters run in parallel too."""
    n = len(codes.codes)
    if n == 0:
        return
    num_q, dim = queries.shape
    if digits == 2:
        p1, t1, p2, t2, err, _ = split_queries(queries, codes.scales)
    else:
        p1, t1, err, _ = quantise_queries(queries, codes.scales)
        p2, t2 = p1[:0], np.zeros(num_q)
    # the rounding of A = t1 (p1 . c) + t2 (p2 . c) and of the bound's terms (float32 products of more than 2**24 /
    # 127**2 dimensions, float64 evaluation): a few units in the last float32 place of their largest magnitudes; and
    # the distance between the true inner product and the reference score
    slack = (2.0 ** -18 * ((t1 + t2) * QMAX * QMAX * dim + qnorm * codes.max_residual_norm
                           + err * codes.max_code_norm) + tol) * 1.01 + 1e-300
    coef = np.stack([_round_up32(err * 1.01), _round_up32(qnorm * (1 + 2.0 ** -40) * 1.01)],
                    axis=1).astype(np.float64)  # eps = coef . (|c|, |r|) + slack
    margin = 2 + QMAX * QMAX * dim * 2.0 ** -20  # integers, for the float32 products of the numpy scan
    digit_rows = product_operand(np.concatenate([p1, p2]), backend)
    if backend == "torch":
        import torch
    cnorm, rnorm = codes.code_norms, codes.residual_norms
    coef0, coef1 = coef[:, 0].copy(), coef[:, 1].copy()

    def scan_block(start: int, stop: int, seed: bool = False) -> None:
        ints = int_products(np.asarray(codes.codes[start:stop]), digit_rows, backend)  # (b, digit rows)
        gmax, rmax = float(cnorm[start:stop].max()), float(rnorm[start:stop].max())
        worst = coef[:, 0] * gmax + coef[:, 1] * rmax + slack  # each query's largest eps in the block
        if seed and stop - start >= cand.k:  # tau from this block's own lower bounds, before its filter (see below)
            approx = t1 * ints[:, :num_q]
            if digits == 2:
                approx += t2 * ints[:, num_q:2 * num_q]
            cand.seed(np.partition(approx, stop - start - cand.k, axis=0)[stop - start - cand.k] - worst)
        tau = cand.tau  # (read once: another worker may raise it meanwhile; a stale tau only keeps more)
        reach = worst
        if digits == 2:  # the second digit's largest product in the block, per query (its bound where not exact)
            reach = worst + t2 * ints[:, num_q:2 * num_q].max(axis=0) + t2 * margin
        with np.errstate(invalid="ignore"):
            low = (tau - reach) / t1
            thr = np.floor(low - np.abs(low) * 2.0 ** -30 - margin)  # (lowered past the float64 rounding of low)
        thr = np.nan_to_num(thr, nan=-2.0 ** 31, neginf=-2.0 ** 31).clip(-2.0 ** 31, 2.0 ** 31 - 1)
        # (flatnonzero of the mask and a divmod of the few survivors: several times faster than a 2-D nonzero)
        flat = np.flatnonzero(ints[:, :num_q] >= thr.astype(ints.dtype))
        if not len(flat):
            return
        c, r = np.divmod(flat, num_q)
        if ints.flags.c_contiguous:  # (torch's products: read in the flat array, faster than a 2-D gather)
            at = flat + c * (ints.shape[1] - num_q)  # the survivors' first-digit products in the flat array
            products = ints.reshape(-1)
            first_digit = products[at]
            second_digit = products[at + num_q] if digits == 2 else None
        else:  # (numpy's: a transposed view)
            first_digit = ints[c, r]
            second_digit = ints[c, num_q + r] if digits == 2 else None
        approx = t1[r] * first_digit
        if digits == 2:
            approx += t2[r] * second_digit
        eps = coef0[r] * cnorm[start:stop][c] + coef1[r] * rnorm[start:stop][c] + slack[r]
        upper = approx + eps
        keep = upper >= tau[r]
        r, c, upper, eps = r[keep], c[keep], upper[keep], eps[keep]
        cand.add(r, (c + start).astype(np.int64) * stride + offset, upper, upper - 2 * eps)

    # while the batch knows fewer than k lower bounds, a first block of at least SEED_BLOCKS x k rows sets tau: the
    # k-th largest over its rows of A - (the block's largest eps), each at most that row's lower bound, so that at
    # least k documents have L >= that value; then its rows are filtered as any block's
    seed = bool(np.isneginf(cand.tau).any())
    # after it, tiles whose int32 products stay in a core's L2 cache while they are filtered (measured faster than
    # 16,384-row blocks, whose products are read back from memory by the filter)
    step = tile_rows(num_q, digits, block_size)
    first = min(n, max(block_size, min(SEED_BLOCKS * cand.k, max(cand.k, SEED_BYTES // (8 * num_q))))) if seed \
        else step
    spans = [(start, min(n, start + (first if start == 0 else step))) for start in [0] + list(range(first, n, step))]
    workers = min(threads, len(spans) - 1)
    scan_block(*spans[0], seed=seed)
    if workers <= 1:
        for span in spans[1:]:
            scan_block(*span)
        return
    # the blocks after the first shared by the workers, each taking the next one left, so that the filters, which
    # numpy runs on one core, run in parallel too (numpy releases the GIL). Each worker runs its int8 products on one
    # thread (measured as fast or a little faster than workers of torch's whole thread count, which oversubscribe
    # the cores); torch.set_num_threads also sets the count that threads starting torch later take (and MKL's), so
    # the caller's count is set back at the end. The BLAS of the numpy scan is held to one thread per call meanwhile, as
    # the fused float32 search does
    from .kernels import one_blas_thread

    held = one_blas_thread() if backend == "numpy" else None
    before = torch.get_num_threads() if backend == "torch" else None
    one_thread = {"initializer": torch.set_num_threads, "initargs": (1,)} if backend == "torch" else {}
    try:
        with held if held is not None else contextlib.nullcontext(), ThreadPoolExecutor(workers, **one_thread) as pool:
            list(pool.map(lambda span: scan_block(*span), spans[1:]))
    finally:
        if before is not None:
            torch.set_num_threads(before)
