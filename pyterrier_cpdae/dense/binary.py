"""Search of a binary index (one sign bit a dimension, 32x smaller than float32): a Hamming scan, then float32
rescoring of the best ``k * rescore_multiplier`` from the float copy. Approximate: a document whose sign bits are
far from the query's is never rescored, however high its float32 score (the measured quality is in
``docs/dense_index.md``).

The query's sign bits are ``np.packbits(x > 0)``, as the documents' (the convention of sentence-transformers'
``quantize_embeddings``); a document's candidate rank is its Hamming distance to the query, ties by ascending id. The
scan (``scan=``) is one of

* ``"faiss"`` (the default, the fastest measured: ``experiments/results/bench_binary.md``): FAISS's popcount kernel
  (:func:`faiss.knn_hamming`, the kernel of ``IndexBinaryFlat``) run on the memory-mapped codes, all queries of a
  batch per block of codes; its heap keeps the smallest (distance, id) pairs, so ties at the cut go to the smaller
  id;
* ``"numpy"``: ``np.bitwise_count`` of the XOR of 64-bit words, merged block by block
  (:class:`~pyterrier_cpdae.dense.kernels._NumpyTopK`, ties by id);
* ``"torch"``: the +-1 signs' inner products ``dim - 2 hamming`` as int8 products (``torch._int_mm``,
  :func:`.codes.scan`).

All three keep the same candidates. The candidates of a query are read from the float copy in ascending id order
(the memmap's pages in sequence), scored with one float32 product, and ordered by (score, ascending id) with the
near ties re-scored in the position-free arithmetic of :mod:`.ties` (:func:`.ties.settle`): the order is that of
:func:`.ties.reference_scores`, as the float32 index orders its near ties, so duplicates come out in docid order.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from .._checks import check_int, default_num_threads
from .codes import CodePart, scan as product_scan
from .ties import _rescore, settle

#: the default ``rescore_multiplier``: candidates rescored per result (sentence-transformers' option name)
DEFAULT_RESCORE_MULTIPLIER = 4
#: the Hamming scans, the default first
SCANS = ("faiss", "numpy", "torch")
DEFAULT_SCAN = SCANS[0]
#: candidates read from the float copy per call when rescoring
_READ = 512


def signs(queries: np.ndarray) -> np.ndarray:
    """The +-1 int8 signs of float rows (``x > 0``: +1)."""
    return np.where(np.asarray(queries) > 0, 1, -1).astype(np.int8)


def unpack_signs(bits: np.ndarray, dim: int) -> np.ndarray:
    """The +-1 int8 rows ``(b, dim)`` of packed sign bits ``(b, ceil(dim / 8))``."""
    unpacked = np.unpackbits(bits, axis=1, count=dim).view(np.int8)
    return unpacked * np.int8(2) - np.int8(1)


def _words(bits: np.ndarray) -> np.ndarray:
    """Packed bits ``(b, nbytes)`` as 64-bit words ``(b, ceil(nbytes / 8))`` (zero bytes appended: they add no bit
    to a XOR of two padded rows)."""
    b, nbytes = bits.shape
    width = -(-nbytes // 8)
    if nbytes == width * 8 and bits.flags.c_contiguous:
        return bits.view(np.uint64)
    out = np.zeros((b, width * 8), dtype=np.uint8)
    out[:, :nbytes] = bits
    return out.view(np.uint64)


def _faiss_scan(codes: np.ndarray, bits: np.ndarray, width: int, threads: int) -> Tuple[np.ndarray, np.ndarray]:
    import faiss

    before = faiss.omp_get_max_threads()  # (OpenMP's setting is the process's: changed only for this call)
    if before != threads:
        faiss.omp_set_num_threads(threads)
    try:
        dist, ids = faiss.knn_hamming(np.ascontiguousarray(bits), np.asarray(codes), width)
    finally:
        if before != threads:
            faiss.omp_set_num_threads(before)
    return -dist.astype(np.float32), ids


def _numpy_scan(codes: np.ndarray, bits: np.ndarray, width: int, block_size: int,
                threads: int) -> Tuple[np.ndarray, np.ndarray]:
    from .kernels import _NumpyTopK

    qw = _words(bits)
    num_q, num_words = qw.shape
    block = max(64, min(block_size, (1 << 22) // max(1, num_q)))  # (q, block) uint64 buffers of at most 32 MB
    xor = np.empty((num_q, block), dtype=np.uint64)
    ones = np.empty((num_q, block), dtype=np.uint8)
    top = _NumpyTopK(num_q, width, threads)
    try:
        for start in range(0, len(codes), block):
            dw = _words(np.asarray(codes[start:start + block]))
            n = len(dw)
            dist = np.zeros((num_q, n), dtype=np.float32)
            for j in range(num_words):
                np.bitwise_xor(qw[:, j:j + 1], dw[None, :, j], out=xor[:, :n])
                np.bitwise_count(xor[:, :n], out=ones[:, :n])
                dist += ones[:, :n]
            np.negative(dist, out=dist)
            top.update(dist, np.arange(start, start + n, dtype=np.int64))
        return top.result()
    finally:
        top.close()


def nearest(parts: Sequence[CodePart], bits: np.ndarray, width: int, *, scan: str = DEFAULT_SCAN, dim: int,
            block_size: int = 16384, threads: Optional[int] = None) -> np.ndarray:
    """Global ids ``(q, min(width, count))`` of each query's ``width`` documents nearest in Hamming distance to its
    packed sign bits ``bits`` ``(q, ceil(dim / 8))``, ties by ascending id (in no particular order along the row)."""
    if scan not in SCANS:
        raise ValueError(f"scan must be 'faiss', 'numpy' or 'torch' for a binary index, got {scan!r}")
    threads = default_num_threads() if threads is None else threads
    keys: List[np.ndarray] = []
    found: List[np.ndarray] = []
    if scan == "torch":  # (ids already global)
        signs_q = unpack_signs(bits, dim)
        for key, ids in product_scan(parts, [signs_q] * len(parts), width, decode=lambda b: unpack_signs(b, dim),
                                     backend="torch", block_size=block_size, threads=threads):
            keys.append(key)
            found.append(ids)
    else:
        for codes, offset, stride in parts:
            kk = min(width, len(codes.codes))
            if kk == 0:
                continue
            if scan == "faiss":
                key, local = _faiss_scan(codes.codes, bits, kk, threads)
            else:
                key, local = _numpy_scan(codes.codes, bits, kk, block_size, threads)
            keys.append(key)
            found.append(local * stride + offset)
    if not found:
        return np.empty((len(bits), 0), dtype=np.int64)
    key, ids = np.concatenate(keys, axis=1), np.concatenate(found, axis=1)
    if ids.shape[1] > width:  # several parts: the width best over all (the order within a part is monotone in id)
        order = np.lexsort((ids, -key), axis=1)[:, :width]
        ids = np.take_along_axis(ids, order, axis=1)
    return ids


def rescore(queries: np.ndarray, candidates: np.ndarray, k: int, vectors_of: Callable[[np.ndarray], np.ndarray],
            max_norm: float, threads: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
    """The top ``k`` ``(scores, ids)`` of each query's ``candidates`` (global ids ``(q, w)``, distinct along a row,
    ``k <= w``) by float32 inner product with the stored vectors, ties by ascending id.

    Each query's candidates are read in ascending id order and scored by one float32 product; the near ties (within
    the float32 product's error bound of each other, :func:`.ties.tolerance` with the largest stored norm
    ``max_norm``) are re-scored by :func:`.ties.reference_scores`, so the order is the reference arithmetic's whatever
    the product's summation order. ``max_norm`` not finite: every candidate is scored in the reference arithmetic."""
    threads = default_num_threads() if threads is None else threads
    num_q, w = candidates.shape
    cand = np.sort(candidates, axis=1)
    if not np.isfinite(max_norm):
        rows = np.repeat(np.arange(num_q), w)
        scores = _rescore(queries, rows, cand.reshape(-1), vectors_of, threads).reshape(cand.shape)
        order = np.lexsort((cand, -scores), axis=1)[:, :k]
        return np.take_along_axis(scores, order, axis=1), np.take_along_axis(cand, order, axis=1)
    scores = np.empty((num_q, w), dtype=np.float32)

    def score(span: Tuple[int, int]) -> None:
        for i in range(*span):  # (rows read a slice at a time: the product reads them back from the cache)
            for a in range(0, w, _READ):
                np.einsum("ij,j->i", vectors_of(cand[i, a:a + _READ]), queries[i], out=scores[i, a:a + _READ])

    workers = max(1, min(threads, num_q, num_q * w // 4096))
    if workers == 1:
        score((0, num_q))
    else:
        cuts = np.linspace(0, num_q, workers + 1).astype(int)
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(score, zip(cuts[:-1], cuts[1:])))
    order = np.lexsort((cand, -scores), axis=1)
    scores = np.take_along_axis(scores, order, axis=1)
    cand = np.take_along_axis(cand, order, axis=1)
    return settle(lambda rows, width: (scores[rows, :width], cand[rows, :width]), vectors_of, queries, k, w,
                  max_norm, threads=threads)


def search(parts: Sequence[CodePart], queries: np.ndarray, k: int, vectors_of: Callable[[np.ndarray], np.ndarray], *,
           rescore_multiplier: int = DEFAULT_RESCORE_MULTIPLIER, backend: Optional[str] = None,
           block_size: int = 16384, query_batch_size: int = 1024, threads: Optional[int] = None,
           prefetch: Optional[Callable[[np.ndarray], object]] = None) -> Tuple[np.ndarray, np.ndarray]:
    """The top ``k`` ``(scores, ids)`` (``(q, min(k, count))``, float32 scores descending, ties by ascending id) of
    the ``k * rescore_multiplier`` documents nearest to each query in Hamming distance, rescored in float32.

    ``backend``: the scan (:data:`SCANS`; ``None``: :data:`DEFAULT_SCAN`). When ``k * rescore_multiplier`` reaches the
    number of documents, every document is rescored (no scan): the float32 index's ranking. ``prefetch`` (the store's, :func:`.format.prefetch_ids`)
    is called with each query batch's candidates before they are read from the float copy."""
    k = check_int(k, "k")
    rescore_multiplier = check_int(rescore_multiplier, "rescore_multiplier")
    block_size = check_int(block_size, "block_size")
    query_batch_size = check_int(query_batch_size, "query_batch_size")
    threads = default_num_threads() if threads is None else check_int(threads, "threads")
    scan = DEFAULT_SCAN if backend is None else backend
    if scan not in SCANS:
        raise ValueError(f"scan must be 'faiss', 'numpy' or 'torch' for a binary index, got {scan!r}")
    count = sum(len(c.codes) for c, _, _ in parts)
    k = min(k, count)
    width = min(count, k * rescore_multiplier)
    num_q, dim = queries.shape
    out_scores = np.empty((num_q, k), dtype=np.float32)
    out_ids = np.empty((num_q, k), dtype=np.int64)
    if k == 0 or num_q == 0:
        return out_scores, out_ids
    max_norm = max(c.max_norm for c, _, _ in parts if len(c.codes))
    every = None
    if width == count:  # every document is rescored: no scan
        every = np.concatenate([np.arange(len(c.codes), dtype=np.int64) * stride + offset
                                for c, offset, stride in parts])
    for qs in range(0, num_q, query_batch_size):
        batch = queries[qs:qs + query_batch_size]
        if every is not None:
            cand = np.broadcast_to(every, (len(batch), count))
        else:
            cand = nearest(parts, np.packbits(batch > 0, axis=1), width, scan=scan, dim=dim, block_size=block_size,
                           threads=threads)
            if prefetch is not None:
                prefetch(cand.reshape(-1))
        out_scores[qs:qs + len(batch)], out_ids[qs:qs + len(batch)] = rescore(batch, cand, k, vectors_of, max_norm,
                                                                             threads)
    return out_scores, out_ids
