"""PyTerrier transformers over a :class:`~pyterrier_cpdae.dense_index.DenseIndex`.

All retrievers take a query frame with ``qid`` and ``query_vec`` and return a result frame with the input
columns plus ``docno``, ``docid`` (the row in the index), ``score`` (inner product) and ``rank`` (from 0,
scores descending).  Create them with the index's factory methods (``index.np_retriever()`` etc.).
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence, Tuple

import numpy as np
import pandas as pd
import pyterrier as pt
import pyterrier_alpha as pta

from . import _index_io as io
from ._batching import check_int
from ._exact_search import sort_results

if TYPE_CHECKING:  # pragma: no cover
    from .dense_index import DenseIndex

RESULT_COLUMNS = ["docno", "docid", "score", "rank"]
_UNCACHEABLE: set = set()  # FAISS cache directories whose "could not write" warning was already given


def _optional_int(value: Any, name: str) -> Optional[int]:
    """``None`` (the default is used) or an integer >= 1 (see :func:`check_int`)."""
    return None if value is None else check_int(value, name)


def query_matrix(inp: pd.DataFrame, dim: int) -> np.ndarray:
    """Stacks the ``query_vec`` column into a float32 ``(q, dim)`` matrix, checking shapes and values."""
    return io.stack_vectors(list(inp["query_vec"]), [str(q) for q in inp["qid"]], dim, what="query_vec",
                            id_name="qid")


def _corrupt_vectors(index: "DenseIndex", which: str) -> ValueError:
    """The error for stored vectors that are not finite (the indexer refuses them: the file was damaged)."""
    return ValueError(f"the stored vectors of {which} are not finite, so {Path(index.path) / io.VECTORS_FILE} is "
                      "corrupt — rebuild the index with indexer(mode='overwrite')")


def check_scores(index: "DenseIndex", scores: np.ndarray, qids: Sequence[Any], docnos: Sequence[str]) -> None:
    """Refuses NaN/infinite scores (the query vectors are checked finite, so a stored vector is corrupt).

    The indexer refuses non-finite vectors, so only a damaged ``vectors.bin`` gets here; without this check a
    NaN score would rank arbitrarily (retrievers) or fail in ``add_ranks`` (scorer).

    Raises:
        ValueError: naming the first (qid, docno) pairs and the index file.
    """
    bad = np.nonzero(~np.isfinite(scores))[0]
    if len(bad):
        pairs = [(qids[i], docnos[i]) for i in bad[:5]]
        raise _corrupt_vectors(index, f"the documents of {len(bad)} NaN/infinite score(s), e.g. (qid, docno) {pairs},")


def result_frame(index: "DenseIndex", inp: pd.DataFrame, scores: np.ndarray, ids: np.ndarray,
                 drop_query_vec: bool = False) -> pd.DataFrame:
    """Builds the standard result frame from per-query ``(scores, ids)`` (ids < 0 are missing results)."""
    valid = ids >= 0
    counts = valid.sum(axis=1)
    flat_ids = ids[valid]
    starts = np.cumsum(counts) - counts
    res = pta.DataFrameBuilder(RESULT_COLUMNS)
    if len(flat_ids):
        columns = {
            "_index": np.repeat(np.arange(len(inp)), counts),
            "docno": index._docnos_of(flat_ids),
            "docid": flat_ids.astype(np.int64),
            "score": scores[valid].astype(np.float32),
            "rank": np.arange(len(flat_ids)) - np.repeat(starts, counts),
        }
        check_scores(index, columns["score"], inp["qid"].to_numpy()[columns["_index"]], columns["docno"])
        if len(flat_ids) == 1:  # DataFrameBuilder treats length-1 arrays as scalars; lists of 1 are fine
            columns = {k: v.tolist() for k, v in columns.items()}
        res.extend(columns)
    if drop_query_vec:
        inp = inp.drop(columns="query_vec")
    return res.to_df(inp)


def empty_result(inp: pd.DataFrame, drop_query_vec: bool = False) -> pd.DataFrame:
    """An empty result frame with the input's columns plus the result columns."""
    if drop_query_vec and "query_vec" in inp.columns:
        inp = inp.drop(columns="query_vec")
    out = pta.DataFrameBuilder(RESULT_COLUMNS).to_df(inp)
    return out.astype({"docno": object, "docid": np.int64, "score": np.float32, "rank": np.int64})


