"""Exact (brute-force) maximum-inner-product search kernels that stream an index from disk.

Both kernels visit the stored vectors block by block, so their memory use is bounded by the block size
and ``num_queries x k`` -- never by the corpus size.  An index is given as a list of *parts*
``(vectors, offset, stride)``: row ``r`` of ``vectors`` has the global document id ``r * stride + offset``
(a single index is one part with offset 0 and stride 1; a view over ``n`` round-robin shards has one
part per shard ``s`` with offset ``s`` and stride ``n``).
"""
from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence, Tuple

import numpy as np

from .._checks import check_int, check_norms, default_num_threads
from .staging import MAX_COPY_THREADS, _ChunkStager, _held, resolve_device  # noqa: F401 (re-exported)

Part = Tuple[np.ndarray, int, int]


def _total(parts: Sequence[Part]) -> int:
    return sum(len(p[0]) for p in parts)


def sort_results(scores: np.ndarray, ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Sorts each row of ``(scores, ids)`` by descending score, ties by ascending id.

    All backends (numpy, torch, FAISS) order their results with this function, so that documents with equal
    scores (e.g. duplicate texts) come out in the same order whichever backend found them.
    """
    scores = np.asarray(scores, dtype=np.float32)
    if not scores.size:
        return scores, ids
    order = np.lexsort((ids, -scores), axis=1)
    return np.take_along_axis(scores, order, axis=1), np.take_along_axis(ids, order, axis=1)


def _outputs(parts: Sequence[Part], queries: np.ndarray, k: int) -> Tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    """Shared set-up of the kernels: checked float32 queries, ``k`` capped at the index size, empty outputs.

    Raises:
        ValueError: ``k`` is not an integer >= 1, a query row holds NaN/infinite values (its scores would be
            NaN and its ranking arbitrary), or its norm exceeds ``MAX_NORM`` (its scores could overflow).
    """
    k = check_int(k, "k")
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    if queries.ndim == 2 and not np.isfinite(queries).all():
        bad = np.nonzero(~np.isfinite(queries).all(axis=1))[0]
        raise ValueError(f"query vector(s) at row(s) {bad[:10].tolist()} contain NaN or infinite values")
    if queries.ndim == 2:
        check_norms(queries, "query vector", lambda rows: rows.tolist(), "row")
    k = min(k, _total(parts))
    num_q = queries.shape[0]
    return queries, k, np.empty((num_q, k), dtype=np.float32), np.empty((num_q, k), dtype=np.int64)


#: survivors pooled before a merge, at least (for a small k, a merge per block would cost more than the filter)
_MIN_POOL = 32

#: float32 scores one worker of the fused filter computes and filters at a time: a core's L2 cache (see update_fused).
#: Larger tiles measured no faster and smaller ones slower, their BLAS products too narrow
#: (experiments/results/bench_search_bound.md)
_TILE_SCORE_BYTES = 2 << 20

#: the fused path runs for query batches whose block of scores takes at least this (at 16,384-row blocks: from 128
#: queries on); below, and with one worker, one BLAS-threaded product per block measured as fast or faster
#: (experiments/results/bench_search_bound.md)
_FUSED_MIN_SCORE_BYTES = 8 << 20

#: the fused path's first block (scored whole, to set the running threshold) has 16 x k rows, at least this many
#: (and at most block_size): a shorter first block sets the threshold sooner, measured faster at k = 10 and 100
_FIRST_BLOCK_ROWS = 4096

#: the id of padding entries: it loses every tie, so padding never displaces a real document of equal score
_PAD_ID = np.iinfo(np.int64).max


def _top_k(scores: np.ndarray, ids: np.ndarray, k: int) -> np.ndarray:
    """Flat indexes ``(q, k)`` into ``scores`` of each row's ``k`` best entries by (descending score, ascending id).

    The set is exact even when equal scores straddle the cut: ``argpartition`` picks the ``k``-th best score
    ``t`` of each row; a row with more than ``k`` entries ``>= t`` has a tie at the cut, and for those (rare)
    rows the entries equal to ``t`` are taken by ascending id.  Costs one comparison pass over ``scores``
    besides the ``argpartition``.

    Args:
        scores: ``(q, w)`` float32, ``w > k``.
        ids: ``(q, w)`` document ids, or ``(w,)`` ids shared by all rows and ascending along the row.
        k: how many to keep, ``>= 1``.
    """
    q, w = scores.shape
    cut = w - k
    part = np.argpartition(scores, cut, axis=1)
    base = (np.arange(q) * w)[:, None]
    flat = part[:, cut:] + base  # flat indexes: much faster than take_along_axis
    kth = scores.ravel()[part[:, cut] + base[:, 0]][:, None]
    tied = np.nonzero(np.count_nonzero(scores >= kth, axis=1) > k)[0]
    if len(tied):
        sub, kth = scores[tied], kth[tied]
        if ids.ndim == 1:  # ascending along the row: the first (by column) of the tied entries have the smallest ids
            above = sub > kth
            equal = sub == kth
            need = k - np.count_nonzero(above, axis=1)
            chosen = above | (equal & (np.cumsum(equal, axis=1) <= need[:, None]))
            cols = np.nonzero(chosen)[1].reshape(len(tied), k)
        else:
            cols = np.lexsort((ids[tied], -sub), axis=1)[:, :k]
        flat[tied] = cols + base[tied]
    return flat


class _NumpyTopK:
    """Running top-k (largest scores, ties: smallest ids) per query, updated block by block.

    Once ``k`` candidates are known for every query, a block is filtered against each query's current k-th best
    score first (``>=``: an entry equal to it may still win the tie by a smaller id, which happens when shards
    interleave their ids), so only the (few) entries that can still enter the top-k are kept. The filter is one
    comparison pass and one ``flatnonzero`` pass over the block's scores, split over ``threads`` row ranges run in
    parallel (numpy releases the GIL in both): on 2 cores this measures the same as one thread, on many it keeps the
    single-threaded filter from outgrowing the threaded matmul. Survivors are pooled and merged into the top-k only
    once the pool is about ``max(k, 32)`` wide: until then the threshold is a little stale, which costs a few more
    survivors, never a wrong result (the k-th best score only rises, so an old threshold lets through a superset).
    """

    def __init__(self, num_queries: int, k: int, threads: int = 1):
        self.k = k
        self.num_queries = num_queries
        self.scores = np.empty((num_queries, 0), dtype=np.float32)
        self.ids = np.empty((num_queries, 0), dtype=np.int64)
        self.threshold: Optional[np.ndarray] = None
        self.pool: list = []  # (scores, ids) pairs, (q, m) each, not yet merged
        self.pool_width = 0
        self.workers = max(1, int(threads))  # update_fused splits a block's documents over this many
        self.threads = min(self.workers, num_queries)  # the filter of update splits the queries
        self.executor = ThreadPoolExecutor(self.workers) if self.workers > 1 else None
        self.local = threading.local()  # update_fused's per-worker tile buffers
        bounds = np.linspace(0, num_queries, self.threads + 1).astype(int)
        self.row_ranges = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None

    def _merge(self, scores: np.ndarray, ids: np.ndarray) -> None:
        scores = np.concatenate([self.scores, scores], axis=1)
        ids = np.concatenate([self.ids, ids], axis=1)
        if scores.shape[1] > self.k:
            keep = _top_k(scores, ids, self.k)
            scores = scores.ravel()[keep]
            ids = ids.ravel()[keep]
        self.scores, self.ids = scores, ids
        if self.scores.shape[1] == self.k:
            self.threshold = self.scores.min(axis=1)

    def _flush(self) -> None:
        if self.pool:
            scores = np.concatenate([p[0] for p in self.pool], axis=1)
            ids = np.concatenate([p[1] for p in self.pool], axis=1)
            self.pool, self.pool_width = [], 0
            self._merge(scores, ids)

    def _survivors(self, block_scores: np.ndarray) -> np.ndarray:
        """Flat indexes into ``block_scores`` of the entries ``>=`` their row's threshold, in row-major order."""
        b = block_scores.shape[1]

        def rows(span):
            lo, hi = span
            part = block_scores[lo:hi]
            return np.flatnonzero(part >= self.threshold[lo:hi, None]) + lo * b

        if self.executor is None:
            return rows((0, self.num_queries))
        return np.concatenate(list(self.executor.map(rows, self.row_ranges)))

    def _pool(self, rows: np.ndarray, scores: np.ndarray, ids: np.ndarray, limit: Optional[int]) -> bool:
        """Pools a block's survivors (row, score, id each; any order): ``False`` (nothing pooled) when a row holds
        more than ``limit`` of them (then a top-k of the whole block costs less); ``limit=None``: no limit."""
        counts = np.bincount(rows, minlength=self.num_queries)
        m = int(counts.max())
        if limit is not None and m > limit:
            return False
        if len(rows) > 1 and np.any(rows[1:] < rows[:-1]):  # (the tiles of update_fused): grouped by row
            order = np.argsort(rows, kind="stable")
            rows, scores, ids = rows[order], scores[order], ids[order]
        starts = np.cumsum(counts) - counts
        pos = np.arange(len(rows)) - starts[rows]
        cand_scores = np.full((self.num_queries, m), -np.inf, dtype=np.float32)
        cand_ids = np.full((self.num_queries, m), _PAD_ID, dtype=np.int64)
        cand_scores[rows, pos] = scores
        cand_ids[rows, pos] = ids
        self.pool.append((cand_scores, cand_ids))
        self.pool_width += m
        if self.pool_width >= max(self.k, _MIN_POOL):
            self._flush()
        return True

    def update(self, block_scores: np.ndarray, block_ids: np.ndarray) -> None:
        """Adds a block of scores ``(num_queries, b)`` for the documents ``block_ids`` ``(b,)`` (ascending)."""
        q, b = block_scores.shape
        if b == 0:
            return
        if self.threshold is not None:
            flat = self._survivors(block_scores)
            if not len(flat):
                return
            rows, cols = np.divmod(flat, b)
            if self._pool(rows, block_scores.ravel()[flat], block_ids[cols], max(self.k, b // 8)):
                return
        self._flush()
        kk = min(self.k, b)
        if kk < b:
            top = _top_k(block_scores, block_ids, kk)
            self._merge(block_scores.ravel()[top], block_ids[top % b])
        else:
            self._merge(block_scores, np.broadcast_to(block_ids, (q, b)))

    def update_fused(self, queries: np.ndarray, block, block_ids: np.ndarray) -> None:
        """Scores ``queries`` against the document rows ``block`` (``block_ids``, ascending) and adds the survivors of
        the running threshold, which must be known (:attr:`threshold`), without writing the block's score matrix.

        The rows are split over the ``threads`` workers (at least 64 rows each); each scores its rows a tile at a time
        (about ``_TILE_SCORE_BYTES`` of float32 scores, the size of a core's L2 cache; at least 64 rows) with one BLAS
        call and filters the tile at once, while it is still in the cache, upcasting float16 rows tile by tile. The
        BLAS library should run each call on one thread meanwhile (:func:`numpy_search` sees to it): the workers are
        the parallelism.
        """
        b = len(block)
        q = self.num_queries
        tile = max(64, _TILE_SCORE_BYTES // (4 * q))
        threshold = self.threshold[:, None]
        bounds = np.linspace(0, b, min(self.workers, max(1, b // 64)) + 1).astype(int)
        spans = [(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo]

        def work(span):
            lo, hi = span
            found = []
            buffers = getattr(self.local, "buffers", None)  # this worker's, reused: no fresh pages per tile
            if buffers is None or len(buffers[0]) < q * tile:
                buffers = self.local.buffers = (np.empty(q * tile, np.float32), np.empty(q * tile, bool))
            for s in range(lo, hi, tile):
                rows = np.asarray(block[s:min(s + tile, hi)])
                if rows.dtype != np.float32:
                    rows = rows.astype(np.float32)
                n = len(rows)
                scores = np.matmul(queries, rows.T, out=buffers[0][:q * n].reshape(q, n))
                flat = np.flatnonzero(np.greater_equal(scores, threshold, out=buffers[1][:q * n].reshape(q, n)))
                if len(flat):
                    r, c = np.divmod(flat, len(rows))
                    found.append((r, c + s, scores.ravel()[flat]))
            return found

        parts = [f for part in (self.executor.map(work, spans) if self.executor is not None and len(spans) > 1
                                else map(work, spans)) for f in part]
        if not parts:
            return
        rows = np.concatenate([p[0] for p in parts])
        cols = np.concatenate([p[1] for p in parts])
        self._pool(rows, np.concatenate([p[2] for p in parts]), block_ids[cols], None)

    def result(self) -> Tuple[np.ndarray, np.ndarray]:
        """The top-k scores and ids per query, sorted by descending score (ties: ascending id)."""
        self._flush()
        return sort_results(self.scores, self.ids)


#: threadpoolctl's view of the BLAS libraries loaded in this process (made at the first fused search)
_BLAS_CONTROLLER = None
#: the searches holding the BLAS to one thread now, and the limiter that restores it when the last one ends
_BLAS_LOCK = threading.Lock()
_BLAS_HOLD = {"count": 0, "limiter": None}


@contextlib.contextmanager
def _held_blas(controller):
    """Holds the BLAS to one thread per call while any search in this process is inside (reference-counted: searches
    that overlap in threads restore the BLAS's own thread counts only when the last one ends; plain nested
    threadpoolctl limits would let the first to end restore them under the second, and the second then leave the
    whole process on one BLAS thread)."""
    with _BLAS_LOCK:
        if _BLAS_HOLD["count"] == 0:
            _BLAS_HOLD["limiter"] = controller.limit(limits=1, user_api="blas")
        _BLAS_HOLD["count"] += 1
    try:
        yield
    finally:
        with _BLAS_LOCK:
            _BLAS_HOLD["count"] -= 1
            if _BLAS_HOLD["count"] == 0:
                _BLAS_HOLD["limiter"].restore_original_limits()
                _BLAS_HOLD["limiter"] = None


def one_blas_thread():
    """A context manager under which numpy's BLAS runs each call on one thread (threadpoolctl), or ``None`` when no
    BLAS library can be controlled (threadpoolctl missing, or a BLAS it does not know). The limit holds for the whole
    process while any such context is open (other threads' BLAS calls run on one thread meanwhile); the BLAS's thread
    counts are restored when the last one closes."""
    global _BLAS_CONTROLLER
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # pragma: no cover (a dependency)
        return None
    if _BLAS_CONTROLLER is None:
        _BLAS_CONTROLLER = ThreadpoolController()
    if not _BLAS_CONTROLLER.select(user_api="blas").lib_controllers:
        return None
    return _held_blas(_BLAS_CONTROLLER)


def numpy_search(parts: Sequence[Part], queries: np.ndarray, k: int, *,
                 block_size: int = 16384, query_batch_size: int = 1024,
                 threads: Optional[int] = None, fused: bool = True) -> Tuple[np.ndarray, np.ndarray]:
    """Exact top-``k`` inner-product search with numpy, streaming ``block_size`` rows at a time.

    Until each query has ``k`` candidates, a block is scored with one (BLAS-threaded) matmul and its scores filtered
    in ``threads`` row ranges (where the fused path follows, the first block is shorter: 16 x k rows, at least
    4,096). From then on (``fused``, the default, with ``threads > 1`` and batches of at least 128
    queries at the default block size), a block's rows are split over ``threads`` workers that score and filter them
    in tiles small enough for a core's L2 cache (about 2 MiB of scores), the BLAS limited to one thread per call
    meanwhile (:func:`one_blas_thread`): the block's score matrix is never written to memory, and the filter reads its scores from the cache, which measured faster than the unfused path
    (``experiments/results/bench_search_bound.md``).
    Where the BLAS cannot be limited and ``threads > 1``, the unfused path runs throughout. Both paths compute every
    score with a float32 BLAS product of the same query and document rows and return the same rankings (ties by
    ascending id).

    Args:
        parts: the index parts ``(vectors, offset, stride)`` (vectors may be float16 memmaps; each block, or with
            ``fused`` each tile, is upcast to float32 before the BLAS matmul).
        queries: ``(q, dim)`` query vectors.
        k: number of results per query, >= 1 (capped at the number of documents).
        block_size: document rows read per step.
        query_batch_size: queries scored together (bounds the ``q x block_size`` score matrix).
        threads: workers that score (``fused``) or filter the blocks (default: the CPUs this process may use); on the
            unfused path the matmul itself is threaded by the BLAS library.
        fused: score and filter tile by tile once the running threshold is known (``False``: the whole block's
            scores in one matmul, then filtered).

    Returns:
        ``(scores, ids)``, both ``(q, min(k, n))``; scores float32 descending, ids int64 global document ids.
    """
    block_size = check_int(block_size, "block_size")
    query_batch_size = check_int(query_batch_size, "query_batch_size")
    threads = default_num_threads() if threads is None else check_int(threads, "threads")
    queries, k, out_scores, out_ids = _outputs(parts, queries, k)
    if k == 0 or not len(queries):
        return out_scores, out_ids
    buffer = np.empty((min(query_batch_size, len(queries)), block_size), dtype=np.float32)
    for qs in range(0, len(queries), query_batch_size):
        qbatch = queries[qs:qs + query_batch_size]
        # a block's scores small enough for the caches gain nothing from tiles (and few queries' products are
        # memory-bound: one BLAS-threaded call reads a block faster than workers handing tiles around)
        fuse = fused and threads > 1 and len(qbatch) * block_size * 4 >= _FUSED_MIN_SCORE_BYTES
        topk = _NumpyTopK(len(qbatch), k, threads)
        try:
            with contextlib.ExitStack() as limits:
                tiled = False  # scoring tile by tile, the BLAS on one thread per call
                # before the threshold is known a block is scored whole: on the fused path a short one (16 x k rows,
                # at least _FIRST_BLOCK_ROWS) sets it sooner
                first = min(block_size, max(_FIRST_BLOCK_ROWS, 16 * k)) if fuse else block_size
                for vectors, offset, stride in parts:
                    stop = 0
                    while stop < len(vectors):
                        start = stop
                        stop = min(start + (first if topk.threshold is None else block_size), len(vectors))
                        ids = np.arange(start, stop, dtype=np.int64) * stride + offset
                        if fuse and topk.threshold is not None and not tiled:
                            one = one_blas_thread()  # workers side by side: the BLAS on one thread per call
                            if one is not None:
                                limits.enter_context(one)
                            tiled = fuse = one is not None
                        if tiled:
                            topk.update_fused(qbatch, vectors[start:stop], ids)
                            continue
                        block = np.asarray(vectors[start:stop])
                        if block.dtype != np.float32:
                            block = block.astype(np.float32)
                        if len(block) == block_size:  # scores into one reused buffer: no fresh pages per block
                            scores = np.matmul(qbatch, block.T, out=buffer[:len(qbatch)])
                        else:
                            scores = qbatch @ block.T
                        topk.update(scores, ids)
            s, i = topk.result()
        finally:
            topk.close()
        out_scores[qs:qs + len(qbatch)] = s
        out_ids[qs:qs + len(qbatch)] = i
    return out_scores, out_ids


#: bytes of (float32) scores per chunk of an index held on the device with ``precision="fp16"`` (its chunk size)
RESIDENT_FP16_SCORE_BYTES = 4 << 30
#: ``precision`` of :func:`torch_search`
PRECISIONS = ("auto", "fp32", "fp16")


def torch_search(parts: Sequence[Part], queries: np.ndarray, k: int, *, device=None,
                 chunk_size: Optional[int] = None, query_batch_size: int = 4096,
                 pin_memory: Optional[bool] = None, precision: str = "auto",
                 copy_threads: Optional[int] = None, stats: Optional[dict] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Exact top-``k`` inner-product search with torch, streaming the index through ``device`` in chunks.

    On CUDA, chunks are staged through two pinned host buffers and sent on a copy stream that overlaps the scoring
    (see :class:`_ChunkStager`); only two chunks are ever on the GPU, so indexes larger than GPU memory work.  On
    CPU the same code runs without pinning.

    Args:
        parts: the index parts ``(vectors, offset, stride)``: numpy arrays (streamed through the device in chunks),
            page-locked host tensors (``torch.from_numpy(v).pin_memory()``: sent without a host copy) or torch tensors
            already held on ``device`` (:meth:`DenseStore.device_parts`: nothing is copied).
        queries: ``(q, dim)`` query vectors.
        k: number of results per query, >= 1 (capped at the number of documents).
        device: a torch device (default: CUDA when available, else CPU).
        chunk_size: document rows per chunk (default on CUDA: 1 GiB of stored vectors when streamed; for a
            resident index, 4 GiB of scores (``fp16``) or 1 GiB (``fp32``); on CPU
            64 MiB of float32 vectors).
        query_batch_size: queries scored together.
        pin_memory: stage chunks through pinned buffers (default: on CUDA only).
        precision: ``"fp32"`` scores every document in float32; ``"fp16"`` scores from float16 values with
            float32 accumulation and rescores the candidates in float32, with a proof per query that the result is the
            float32 one (:mod:`.certified`; queries it cannot prove are searched again, then in float32): the same
            rankings, several times faster on tensor cores. ``"auto"``: ``fp16`` on CUDA, ``fp32`` elsewhere.
        copy_threads: threads that copy a streamed chunk into its pinned buffer (default: the CPUs, at most 8).
        stats: a dict that receives, with ``fp16``, ``queries``, ``retried`` (searched again with more candidates)
            and ``fp32`` (decided by the float32 kernel) counts.

    Returns:
        ``(scores, ids)`` as for :func:`numpy_search`.
    """
    import torch

    from .certified import full_precision

    dev = resolve_device(device)
    query_batch_size = check_int(query_batch_size, "query_batch_size")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}, got {precision!r}")
    if precision == "auto":
        precision = "fp16" if dev.type == "cuda" else "fp32"
    queries, k, out_scores, out_ids = _outputs(parts, queries, k)
    if k == 0 or not len(queries):
        return out_scores, out_ids
    dim = queries.shape[1]
    resident = all(_held(p[0], dev) for p in parts)
    if chunk_size is None:
        itemsize = max(p[0].element_size() if isinstance(p[0], torch.Tensor) else p[0].dtype.itemsize for p in parts)
        if dev.type != "cuda":
            chunk_size = max(1, (64 << 20) // (4 * dim))
        elif not resident:
            chunk_size = max(1, (1 << 30) // (itemsize * dim))
        else:
            # no copy to stage: a chunk is bounded by its score matrix only; fewer, larger chunks mean fewer merges
            # (1 GiB of scores measured faster than smaller chunks on a GPU:
            # experiments/results/gpu/h200/padded_vs_unpadded/)
            score_bytes = RESIDENT_FP16_SCORE_BYTES if precision == "fp16" else (1 << 30)
            per_row = 4 * min(len(queries), query_batch_size)
            chunk_size = max(1, score_bytes // per_row)
    chunk_size = check_int(chunk_size, "chunk_size")
    stage = _ChunkStager(dev, chunk_size, dim, pinned=dev.type == "cuda" if pin_memory is None else pin_memory,
                         copy_threads=copy_threads)
    try:
        with torch.no_grad(), full_precision():
            for qs in range(0, len(queries), query_batch_size):
                q = torch.from_numpy(queries[qs:qs + query_batch_size]).to(dev)
                if precision == "fp16":
                    best_s, best_i = _certified_search(parts, q, k, stage, stats, resident=resident)
                else:
                    best_s, best_i = _fp32_search(parts, q, k, stage)
                s_np, i_np = sort_results(best_s.cpu().numpy(), best_i.cpu().numpy())
                out_scores[qs:qs + len(q)] = s_np
                out_ids[qs:qs + len(q)] = i_np
    finally:
        stage.close()
    return out_scores, out_ids


def _fp32_search(parts: Sequence[Part], q, k: int, stage: _ChunkStager):
    """Top-``k`` ``(scores, ids)`` of ``q``, every document scored in float32 (ties at a cut resolved again)."""
    best_s, best_i, tied = _torch_batch(parts, q, k, stage, exact_ties=False)
    rows = tied.nonzero().flatten()
    if len(rows):  # equal scores at a cut somewhere: those queries again, resolving ties by id
        fix_s, fix_i, _ = _torch_batch(parts, q[rows], k, stage, exact_ties=True)
        best_s[rows], best_i[rows] = fix_s, fix_i
    return best_s, best_i


#: how many times a query that the float16 path cannot prove is searched again with 4x the candidates
CERTIFY_RETRIES = 1


def _certified_search(parts: Sequence[Part], q, k: int, stage: _ChunkStager, stats: Optional[dict] = None, *,
                      resident: bool):
    """Top-``k`` ``(scores, ids)`` of ``q`` through :class:`.certified.CertifiedTopK`: queries whose cut cannot be
    proved are searched again with 4x the candidates, then in float32 (:func:`_fp32_search`).  ``resident``: every
    part is held on ``q``'s device, so the candidates are rescored in one gather."""
    import torch

    from .certified import CertifiedTopK, candidates_for

    total = _total(parts)
    width = min(candidates_for(k), total)
    rows = torch.arange(len(q), device=q.device)
    best_s = torch.empty((len(q), k), dtype=torch.float32, device=q.device)
    best_i = torch.empty((len(q), k), dtype=torch.int64, device=q.device)
    counts = {"queries": len(q), "retried": 0, "fp32": 0}
    for attempt in range(CERTIFY_RETRIES + 2):
        if not len(rows):
            break
        if attempt == CERTIFY_RETRIES + 1:  # not proved twice: the float32 kernel decides
            counts["fp32"] += len(rows)
            best_s[rows], best_i[rows] = _fp32_search(parts, q[rows], k, stage)
            break
        if attempt:
            counts["retried"] += len(rows)
        top = CertifiedTopK(q[rows], width, deferred=resident)
        for vectors, offset, stride in parts:
            for start, chunk in stage.chunks(vectors):
                top.add(chunk, offset, stride, start)
        if resident:
            top.rescore_parts(parts)
        s, i, ok = top.result(k)
        best_s[rows[ok]], best_i[rows[ok]] = s[ok], i[ok]
        rows = rows[~ok]
        width = min(4 * width, total)
        if not top.provable:  # vectors too long for float16 (or not finite): no retry can prove a cut
            counts["fp32"] += len(rows)
            best_s[rows], best_i[rows] = _fp32_search(parts, q[rows], k, stage)
            break
    if stats is not None:
        for key, value in counts.items():
            stats[key] = stats.get(key, 0) + value
    return best_s, best_i


def _torch_batch(parts: Sequence[Part], q, k: int, stage: _ChunkStager, exact_ties: bool):
    """Top-``k`` ``(scores, ids, tied)`` of the queries ``q`` on their device, unordered, scored in float32.

    With ``exact_ties=False`` (fast: ``topk`` and no host synchronisation per chunk) the result is exact unless
    equal scores straddled a cut (of a chunk, or of a merge): each cut takes one entry more than it keeps, and a
    query whose k-th and (k+1)-th scores are equal there is flagged in ``tied``.  With
    ``exact_ties=True`` each chunk is sorted stably (its columns are in ascending id order, so ties come out by
    ascending id) and merges sort by id, then stably by score: exact for every query, and much slower, so
    :func:`torch_search` runs it only for the flagged queries.
    """
    import torch

    best_s = best_i = None
    tied = torch.zeros(len(q), dtype=torch.bool, device=q.device)
    for vectors, offset, stride in parts:
        for start, chunk in stage.chunks(vectors):
            scores = q @ chunk.float().T
            kk = min(k, scores.shape[1])
            if exact_ties:
                s, i = torch.sort(scores, dim=1, descending=True, stable=True)
                s, i = s[:, :kk], i[:, :kk]
            elif kk < scores.shape[1]:  # one more than needed: equal k-th and (k+1)-th scores flag a tie at the cut
                s, i = scores.topk(kk + 1, dim=1)
                tied |= s[:, kk] == s[:, kk - 1]
                s, i = s[:, :kk], i[:, :kk]
            else:
                s, i = scores.topk(kk, dim=1)
            i = (i.long() + start) * stride + offset
            if best_s is not None:
                s = torch.cat([best_s, s], dim=1)
                i = torch.cat([best_i, i], dim=1)
                if s.shape[1] > k:
                    if exact_ties:
                        by_id = i.argsort(dim=1)
                        s, i = s.gather(1, by_id), i.gather(1, by_id)
                        sel = torch.sort(s, dim=1, descending=True, stable=True)[1][:, :k]
                        s = s.gather(1, sel)
                    else:
                        s, sel = s.topk(k + 1, dim=1)
                        tied |= s[:, k] == s[:, k - 1]
                        s, sel = s[:, :k], sel[:, :k]
                    i = i.gather(1, sel)
            best_s, best_i = s, i
    return best_s, best_i, tied
