"""FAISS retrieval over a :class:`~pyterrier_cpdae.dense.DenseIndex`, attached as its
``faiss_flat_retriever``, ``faiss_hnsw_retriever`` and ``faiss_ivf_retriever`` factories (pyterrier-dr's
``faiss_retr`` style).  ``faiss`` is imported only when a FAISS structure is first built or loaded.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import uuid
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import numpy as np

from .._checks import check_int
from . import format as io
from .index import DenseIndex
from .kernels import sort_results
from .retrieval import VectorRetriever, corrupt_vectors, optional_int
from .store import build_id
from .ties import settle

__all__ = ["FaissRetriever", "FAISS_KINDS"]

_UNCACHEABLE: set = set()  # FAISS cache directories whose "could not write" warning was already given

FAISS_KINDS = ("flat", "hnsw", "ivf")
#: FAISS's GPU k-selection returns at most this many results per query (``GPU_MAX_SELECTION_K`` in faiss/gpu)
FAISS_GPU_MAX_K = 2048


class FaissRetriever(VectorRetriever):
    """Approximate (or, for ``flat``, exact) retrieval with a FAISS index cached in ``<index>/faiss/``.

    The FAISS structure is built on first use from the stored vectors (added in blocks) and written to
    ``<index>/faiss/<name>.faiss`` with a ``.json`` fingerprint of the vectors (the index's ``build_id``, which
    every build, rebuild and merge renews); it is rebuilt when missing or when the fingerprint no longer matches
    the index (stale).  The structure held in memory is checked the same way before each search (a ``stat`` of
    the files and a read of ``pt_meta.json``'s build id): when the index was rebuilt since it was loaded (e.g.
    with ``mode="overwrite"``, even to vectors that agree in their first and last MiB), it is reloaded/rebuilt;
    a search while a rebuild is under way is refused, naming the process that builds it.  When the cache cannot be
    written (a read-only index, a full disk), a warning is given once per directory and the structure is only
    kept in memory.  With faiss-gpu and a visible GPU, flat and IVF indexes are searched on the GPU (HNSW has no
    GPU implementation in FAISS and stays on the CPU).
    """

    def __init__(self, index: DenseIndex, kind: str, *, num_results: int = 1000, neighbours: int = 32,
                 ef_construction: int = 40, ef_search: int = 128, n_list: Optional[int] = None,
                 n_probe: int = 16, pq_m: Optional[int] = None, use_gpu: Optional[bool] = None,
                 query_batch_size: int = 4096, drop_query_vec: bool = False):
        if kind not in FAISS_KINDS:
            raise ValueError(f"kind must be one of {FAISS_KINDS}, got {kind!r}")
        super().__init__(index, num_results=num_results, drop_query_vec=drop_query_vec)
        self.kind = kind
        self.neighbours = check_int(neighbours, "neighbours")
        self.ef_construction = check_int(ef_construction, "ef_construction")
        self.ef_search = check_int(ef_search, "ef_search")
        self.n_list = optional_int(n_list, "n_list")
        self.n_probe = check_int(n_probe, "n_probe")
        self.pq_m = optional_int(pq_m, "pq_m")
        self.use_gpu = use_gpu
        self.query_batch_size = check_int(query_batch_size, "query_batch_size")
        self._faiss_index = None
        self._faiss_on_gpu = False  # whether the loaded FAISS index lives on the GPU
        self._loaded: Optional[Tuple[Any, Dict[str, Any]]] = None  # (files stamp, fingerprint) of _faiss_index

    # -- identity --------------------------------------------------------------------------------------
    def _build_params(self) -> Dict[str, Any]:
        if self.kind == "hnsw":
            return {"neighbours": self.neighbours, "ef_construction": self.ef_construction}
        if self.kind == "ivf":
            return {"n_list": self.n_list, "pq_m": self.pq_m}
        return {}

    def _params(self) -> Tuple:
        return (str(self.index.path), self.kind, self.num_results, self.neighbours, self.ef_construction,
                self.ef_search, self.n_list, self.n_probe, self.pq_m, self.use_gpu, self.drop_query_vec)

    def __repr__(self) -> str:
        search = {"hnsw": f", ef_search={self.ef_search}", "ivf": f", n_probe={self.n_probe}"}.get(self.kind, "")
        build = "".join(f", {k}={v!r}" for k, v in self._build_params().items())
        return f"FaissRetriever({str(self.index.path)!r}, {self.kind!r}{build}{search}, num_results={self.num_results})"

    # -- building / caching ----------------------------------------------------------------------------
    def cache_name(self) -> str:
        """File stem of the cached FAISS structure, derived from the build parameters."""
        parts = [self.kind] + [f"{k}{v}" for k, v in self._build_params().items() if v is not None]
        return "_".join(parts)

    def _fingerprint(self) -> Dict[str, Any]:
        """What identifies the stored vectors: the index's ``build_id`` (new at every build, rebuild or merge) and
        the inode of ``vectors.bin`` (a cache carried in from elsewhere, e.g. a crafted package, whose fingerprint
        copies the ``build_id``, names another file, so the structure is rebuilt from these vectors).

        Indexes written before build ids fall back to a sample of ``vectors.bin`` (its first and last MiB).
        """
        meta = self.index.store.meta()
        vec_path = Path(self.index.path) / io.VECTORS_FILE
        st = vec_path.stat()
        size = st.st_size
        fingerprint = {"count": meta["count"], "dim": meta["dim"], "dtype": meta["dtype"], "bytes": size,
                       "inode": st.st_ino}
        if isinstance(meta.get("build_id"), str):
            fingerprint["build_id"] = meta["build_id"]
            return fingerprint
        digest = hashlib.sha1()
        with open(vec_path, "rb") as fin:
            digest.update(fin.read(1 << 20))
            fin.seek(max(0, size - (1 << 20)))
            digest.update(fin.read(1 << 20))
        fingerprint["sha1_head_tail"] = digest.hexdigest()
        return fingerprint

    def _files_stamp(self) -> Optional[Tuple]:
        """Cheap identity of the build (inode, mtime, size of pt_meta.json and vectors.bin, and the build_id in
        pt_meta.json); None if absent.  Read before every search."""
        stamp: list = []
        for name in (io.META_FILE, io.VECTORS_FILE):
            try:
                st = (Path(self.index.path) / name).stat()
            except FileNotFoundError:
                return None
            stamp.append((st.st_ino, st.st_mtime_ns, st.st_size))
        stamp.append(build_id(Path(self.index.path)))
        return tuple(stamp)

    def _make(self, faiss, dim: int, count: int):
        metric = faiss.METRIC_INNER_PRODUCT
        if self.kind == "flat":
            return faiss.IndexFlatIP(dim), 0
        if self.kind == "hnsw":
            idx = faiss.IndexHNSWFlat(dim, self.neighbours, metric)
            idx.hnsw.efConstruction = self.ef_construction
            return idx, 0
        n_list = self.n_list or max(1, min(int(4 * math.sqrt(count)), count // 39 or 1))
        if n_list > count:
            raise ValueError(f"n_list={n_list} exceeds the number of indexed vectors ({count})")
        quantizer = faiss.IndexFlatIP(dim)
        if self.pq_m:
            if dim % self.pq_m:
                raise ValueError(f"pq_m={self.pq_m} must divide the vector dimension {dim}")
            if count < 256:
                raise ValueError(f"IVF-PQ needs at least 256 vectors to train 8-bit codebooks, the index has {count}")
            idx = faiss.IndexIVFPQ(quantizer, dim, n_list, self.pq_m, 8, metric)
            n_train = min(count, max(256 * 39, 39 * n_list))
        else:
            idx = faiss.IndexIVFFlat(quantizer, dim, n_list, metric)
            n_train = min(count, 256 * n_list)
        return idx, n_train

    def _build(self, faiss):
        vectors = self.index.store.vectors()
        count, dim = vectors.shape
        idx, n_train = self._make(faiss, dim, count)
        if n_train:
            rng = np.random.default_rng(0)
            sample = np.sort(rng.choice(count, size=n_train, replace=False)) if n_train < count else np.arange(count)
            idx.train(np.ascontiguousarray(vectors[sample], dtype=np.float32))
        block = 65536
        for start in range(0, count, block):
            rows = np.ascontiguousarray(vectors[start:start + block], dtype=np.float32)
            finite = np.isfinite(rows).all(axis=1)
            if not finite.all():  # FAISS would silently never return these rows: refuse, as the exact search does
                bad = start + np.nonzero(~finite)[0]
                raise corrupt_vectors(self.index, f"docno(s) {self.index.store.docnos_of(bad[:5]).tolist()}")
            idx.add(rows)
        return idx

    def faiss_index(self):
        """The FAISS index (loaded from the cache, or built and cached); reloaded when the index was rebuilt."""
        stamp = self._files_stamp()
        if self._faiss_index is not None and stamp is not None:
            if stamp == self._loaded[0]:
                return self._faiss_index
            if stamp[-1] is not None and self._fingerprint() == self._loaded[1]:  # files touched, same build
                self._loaded = (stamp, self._loaded[1])
                return self._faiss_index
        self._faiss_index = self._loaded = None  # not loaded yet, or the index was rebuilt since
        import faiss

        if self.index.store.meta().get("layout") == "sharded":
            raise ValueError(f"FAISS retrievers need a single index; {self.index.path} is a sharded view — run "
                             "index.merge_shards() first (exact retrievers search shard views directly)")
        cache_dir = Path(self.index.path) / io.FAISS_DIR
        name = self.cache_name()
        idx_path, info_path = cache_dir / f"{name}.faiss", cache_dir / f"{name}.json"
        fingerprint = self._fingerprint()
        idx = None
        if idx_path.exists() and info_path.exists():
            try:
                with open(info_path, encoding="utf8") as fin:
                    info = json.load(fin)
                if info.get("fingerprint") == fingerprint and info.get("params") == self._build_params():
                    idx = faiss.read_index(str(idx_path))
            except (OSError, ValueError, RuntimeError):
                idx = None  # unreadable cache (corrupt, or no read permission): rebuild
        if idx is None:
            idx = self._build(faiss)
            self._write_cache(faiss, idx, idx_path, info_path, fingerprint)
        self._faiss_on_gpu = self._on_gpu(faiss)
        if self._faiss_on_gpu:
            idx = faiss.index_cpu_to_all_gpus(idx)
        self._faiss_index, self._loaded = idx, (stamp, fingerprint)
        return idx

    def _write_cache(self, faiss, idx, idx_path: Path, info_path: Path, fingerprint: Dict[str, Any]) -> None:
        """Writes the FAISS structure and its fingerprint to the cache; a failure warns (once) and does not raise.

        A read-only index directory (or a full disk) must not block search: the structure is then only kept in
        this retriever's memory, and every new retriever builds it again.
        """
        tmp = idx_path.with_name(f"{idx_path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            idx_path.parent.mkdir(exist_ok=True)
            faiss.write_index(idx, str(tmp))  # RuntimeError when the file cannot be opened for writing
            os.replace(tmp, idx_path)
            io.write_json_atomic(info_path, {"params": self._build_params(), "fingerprint": fingerprint})
        except (OSError, RuntimeError) as ex:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            if str(idx_path.parent) not in _UNCACHEABLE:
                _UNCACHEABLE.add(str(idx_path.parent))
                warnings.warn(f"could not cache the FAISS index in {idx_path.parent} ({ex}); searching with the copy "
                              "in memory, which every new retriever builds again — make the directory writable "
                              "to keep it", RuntimeWarning, stacklevel=2)

    def _on_gpu(self, faiss) -> bool:
        """Whether to search on the GPU: with ``use_gpu=None``, exactly when faiss-gpu sees a GPU (not HNSW).

        Raises:
            ValueError: ``use_gpu=True`` for HNSW, or without faiss-gpu / a visible GPU.
        """
        num_gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
        if self.use_gpu is None:
            return self.kind != "hnsw" and num_gpus > 0
        if self.use_gpu and self.kind == "hnsw":
            raise ValueError("FAISS has no GPU HNSW; use use_gpu=False")
        if self.use_gpu and num_gpus == 0:
            raise ValueError("use_gpu=True needs faiss-gpu and a visible GPU, but FAISS sees no GPU "
                             "(pip install 'pyterrier-cpdae[gpu]', or leave use_gpu=None)")
        return bool(self.use_gpu)

    def _search(self, queries: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        idx = self.faiss_index()
        k = min(self.num_results, len(self.index.store))
        # flat: one extra result shows whether equal scores straddle the cut at k (FAISS then keeps an arbitrary
        # subset of them); those queries are answered by the exact numpy kernel, which takes ties by ascending id
        extra = int(self.kind == "flat" and k < len(self.index.store))
        if self._faiss_on_gpu and k + extra > FAISS_GPU_MAX_K:
            if self.kind == "flat":  # the same exact result, by the torch kernel on the device (any k, ties by id)
                return self.index.store.search(queries, k, backend="torch")
            raise ValueError(f"num_results={self.num_results}: FAISS on the GPU returns at most {FAISS_GPU_MAX_K} "
                             f"results per query; use num_results <= {FAISS_GPU_MAX_K} or use_gpu=False")
        if self.kind == "hnsw":
            import faiss
            faiss.downcast_index(idx).hnsw.efSearch = max(self.ef_search, k)
        elif self.kind == "ivf":
            import faiss
            try:
                faiss.extract_index_ivf(idx).nprobe = self.n_probe
            except Exception:  # pragma: no cover - GPU IVF
                faiss.GpuParameterSpace().set_index_parameter(idx, "nprobe", self.n_probe)
        if self.kind == "flat" and k:  # exact: near ties settled position-free, as the other exact kernels (ties.py)
            store = self.index.store
            max_norm = store.max_norm()
            if np.isfinite(max_norm):
                def kernel(rows: np.ndarray, width: int) -> Tuple[np.ndarray, np.ndarray]:
                    if self._faiss_on_gpu and width > FAISS_GPU_MAX_K:
                        return store.search(queries[rows], width, backend="torch")
                    return sort_results(*self._faiss_search(idx, queries[rows], width))

                return settle(kernel, store.vectors_of, queries, k, len(store), max_norm, ties_by_id=False)
        scores, ids = self._faiss_search(idx, queries, k + extra)
        if extra:
            tied = np.nonzero(scores[:, k] == scores[:, k - 1])[0]
            scores, ids = scores[:, :k], ids[:, :k]
            if len(tied):
                scores[tied], ids[tied] = self.index.store.search(queries[tied], k, backend="numpy")
        return sort_results(scores, ids)  # FAISS leaves the order of equal scores unspecified


    def _faiss_search(self, idx: Any, queries: np.ndarray, width: int) -> Tuple[np.ndarray, np.ndarray]:
        """FAISS's top ``width`` of ``queries``, ``query_batch_size`` queries at a time."""
        scores = np.empty((len(queries), width), dtype=np.float32)
        ids = np.empty((len(queries), width), dtype=np.int64)
        for s in range(0, len(queries), self.query_batch_size):
            scores[s:s + self.query_batch_size], ids[s:s + self.query_batch_size] = idx.search(
                queries[s:s + self.query_batch_size], width)
        return scores, ids