class _VectorRetriever(pt.Transformer):
    """Base of the retrievers: query frame (``qid``, ``query_vec``) in, standard result frame out.

    Subclasses implement :meth:`_search` and :meth:`_params` (their identity, used by ``==``/``hash`` so that
    ``pt.Experiment(..., plan="tree")`` can share equal pipeline prefixes).
    """

    def __init__(self, index: "DenseIndex", *, num_results: int, drop_query_vec: bool):
        self.index = index
        self.num_results = check_int(num_results, "num_results")
        self.drop_query_vec = drop_query_vec

    def _params(self) -> Tuple:
        raise NotImplementedError

    def _search(self, queries: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Top ``num_results`` ``(scores, ids)`` of ``(q, dim)`` float32 queries, sorted by :func:`sort_results`."""
        raise NotImplementedError

    def __eq__(self, other: Any) -> bool:
        return type(other) is type(self) and self._params() == other._params()

    def __hash__(self) -> int:
        return hash((type(self).__name__,) + self._params())

    def fuse_rank_cutoff(self, k: int) -> Optional["_VectorRetriever"]:
        """``retriever % k`` with ``1 <= k < num_results`` becomes this retriever computing only the top ``k``."""
        if isinstance(k, (int, np.integer)) and 1 <= k < self.num_results:
            clone = copy.copy(self)
            clone.num_results = k
            return clone
        return None

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        pta.validate.query_frame(inp, extra_columns=["query_vec"])
        if not len(inp):
            return empty_result(inp, self.drop_query_vec)
        inp = inp.reset_index(drop=True)
        scores, ids = self._search(query_matrix(inp, self.index.dim))
        return result_frame(self.index, inp, scores, ids, self.drop_query_vec)


class ExactRetriever(_VectorRetriever):
    """Exact (brute-force) inner-product retrieval streaming the index from disk.

    ``backend="numpy"`` scores blocks of ``block_size`` rows with a BLAS matmul and merges per-block top-k
    candidates; ``backend="torch"`` streams chunks through ``device`` (CUDA: pinned, asynchronous copies).
    """

    def __init__(self, index: "DenseIndex", *, backend: str = "numpy", num_results: int = 1000,
                 device: Optional[str] = None, block_size: Optional[int] = None,
                 query_batch_size: Optional[int] = None, drop_query_vec: bool = False):
        if backend not in ("numpy", "torch"):
            raise ValueError(f"backend must be 'numpy' or 'torch', got {backend!r}")
        super().__init__(index, num_results=num_results, drop_query_vec=drop_query_vec)
        self.backend = backend
        self.device = None if device is None else str(device)
        self.block_size = _optional_int(block_size, "chunk_size" if backend == "torch" else "block_size")
        self.query_batch_size = _optional_int(query_batch_size, "query_batch_size")

    def _params(self) -> Tuple:
        return (str(self.index.path), self.backend, self.num_results, self.device, self.block_size,
                self.query_batch_size, self.drop_query_vec)

    def __repr__(self) -> str:
        extra = f", device={self.device!r}" if self.backend == "torch" else ""
        return (f"ExactRetriever({str(self.index.path)!r}, backend={self.backend!r}, "
                f"num_results={self.num_results}{extra})")

    def _search(self, queries: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        kwargs: Dict[str, Any] = {}
        if self.query_batch_size:
            kwargs["query_batch_size"] = self.query_batch_size
        if self.backend == "torch":
            kwargs.update(device=self.device, chunk_size=self.block_size)
        elif self.block_size:
            kwargs["block_size"] = self.block_size
        return self.index.search(queries, self.num_results, backend=self.backend, **kwargs)


FAISS_KINDS = ("flat", "hnsw", "ivf")


class FaissRetriever(_VectorRetriever):
    """Approximate (or, for ``flat``, exact) retrieval with a FAISS index cached in ``<index>/faiss/``.

    The FAISS structure is built on first use from the stored vectors (added in blocks) and written to
    ``<index>/faiss/<name>.faiss`` with a ``.json`` fingerprint of the vectors; it is rebuilt when missing or
    when the fingerprint no longer matches the index (stale).  The structure held in memory is checked the same
    way before each search: when the index files have changed since it was loaded (e.g. the index was rebuilt
    with ``mode="overwrite"``) and the fingerprint differs, it is reloaded/rebuilt.  When the cache cannot be
    written (a read-only index, a full disk), a warning is given once per directory and the structure is only
    kept in memory.  With faiss-gpu and a visible GPU, flat and IVF indexes are searched on the GPU (HNSW has no
    GPU implementation in FAISS and stays on the CPU).
    """

    def __init__(self, index: "DenseIndex", kind: str, *, num_results: int = 1000, neighbours: int = 32,
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
        self.n_list = _optional_int(n_list, "n_list")
        self.n_probe = check_int(n_probe, "n_probe")
        self.pq_m = _optional_int(pq_m, "pq_m")
        self.use_gpu = use_gpu
        self.query_batch_size = check_int(query_batch_size, "query_batch_size")
        self._faiss_index = None
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
        meta = self.index.meta()
        vec_path = Path(self.index.path) / io.VECTORS_FILE
        size = vec_path.stat().st_size
        digest = hashlib.sha1()
        with open(vec_path, "rb") as fin:
            digest.update(fin.read(1 << 20))
            fin.seek(max(0, size - (1 << 20)))
            digest.update(fin.read(1 << 20))
        return {"count": meta["count"], "dim": meta["dim"], "dtype": meta["dtype"], "bytes": size,
                "sha1_head_tail": digest.hexdigest()}

    def _files_stamp(self) -> Optional[Tuple]:
        """Cheap identity of the index files (inode, mtime, size of pt_meta.json and vectors.bin); None if absent."""
        stamp = []
        for name in (io.META_FILE, io.VECTORS_FILE):
            try:
                st = (Path(self.index.path) / name).stat()
            except FileNotFoundError:
                return None
            stamp.append((st.st_ino, st.st_mtime_ns, st.st_size))
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
        vectors = self.index.vectors()
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
                raise _corrupt_vectors(self.index, f"docno(s) {self.index._docnos_of(bad[:5]).tolist()}")
            idx.add(rows)
        return idx

    def faiss_index(self):
        """The FAISS index (loaded from the cache, or built and cached); reloaded when the index was rebuilt."""
        stamp = self._files_stamp()
        if self._faiss_index is not None and stamp is not None:
            if stamp == self._loaded[0]:
                return self._faiss_index
            if self._fingerprint() == self._loaded[1]:  # files touched/replaced, same vectors
                self._loaded = (stamp, self._loaded[1])
                return self._faiss_index
        self._faiss_index = self._loaded = None  # not loaded yet, or the index was rebuilt since
        import faiss

        if self.index.meta().get("layout") == "sharded":
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
        if self._on_gpu(faiss):
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
        k = min(self.num_results, len(self.index))
        if self.kind == "hnsw":
            import faiss
            faiss.downcast_index(idx).hnsw.efSearch = max(self.ef_search, k)
        elif self.kind == "ivf":
            import faiss
            try:
                faiss.extract_index_ivf(idx).nprobe = self.n_probe
            except Exception:  # pragma: no cover - GPU IVF
                faiss.GpuParameterSpace().set_index_parameter(idx, "nprobe", self.n_probe)
        scores = np.empty((len(queries), k), dtype=np.float32)
        ids = np.empty((len(queries), k), dtype=np.int64)
        for s in range(0, len(queries), self.query_batch_size):
            scores[s:s + self.query_batch_size], ids[s:s + self.query_batch_size] = idx.search(
                queries[s:s + self.query_batch_size], k)
        return sort_results(scores, ids)  # FAISS leaves the order of equal scores unspecified


class DenseScorer(pt.Transformer):
    """Re-scores a result frame (``qid``, ``docno``, ``query_vec``) with the stored document vectors.

    Unknown docnos raise a ``KeyError`` naming them.  Output: the input with ``docid`` and ``score``
    (inner product) set and ``rank`` recomputed; sorted by qid then rank.  ``num_results`` keeps the top
    ``num_results`` per query.
    """

    def __init__(self, index: "DenseIndex", *, num_results: Optional[int] = None):
        self.index = index
        self.num_results = _optional_int(num_results, "num_results")

    def __repr__(self) -> str:
        return f"DenseScorer({str(self.index.path)!r}, num_results={self.num_results})"

    def __eq__(self, other: Any) -> bool:
        return (isinstance(other, DenseScorer) and str(other.index.path) == str(self.index.path)
                and other.num_results == self.num_results)

    def __hash__(self) -> int:
        return hash((DenseScorer, str(self.index.path), self.num_results))

    def fuse_rank_cutoff(self, k: int) -> Optional[pt.Transformer]:
        """A rank cutoff ``k >= 1`` after the scorer is applied by the scorer itself."""
        if not isinstance(k, (int, np.integer)) or k < 1:
            return None
        if self.num_results is None or k < self.num_results:
            return DenseScorer(self.index, num_results=k)
        return None

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        pta.validate.columns(inp, includes=["qid", "docno", "query_vec"])
        out = inp.drop(columns=["score", "rank", "docid"], errors="ignore").reset_index(drop=True)
        if not len(out):
            return out.assign(docid=pd.Series(dtype=np.int64), score=pd.Series(dtype=np.float32),
                              rank=pd.Series(dtype=np.int64))
        docnos = np.array([io.as_docno(d) for d in out["docno"]], dtype=object)
        ids = self.index._ids_of(docnos)
        unknown = np.nonzero(ids < 0)[0]
        if len(unknown):
            names = list(dict.fromkeys(docnos[unknown].tolist()))
            raise KeyError(f"{len(names)} docno(s) not in the dense index {self.index.path}: {names[:10]}"
                           f"{' ...' if len(names) > 10 else ''}")
        doc_vecs = self.index._vectors_of(ids)
        query_vecs = query_matrix(out, self.index.dim)
        out = out.assign(docid=ids, score=np.einsum("ij,ij->i", query_vecs, doc_vecs).astype(np.float32))
        check_scores(self.index, out["score"].to_numpy(), out["qid"].tolist(), docnos)
        out = pt.model.add_ranks(out)
        out = out.sort_values(["qid", "rank"], kind="stable").reset_index(drop=True)
        if self.num_results is not None:
            out = out[out["rank"] < self.num_results].reset_index(drop=True)
        return out
