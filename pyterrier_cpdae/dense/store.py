"""The low-level store of a dense index: one directory opened, checked, read and searched.

:class:`DenseStore` is what the indexer (:mod:`~pyterrier_cpdae.dense.indexing`), the retrievers (:mod:`~pyterrier_cpdae.dense.exact_retr`,
:mod:`~pyterrier_cpdae.dense.faiss_retr`) and
:class:`~pyterrier_cpdae.dense.DenseIndex` all build on; it depends only on the file format (:mod:`~pyterrier_cpdae.dense.format`)
and the search kernels (:mod:`~pyterrier_cpdae.dense.kernels`), never on them.  A directory is either a *single* index or a *sharded view*
(``<path>/shards/<i>``, see :meth:`DenseIndex.indexer`), which the store presents as one index: the global document
id (``docid``) of row ``r`` of shard ``s`` of ``n`` is ``r * n + s``, the row of the merged index.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from .._artifact import IncompleteIndexError
from .._locking import ConcurrentBuildError, build_lock, describe_holder, holder
from .._checks import check_int
from . import format as io
from .._producers import (DEFAULT_PRODUCER_ADVICE, QUERY_PRODUCER_KEYS, check_producer, check_producers,  # noqa: F401
                        check_query_producer, check_vectors_producer, describe_producer, frame_producer,
                        parse_stamp, producer_column, same_document_producer, stamp)
from .ties import largest_norm, settle
from .kernels import PRECISIONS, Part, _outputs, numpy_search, resolve_device, torch_search  # noqa: F401 (PRECISIONS: for exact_retr)
from . import compressed

#: docnos_of looks each distinct id up once when given more ids than this and than half the documents
_DISTINCT_FROM = 1024

__all__ = ["DenseStore", "pin_on_host", "check_shard_metas", "check_view_meta", "auto_backend", "incomplete_message", "build_id",
           "check_producer", "check_producers", "check_query_producer", "check_shard_set", "check_vectors_producer",
           "frame_producer", "parse_stamp", "producer_column", "same_document_producer", "stamp"]


class DenseStore:
    """Read access to the dense index directory ``path``: ``pt_meta.json``, vectors, docno lookups and exact search.

    Nothing is read until first use; the opened files are cached until ``pt_meta.json`` is replaced (a rebuild:
    checked before every use by its ``build_id``, see :meth:`_stamp`).
    """

    def __init__(self, path: Union[str, Path]):
        self.path = Path(path)
        self._cache: Optional[Tuple[Any, dict, List[Part], list]] = None
        # "device" / "pinned" -> ((build stamp, where), the parts as torch tensors there): see _copy_of_parts;
        # "pinned_refused" -> the build stamp whose page-locked copy the host refused (_pinned_or_pageable)
        self._copies: dict = {}
        self._max_norm: Optional[Tuple[Any, float]] = None  # (build stamp, largest stored norm): see max_norm
        self._codes: Optional[Tuple[Any, list]] = None  # (build stamp, code parts): see code_parts

    def __repr__(self) -> str:
        return f"DenseStore({str(self.path)!r})"

    def __getstate__(self) -> dict:
        """Pickles the path only: the opened memmaps and lookups are reopened (and checked) on first use."""
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])  # (a pickle from before the copies' cache held other keys: the path is enough)

    def meta(self) -> dict:
        """The checked ``pt_meta.json`` (:func:`~pyterrier_cpdae.dense.format.read_meta`).

        Raises:
            IncompleteIndexError: the index is not (completely) built; the message says what to do.
            ValueError: ``pt_meta.json`` is corrupt or describes another artifact.
        """
        meta = io.read_meta(self.path)
        if meta is None:
            raise IncompleteIndexError(incomplete_message(self.path))
        return meta

    def _stamp(self) -> Tuple[Any, ...]:
        """The identity of the build now in the directory: ``pt_meta.json``'s inode, mtime and size, and its
        ``build_id`` (new at every build's commit), so that a rebuild is noticed even when a file system
        reuses the inode and its timestamps are coarse."""
        try:
            st = (self.path / io.META_FILE).stat()
        except FileNotFoundError:
            raise IncompleteIndexError(incomplete_message(self.path)) from None
        return (st.st_ino, st.st_mtime_ns, st.st_size, build_id(self.path))

    def invalidate(self) -> None:
        """Forgets the opened files and any device or pinned copy (they are reopened / reloaded on next use)."""
        self._cache = None
        self._copies = {}
        self._max_norm = None
        self._codes = None

    def device_parts(self, device: Any) -> List[Part]:
        """The index's parts as torch tensors held on ``device`` (stored dtype), loaded on first use and kept for
        the next searches while the build is unchanged (a rebuild is noticed by :meth:`_stamp`, as for the files).
        """
        return self._copy_of_parts("device", self._device_key(device), device, pinned=False)

    def pinned_parts(self) -> List[Part]:
        """The index's parts as page-locked (pinned) host tensors (stored dtype), made on first use and kept for the
        next searches while the build is unchanged: a streamed CUDA search sends chunks from them with no host copy
        (:func:`~pyterrier_cpdae.dense.kernels.torch_search`), at about twice the rate of pageable memory
        (``experiments/results/gpu/h200/fp16_search_compiled_mlm/``). They
        take the vectors' size in locked host memory.

        Raises:
            ValueError: torch cannot lock host memory here (no CUDA).
        """
        return self._copy_of_parts("pinned", self._device_key("cpu"), "cpu", pinned=True)

    def holds_pinned_copy(self) -> bool:
        """Whether :meth:`pinned_parts` of the current build is already made."""
        have = self._copies.get("pinned")
        return have is not None and have[0] == self._device_key("cpu")

    def _pinned_or_pageable(self, parts: List[Part]) -> List[Part]:
        """``pinned=None``'s choice made (:func:`pin_on_host`): :meth:`pinned_parts`, or, when the host refuses to
        lock that much memory, ``parts`` (pageable, staged chunk by chunk) with a warning, once per build: the
        ranking is the same either way, only the copy's speed differs."""
        key = self._device_key("cpu")
        if self._copies.get("pinned_refused") == key:
            return parts
        try:
            return self.pinned_parts()
        except (RuntimeError, ValueError, MemoryError) as e:  # (_copy_of_parts freed any older copy first)
            self._copies["pinned_refused"] = key
            import warnings
            warnings.warn(f"{self.path}: no page-locked host copy of the vectors ({type(e).__name__}: {e}); chunks "
                          "are staged from pageable memory (slower, same ranking); pinned=False skips the attempt",
                          RuntimeWarning, stacklevel=3)
            return parts

    def _copy_of_parts(self, kind: str, key: Tuple[Any, str], device: Any, pinned: bool) -> List[Part]:
        """The cached copy ``kind`` of the parts when it belongs to ``key`` (build stamp, place), else a new one
        (the old one freed first)."""
        have = self._copies.get(kind)
        if have is not None and have[0] == key:
            return have[1]
        self._copies.pop(kind, None)  # free the old copy before making the new one
        parts = [(_to_device(v, device, pinned=pinned), offset, stride) for v, offset, stride in self._cache[2]]
        self._copies[kind] = (key, parts)
        return parts

    def holds_device_copy(self, device: Any) -> bool:
        """Whether :meth:`device_parts` of the current build on ``device`` is already loaded."""
        have = self._copies.get("device")
        return have is not None and have[0] == self._device_key(device)

    def _device_key(self, device: Any) -> Tuple[Any, str]:
        """``(build stamp, device)``: what a device copy of the vectors belongs to."""
        self.open()  # checks the build now in the directory, reopening it after a rebuild
        return self._cache[0], str(resolve_device(device))

    def vector_bytes(self) -> int:
        """Bytes of all stored vectors (what :meth:`device_parts` puts on the device)."""
        return int(sum(np.asarray(v).nbytes for v, _, _ in self.open()[1]))

    def open(self) -> Tuple[dict, List[Part], list]:
        """``(meta, parts, lookups)``: the index's vectors as search parts ``(vectors, offset, stride)`` (one per
        shard) and the ``npids.Lookup`` of each part, all checked against ``pt_meta.json``.

        Finishes the commit of a killed build or merge first when no other process is building there.

        Raises:
            IncompleteIndexError, ValueError, FileNotFoundError: an unbuilt, corrupt or inconsistent index.
        """
        stamp = self._stamp()
        if self._cache is not None and self._cache[0] == stamp:
            return self._cache[1], self._cache[2], self._cache[3]
        meta = self.meta()
        path = self.path
        if meta.get("layout") == "sharded":
            n = int(meta["num_shards"])
            on_disk = len(io.shard_dirs(path))  # bounds everything below by what exists, whatever pt_meta.json says
            if n > on_disk:
                raise ValueError(f"corrupt sharded dense index {path}: {io.META_FILE} says num_shards={n}, but "
                                 f"{path / io.SHARDS_DIR} holds {on_disk} shard director"
                                 f"{'y' if on_disk == 1 else 'ies'}; rebuild the missing shards, or the index with "
                                 "indexer(mode='overwrite')")
            remove_leftovers_if_idle(path)
            dirs = [path / io.SHARDS_DIR / str(s) for s in range(n)]
            for d in dirs:
                remove_leftovers_if_idle(d)
            metas = []
            for s, d in enumerate(dirs):
                m = io.read_meta(d)
                if m is None:
                    raise ValueError(f"corrupt sharded dense index {path}: shard {s} is missing or incomplete")
                metas.append(m)
            check_shard_metas(path, metas)
            check_view_meta(path, meta, metas)
            parts = [(io.open_vectors(d, m), s, n) for s, (d, m) in enumerate(zip(dirs, metas))]
            lookups = [io.open_docnos(d, m) for d, m in zip(dirs, metas)]
        else:
            remove_leftovers_if_idle(path)
            parts = [(io.open_vectors(path, meta), 0, 1)]
            lookups = [io.open_docnos(path, meta)]
        self._cache = (stamp, meta, parts, lookups)
        return meta, parts, lookups

    def code_parts(self) -> list:
        """A compressed index's codes as parts ``(Codes, offset, stride)``, kept while the build is unchanged."""
        meta, parts, _ = self.open()
        if self._codes is None or self._codes[0] != self._cache[0]:
            self._codes = (self._cache[0], compressed.open_code_parts(self.path, meta, parts))
        return self._codes[1]

    def checked_meta(self) -> dict:
        """``pt_meta.json`` once checked against the files on disk (:meth:`open`: vector and docno files, shards).

        What ``len()``, ``dim``, ``dtype`` and ``num_shards`` report, so that they never disagree with a search."""
        return self.open()[0]

    @property
    def dim(self) -> int:
        return int(self.checked_meta()["dim"])

    def __len__(self) -> int:
        return int(self.checked_meta()["count"])

    def _single(self, what: str) -> Tuple[np.ndarray, Any]:
        _, parts, lookups = self.open()
        if len(parts) != 1:
            raise ValueError(f"{self.path} is a sharded view; {what} needs a single index — run merge_shards()")
        return parts[0][0], lookups[0]

    def vectors(self) -> np.ndarray:
        """The stored vectors as a read-only ``np.memmap`` ``(count, dim)`` (single index only)."""
        return self._single("vectors()")[0]

    def docnos(self):
        """The ``npids.Lookup`` of the docnos (single index only)."""
        return self._single("docnos")[1]

    # -- ids, docnos and vectors (single indexes and sharded views) ---------------------------------------
    def docnos_of(self, ids: np.ndarray) -> np.ndarray:
        """Docnos (object array of str) of global document ids.

        When there are more ids than half the documents (e.g. 1,000 results for each of 1,000 queries over 100k
        documents), many repeat, and each distinct id is looked up once: npids' lookup costs ~0.6 us an id, 40% of
        ``np_retriever``'s time for 1,000 queries at k=1000 over 100k x 384."""
        _, parts, lookups = self.open()
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) > max(_DISTINCT_FROM, sum(len(p[0]) for p in parts) // 2):
            distinct, where = np.unique(ids, return_inverse=True)
            return self._docnos_of(distinct, parts, lookups)[where.reshape(-1)]
        return self._docnos_of(ids, parts, lookups)

    @staticmethod
    def _docnos_of(ids: np.ndarray, parts, lookups) -> np.ndarray:
        n = len(parts)
        if n == 1:
            return np.asarray(lookups[0].fwd.lookup(ids), dtype=object)
        out = np.empty(len(ids), dtype=object)
        shard = ids % n
        for s in range(n):
            mask = shard == s
            if mask.any():
                out[mask] = lookups[s].fwd.lookup(ids[mask] // n)
        return out

    def ids_of(self, docnos: Sequence[str]) -> np.ndarray:
        """Global document ids of docnos; -1 for docnos that are not in the index.

        The lookups hold npids' hash inverse (written by ``_index_io.build_docno_lookup``), which compares whole
        docnos, so unknown docnos (``"7"`` where ``"007"`` is stored) never map to a real row.
        """
        _, parts, lookups = self.open()
        keys = np.array([d.encode("utf8") for d in docnos], dtype=object).astype("S") if len(docnos) else np.array([], "S1")
        result = np.full(len(keys), -1, dtype=np.int64)
        n = len(parts)
        for s in range(n):
            todo = result < 0
            if not todo.any():
                break
            local = np.asarray(lookups[s].inv.lookup(keys[todo]), dtype=np.int64)
            ok = (local >= 0) & (local < len(lookups[s]))
            idx = np.nonzero(todo)[0][ok]
            result[idx] = local[ok] * n + s
        return result

    def vectors_of(self, ids: np.ndarray) -> np.ndarray:
        """float32 vectors ``(len(ids), dim)`` of global document ids (all must be valid; ascending ids, as the tie
        settling asks for them, are read without sorting them again; ``np.take``: twice fancy indexing's speed)."""
        meta, parts, _ = self.open()
        ids = np.asarray(ids, dtype=np.int64)
        n = len(parts)
        ascending = bool(np.all(ids[1:] >= ids[:-1]))  # already in the memmap's order: read as they come
        if n == 1 and ascending:
            return np.asarray(np.take(parts[0][0], ids, axis=0), dtype=np.float32)
        out = np.empty((len(ids), int(meta["dim"])), dtype=np.float32)
        if n == 1:  # rows read in ascending order (the memmap's pages in sequence), put back in the asked order
            order = np.argsort(ids, kind="stable")
            out[order] = np.take(parts[0][0], ids[order], axis=0)
            return out
        for s, (vectors, _, _) in enumerate(parts):
            mask = ids % n == s
            if mask.any():
                local = ids[mask] // n
                if ascending:
                    out[mask] = np.take(vectors, local, axis=0)
                    continue
                order = np.argsort(local)  # sorted access pattern for the memmap
                rows = np.empty((len(local), vectors.shape[1]), dtype=np.float32)
                rows[order] = np.take(vectors, local[order], axis=0)
                out[mask] = rows
        return out

    # -- search --------------------------------------------------------------------------------------------
    def search(self, query_vecs: np.ndarray, k: int, *, backend: str = "auto",
               **kwargs: Any) -> Tuple[np.ndarray, np.ndarray]:
        """Exact top-``k`` inner-product search streaming the index in blocks (memory independent of its size).

        Args:
            query_vecs: ``(q, dim)`` query vectors.
            k: results per query (capped at the number of documents).
            backend: ``"numpy"``, ``"torch"`` or ``"auto"`` (torch on CUDA when available, else numpy).
            **kwargs: passed to the kernel (numpy: ``block_size``, ``query_batch_size``; torch: ``device``,
                ``chunk_size``, ``query_batch_size``, ``pin_memory``, ``precision``, ``copy_threads``,
                ``resident``, ``pinned``: stream a streamed index from :meth:`pinned_parts`; ``None``, the
                default: when :func:`pin_on_host` says so, i.e. on CUDA when the vectors fit in a share of the
                available host memory).

        Returns:
            ``(scores, ids)``: float32 and int64 arrays ``(q, min(k, count))``, scores descending (ties: ascending
            id); ids are global document ids (:meth:`docnos_of`).
        """
        meta, parts, _ = self.open()
        query_vecs = np.asarray(query_vecs)
        if query_vecs.dtype.kind not in "biuf":
            raise ValueError(f"query_vecs must hold real numbers, got {io.describe_values(query_vecs)}; nothing is "
                             "coerced (a cast would drop imaginary parts or parse strings)")
        with np.errstate(over="ignore"):  # float64 beyond float32's range: inf, refused by the kernel
            cast = query_vecs.astype(np.float32, copy=False)
        if cast is not query_vecs and cast.ndim == 2:  # too small for float32: refused as the kernel refuses small norms
            io.check_cast_to_zero(query_vecs, cast, "query vector", lambda rows: rows.tolist(), "row")
        query_vecs = cast
        if query_vecs.ndim != 2 or query_vecs.shape[1] != int(meta["dim"]):
            raise ValueError(f"query_vecs must have shape (q, {meta['dim']}), got {query_vecs.shape}")
        if backend == "auto":
            backend = auto_backend()
        if meta["dtype"] in io.COMPRESSED:
            return self._search_codes(meta, query_vecs, k, backend, kwargs)
        kwargs = {key: v for key, v in kwargs.items() if key not in ("rescore_multiplier", "scan")}  # compressed only
        if backend == "numpy":
            kernel = numpy_search
        elif backend == "torch":
            resident = kwargs.pop("resident", None)
            device = resolve_device(kwargs.get("device"))
            if resident is None:
                resident = fits_on_device(self, device)
            pinned = kwargs.pop("pinned", None)
            if resident:
                parts = self.device_parts(device)
            elif pinned:
                parts = self.pinned_parts()
            elif pinned is None and pin_on_host(self, device):
                parts = self._pinned_or_pageable(parts)
            kwargs["device"] = device
            kernel = torch_search
        else:
            raise ValueError(f"backend must be 'auto', 'numpy' or 'torch', got {backend!r}")
        count = int(meta["count"])
        k = check_int(k, "k")
        max_norm = self.max_norm() if count and len(query_vecs) else 0.0
        if not np.isfinite(max_norm) or not count or not len(query_vecs):
            scores, ids = kernel(parts, query_vecs, k, **kwargs)  # (a corrupt vector: named below)
        else:  # near ties re-scored position-free: equal vectors score equal on every backend (ties.py)
            scores, ids = settle(lambda rows, width: kernel(parts, query_vecs[rows], width, **kwargs),
                                 self.vectors_of, query_vecs, min(k, count), count, max_norm,
                                 threads=kwargs.get("threads"))
        self._check_finite(scores, ids)
        return scores, ids

    def _search_codes(self, meta: dict, query_vecs: np.ndarray, k: int, backend: str, kwargs: dict):
        queries, k, _, _ = _outputs(self.open()[1], query_vecs, k)  # :meth:`search` of a compressed index (checks k)
        scores, ids = compressed.search(self.path, meta, self.code_parts(), self.vectors_of, queries, k, backend, kwargs,
                                        prefetch=lambda rows: io.prefetch_ids(self.open()[1], rows))  # (read ahead)
        self._check_finite(scores, ids)
        return scores, ids

    def _check_finite(self, scores: np.ndarray, ids: np.ndarray) -> None:
        """Refuses a result holding a NaN/infinite score: the queries are checked finite, so a stored vector is
        corrupt (the indexer refuses them); named by its docno, as the retrievers do."""
        bad = ~np.isfinite(scores) & (ids >= 0)
        if bad.any():
            docno = self.docnos_of(ids[bad][:1])[0]
            raise ValueError(f"the stored values of document {docno!r} are not finite, so "
                             f"{self.path / io.VECTORS_FILE} is corrupt — rebuild the index with "
                             "indexer(mode='overwrite')")

    def max_norm(self) -> float:
        """The largest norm of a stored vector (one pass over the vectors, kept while the build is unchanged); NaN
        or infinite when a stored vector is not finite."""
        self.open()
        stamp = self._cache[0]
        if self._max_norm is not None and self._max_norm[0] == stamp:
            return self._max_norm[1]
        value = largest_norm([p[0] for p in self._cache[2]])
        self._max_norm = (stamp, value)
        return value


def _empty(shape: Tuple[int, ...], dtype: Any, device: Any, pinned: bool):
    """An uninitialised tensor on ``device``, or in page-locked host memory (``pinned``)."""
    import torch

    if not pinned:
        return torch.empty(shape, dtype=dtype, device=device)
    try:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    except RuntimeError as e:  # a torch without CUDA, or no driver: nothing can lock host memory for a device
        raise ValueError(f"pinned=True: torch cannot lock host memory here ({e}); page-locked copies serve CUDA "
                         "devices only, pass pinned=False") from e


def _to_device(vectors: np.ndarray, device: Any, slice_bytes: int = 64 << 20, pinned: bool = False):
    """A copy of ``vectors`` (e.g. a read-only memmap) as a torch tensor on ``device`` (or in page-locked host
    memory: ``pinned``), moved in slices of about ``slice_bytes`` (no second host copy of the whole index)."""
    import torch

    dtype = torch.from_numpy(np.empty(0, dtype=vectors.dtype)).dtype
    out = _empty(tuple(vectors.shape), dtype, device, pinned)
    step = max(1, slice_bytes // max(1, vectors[:1].nbytes))
    for s in range(0, len(vectors), step):
        out[s:s + step].copy_(torch.from_numpy(np.array(vectors[s:s + step])))
    return out


#: ``resident=None`` keeps the index on a CUDA device when its vectors take at most this share of the free memory
RESIDENT_SHARE = 0.5


def fits_on_device(store: "DenseStore", device: Any) -> bool:
    """The default of ``resident``: on a CUDA device, when the vectors take at most :data:`RESIDENT_SHARE` of its
    free memory (or are already there); on the CPU never (the memmap is streamed, nothing is copied)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return False
    if store.holds_device_copy(device):
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return store.vector_bytes() <= RESIDENT_SHARE * free


#: ``pinned=None`` streams a CUDA search from a page-locked host copy when the vectors take at most this share of
#: the host memory available (``MemAvailable``), leaving the rest to the process and its neighbours
PINNED_SHARE = 0.25


def host_memory_available() -> Optional[int]:
    """Bytes of host memory available to new allocations (Linux ``/proc/meminfo``'s ``MemAvailable``), or None where
    it cannot be read (then nothing is locked by default)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def pin_on_host(store: "DenseStore", device: Any) -> bool:
    """The default of ``pinned`` for a streamed search: on a CUDA device, when the vectors take at most
    :data:`PINNED_SHARE` of the available host memory (or their page-locked copy is made already); never on the
    CPU (torch locks host memory for CUDA only) or where the available memory is unknown. A page-locked copy is sent
    to the device with no host copy per chunk, about twice the rate of pageable memory."""
    import torch

    if torch.device(device).type != "cuda":
        return False
    return store.holds_pinned_copy() or pins_by_default(store.vector_bytes(), device)


def pins_by_default(nbytes: int, device: Any) -> bool:
    """Whether ``nbytes`` of vectors streamed to ``device`` are sent from a page-locked copy by default (the rule of
    :func:`pin_on_host`, for an index not yet opened; ``experiments/gpu/bench_gpu.py`` reports the path it picks)."""
    import torch

    if torch.device(device).type != "cuda":
        return False
    available = host_memory_available()
    return available is not None and nbytes <= PINNED_SHARE * available


def auto_backend() -> str:
    """``"torch"`` when torch sees a CUDA device, else ``"numpy"``."""
    try:
        import torch
        return "torch" if torch.cuda.is_available() else "numpy"
    except ImportError:  # pragma: no cover
        return "numpy"


def incomplete_message(path: Path) -> str:
    """Why the directory ``path`` is not a built dense index, and what to do about it.

    A build (or merge) in progress is reported as such, naming the process that holds the build lock.
    """
    path = Path(path)
    for building in [path] + io.shard_dirs(path):
        info = holder(building)
        if info is not None and not _is_this_process(info):  # the caller's own lock (merge_shards) is no build
            return (f"the dense index at {path} is being built by {describe_holder(info)}"
                    f"{f' (shard {building.name})' if building != path else ''}; wait for that build to finish")
    if (path / io.MERGE_FILE).exists():
        return (f"the dense index at {path} is incomplete (DenseIndex.merge() into it was interrupted); run the "
                "merge again with mode='overwrite'")
    if (path / io.BUILD_FILE).exists():
        return (f"the dense index at {path} is incomplete (indexing was interrupted); resume it with "
                f"`(encoder >> DenseIndex({str(path)!r}).indexer(mode='resume')).index(<the same corpus>)` or "
                "rebuild it with mode='overwrite'")
    shards = io.shard_dirs(path)
    problem = shard_set_problem(path)
    if problem:
        return problem
    if shards:
        status = ", ".join(f"{p.name}: {'built' if (p / io.META_FILE).exists() else 'incomplete'}" for p in shards)
        todo = ("the top-level pt_meta.json is missing (the last shard's build was killed before writing it); "
                "write it by resuming any shard" if all((p / io.META_FILE).exists() for p in shards)
                else "finish the missing shards")
        return (f"the sharded dense index at {path} is incomplete ({status}); {todo} with "
                "indexer(shard=i, num_shards=n, mode='resume')")
    if not path.exists():
        return f"no dense index at {path} (the directory does not exist); build it with index.indexer()"
    return f"no dense index at {path} (no pt_meta.json); build it with index.indexer()"


def build_id(path: Path) -> Optional[str]:
    """The ``build_id`` of the committed ``pt_meta.json`` in ``path`` (cheap: one small read, no checks).

    ``None`` when there is none (an index built before build ids, a file that is not a regular file, or no
    readable JSON object: :meth:`DenseStore.meta` then says what is wrong).
    """
    import json
    import stat

    meta_path = Path(path) / io.META_FILE
    try:
        if not stat.S_ISREG(meta_path.stat().st_mode):
            return None
        with open(meta_path, "rb") as fin:
            meta = json.loads(fin.read(1 << 20))
    except (OSError, ValueError):
        return None
    value = meta.get("build_id") if isinstance(meta, dict) else None
    return value if isinstance(value, str) else None


def remove_leftovers_if_idle(path: Path) -> None:
    """Finishes a commit that a killed build/merge left unfinished, unless another process is building there.

    Best effort: nothing happens when another process holds the build lock or the directory (or its parent,
    where the lock lives) is not writable; the index is complete and searchable either way.
    """
    if not io.has_leftovers(path):
        return
    try:
        with build_lock(path, "dense index"):
            io.remove_leftovers(path)
    except (ConcurrentBuildError, OSError):
        pass


def check_view_meta(base: Path, meta: dict, metas: List[dict]) -> None:
    """Checks the top-level ``pt_meta.json`` of a sharded view against its shards' (count, dim, dtype).

    Raises:
        ValueError: naming both values and how to rewrite the top-level file.
    """
    total = sum(m["count"] for m in metas)
    shards = {"count": total, "dim": metas[0]["dim"], "dtype": metas[0]["dtype"]}
    wrong = {k: (meta[k], v) for k, v in shards.items() if meta[k] != v}
    if wrong:
        said = ", ".join(f"{k}={a!r}" for k, (a, _) in wrong.items())
        held = ", ".join(f"{k}={b!r}" for k, (_, b) in wrong.items())
        raise ValueError(f"corrupt sharded dense index {base}: its {io.META_FILE} says {said}, but its "
                         f"{len(metas)} shards hold {held}; delete {base / io.META_FILE} and rewrite it by resuming "
                         "any shard with indexer(shard=i, num_shards=n, mode='resume')")


def _is_this_process(info: dict) -> bool:
    import os
    import socket
    return info.get("pid") == os.getpid() and info.get("host") in (None, socket.gethostname())


def _copy_of(metas: List[Tuple[int, dict]]) -> Optional[Tuple[int, int]]:
    """``(copy, original)``: the first shard whose build is another shard's (same ``build_id``: copied files)."""
    seen: dict = {}
    for s, m in metas:
        bid = m.get("build_id")
        if bid is not None and bid in seen:
            return s, seen[bid]
        if bid is not None:
            seen.setdefault(bid, s)
    return None


def shard_set_problem(base: Path) -> Optional[str]:
    """What is wrong with the shard directories of ``base``, or ``None``: a shard that ``num_shards`` calls for but
    that is missing or unfinished, a shard that is a copy of another (the same build) or was built as another
    shard number, shards that disagree on ``num_shards``, or built shards whose vectors come from different
    producers (:func:`check_producers`).

    ``num_shards`` is the view's (its top-level ``pt_meta.json``) when it was written, else the one the built shards
    agree on; directories beyond it (left by an earlier build with more shards) are not the view's and are ignored.
    """
    dirs = io.shard_dirs(base)
    if not dirs:
        return None
    try:
        top = io.read_meta(base)
    except ValueError:
        top = None
    n = int(top["num_shards"]) if top is not None and top.get("layout") == "sharded" else None
    metas = []
    for d in dirs:
        if n is not None and int(d.name) >= n:
            continue
        try:
            m = io.read_meta(d)
        except ValueError as e:
            return f"the sharded dense index at {base}: shard {d.name} is corrupt ({e})"
        if m is not None:
            metas.append((int(d.name), m))
    copy = _copy_of(metas)
    if copy:
        return (f"the sharded dense index at {base}: shard {copy[0]} is a copy of shard {copy[1]} (the same build, "
                f"build_id {dict(metas)[copy[0]].get('build_id')}), so shard {copy[0]}'s own documents are missing; "
                f"rebuild shard {copy[0]} with indexer(shard={copy[0]}, "
                f"num_shards={dict(metas)[copy[0]].get('num_shards')}, mode='overwrite')")
    for s, m in metas:
        if m.get("shard") is not None and m.get("shard") != s:
            return (f"the sharded dense index at {base}: the directory of shard {s} holds shard {m.get('shard')} "
                    f"(num_shards={m.get('num_shards')}); it was copied or moved there: rebuild shard {s} with "
                    f"indexer(shard={s}, num_shards={m.get('num_shards')}, mode='overwrite')")
    if n is None:
        counts = sorted({m.get("num_shards") for _, m in metas if m.get("num_shards") is not None})
        if len(counts) > 1:
            shown = ", ".join(f"shard {s}: num_shards={m.get('num_shards')}" for s, m in metas)
            return (f"the sharded dense index at {base}: its shards were built for different numbers of shards "
                    f"({shown}); rebuild them with one num_shards")
        if not counts:
            return None
        n = counts[0]
    present = {int(d.name) for d in dirs}
    built = {s for s, _ in metas}
    missing = [s for s in range(n) if s not in present]
    unfinished = [s for s in range(n) if s in present and s not in built]
    if not (missing or unfinished):
        try:  # every shard built: their vectors must come from one producer (else the view stays unwritten)
            check_producers(base, [(f"shard {s}", m.get("producer")) for s, m in sorted(metas) if s < n])
        except ValueError as e:
            return str(e)
        return None
    parts: List[str] = []
    for shards, what in ((missing, "missing"), (unfinished, "not finished")):
        if shards:
            parts.append(f"shard{'s' if len(shards) > 1 else ''} {', '.join(map(str, shards))} "
                         f"{'are' if len(shards) > 1 else 'is'} {what}")
    todo = "them" if len(missing) + len(unfinished) > 1 else "it"
    return (f"the sharded dense index at {base} (num_shards={n}) is incomplete: {'; '.join(parts)}; build {todo} "
            f"with indexer(shard=i, num_shards={n}, mode='resume')")


def check_shard_set(base: Path) -> None:
    """Raises the :func:`shard_set_problem` of ``base`` as a ``ValueError`` (nothing when the set is sound)."""
    problem = shard_set_problem(base)
    if problem:
        raise ValueError(problem)


def check_shard_metas(base: Path, metas: List[dict]) -> None:
    """Checks that shard metadata is consistent with a round-robin split into ``len(metas)`` shards.

    Raises:
        ValueError: naming the inconsistent shard (a copy of another shard as such).
    """
    n = len(metas)
    copy = _copy_of(list(enumerate(metas)))
    if copy:
        raise ValueError(f"inconsistent shards in {base}: shard {copy[0]} is a copy of shard {copy[1]} (the same "
                         f"build, build_id {metas[copy[0]].get('build_id')}); rebuild shard {copy[0]} with "
                         f"indexer(shard={copy[0]}, num_shards={n}, mode='overwrite')")
    for s, m in enumerate(metas):
        if m.get("num_shards") != n or m.get("shard") != s:
            raise ValueError(f"inconsistent shards in {base}: shard {s} was built with shard={m.get('shard')}, "
                             f"num_shards={m.get('num_shards')}, expected num_shards={n}")
        if m["dim"] != metas[0]["dim"] or m["dtype"] != metas[0]["dtype"]:
            raise ValueError(f"inconsistent shards in {base}: shard {s} has dim={m['dim']}, dtype={m['dtype']} but "
                             f"shard 0 has dim={metas[0]['dim']}, dtype={metas[0]['dtype']}")
    total = sum(m["count"] for m in metas)
    expected = [(total - s + n - 1) // n for s in range(n)]
    counts = [m["count"] for m in metas]
    if counts != expected:
        raise ValueError(f"inconsistent shards in {base}: shard sizes {counts} do not match a round-robin split of "
                         f"{total} documents ({expected}); were all shards fed the same input?")
