"""Search of a binary index (one sign bit a dimension, 32x smaller than float32): a Hamming scan, then float32
rescoring of the best ``k * rescore_multiplier`` from the float copy. Approximate: a document whose sign bits are
far from the query's is never rescored, however high its float32 score (the measured quality is in
``docs/dense_index.md``).

The scan scores a document by ``p . b`` where ``p`` and ``b`` are the +-1 signs of the query and of the document
(``x > 0``: the convention of sentence-transformers' ``quantize_embeddings``): ``p . b = dim - 2 hamming(p, b)``, so
its order is the Hamming order. The products are int8 (``torch._int_mm``) or float32 BLAS products of the signs
(:func:`.codes.scan`), ties by ascending id, so both backends keep the same candidates; the candidates are rescored
with :func:`.ties.reference_scores`' arithmetic and ordered by (score, ascending id), as the float32 index orders
its near ties.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from .._checks import check_int, default_num_threads
from .codes import CodePart, scan
from .ties import _rescore

#: the default ``rescore_multiplier``: candidates rescored per result (sentence-transformers' option name)
DEFAULT_RESCORE_MULTIPLIER = 4


def signs(queries: np.ndarray) -> np.ndarray:
    """The +-1 int8 signs of float rows (``x > 0``: +1)."""
    return np.where(np.asarray(queries) > 0, 1, -1).astype(np.int8)


def unpack_signs(bits: np.ndarray, dim: int) -> np.ndarray:
    """The +-1 int8 rows ``(b, dim)`` of packed sign bits ``(b, ceil(dim / 8))``."""
    unpacked = np.unpackbits(bits, axis=1, count=dim).view(np.int8)
    return unpacked * np.int8(2) - np.int8(1)


def search(parts: Sequence[CodePart], queries: np.ndarray, k: int, vectors_of: Callable[[np.ndarray], np.ndarray], *,
           rescore_multiplier: int = DEFAULT_RESCORE_MULTIPLIER, backend: str = "numpy", block_size: int = 16384,
           query_batch_size: int = 1024, threads: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
    """The top ``k`` ``(scores, ids)`` (``(q, min(k, count))``, float32 scores descending, ties by ascending id) of
    the ``k * rescore_multiplier`` documents nearest to each query in Hamming distance, rescored in float32."""
    k = check_int(k, "k")
    rescore_multiplier = check_int(rescore_multiplier, "rescore_multiplier")
    block_size = check_int(block_size, "block_size")
    query_batch_size = check_int(query_batch_size, "query_batch_size")
    threads = default_num_threads() if threads is None else check_int(threads, "threads")
    count = sum(len(c.codes) for c, _, _ in parts)
    k = min(k, count)
    width = min(count, k * rescore_multiplier)
    num_q, dim = queries.shape
    out_scores = np.empty((num_q, k), dtype=np.float32)
    out_ids = np.empty((num_q, k), dtype=np.int64)
    if k == 0 or num_q == 0:
        return out_scores, out_ids
    for qs in range(0, num_q, query_batch_size):
        batch = queries[qs:qs + query_batch_size]
        p = signs(batch)
        found = scan(parts, [p] * len(parts), width, decode=lambda bits: unpack_signs(bits, dim), backend=backend,
                     block_size=block_size, threads=threads)
        dots = np.concatenate([f[0] for f in found], axis=1)
        ids = np.concatenate([f[1] for f in found], axis=1)
        if dots.shape[1] > width:  # several parts: the width best over all (ties by id)
            order = np.lexsort((ids, -dots), axis=1)[:, :width]
            ids = np.take_along_axis(ids, order, axis=1)
        rows = np.repeat(np.arange(len(batch)), ids.shape[1])
        ref = _rescore(batch, rows, ids.reshape(-1), vectors_of, threads).reshape(ids.shape)
        order = np.lexsort((ids, -ref), axis=1)[:, :k]
        out_scores[qs:qs + len(batch)] = np.take_along_axis(ref, order, axis=1)
        out_ids[qs:qs + len(batch)] = np.take_along_axis(ids, order, axis=1)
    return out_scores, out_ids