# -- factories attached to DenseIndex ---------------------------------------------------------------------------
def _faiss_flat_retriever(self: DenseIndex, num_results: int = 1000, **kwargs: Any) -> FaissRetriever:
    """Exact FAISS ``IndexFlatIP`` retrieval (GPU with faiss-gpu)."""
    return FaissRetriever(self, "flat", num_results=num_results, **kwargs)


def _faiss_hnsw_retriever(self: DenseIndex, num_results: int = 1000, neighbours: int = 32, ef_construction: int = 40,
                          ef_search: int = 128, **kwargs: Any) -> FaissRetriever:
    """Approximate FAISS HNSW retrieval (``efSearch`` is raised to ``num_results`` when smaller)."""
    return FaissRetriever(self, "hnsw", num_results=num_results, neighbours=neighbours,
                          ef_construction=ef_construction, ef_search=ef_search, **kwargs)


def _faiss_ivf_retriever(self: DenseIndex, num_results: int = 1000, n_list: Optional[int] = None, n_probe: int = 16,
                         pq_m: Optional[int] = None, **kwargs: Any) -> FaissRetriever:
    """Approximate FAISS IVF retrieval (``IndexIVFFlat``, or ``IndexIVFPQ`` with ``pq_m`` sub-quantisers).

    ``n_list`` defaults to ``4 * sqrt(len(index))`` (at most ``len(index) // 39``).
    """
    return FaissRetriever(self, "ivf", num_results=num_results, n_list=n_list, n_probe=n_probe, pq_m=pq_m, **kwargs)


DenseIndex.faiss_flat_retriever = _faiss_flat_retriever
DenseIndex.faiss_hnsw_retriever = _faiss_hnsw_retriever
DenseIndex.faiss_ivf_retriever = _faiss_ivf_retriever
