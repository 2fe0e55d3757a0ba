"""A resumable, shardable on-disk dense vector index with exact, FAISS and GPU retrieval.

Example::

    from pyterrier_cpdae import CPDAE, DenseIndex

    enc = CPDAE.from_pretrained("path/to/model")
    index = DenseIndex("indexes/vaswani.cpdae")
    (enc >> index.indexer()).index(dataset.get_corpus_iter())
    pipeline = enc >> index.retriever(num_results=100)

See ``_index_io`` for the directory format.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _index_io as io
from ._artifact import PackagedArtifact
from ._exact_search import Part, numpy_search, torch_search
from ._index_io import IncompleteIndexError
from ._indexing import DenseIndexer, check_shard_metas, shard_iter
from .retrievers import DenseScorer, ExactRetriever, FaissRetriever

__all__ = ["DenseIndex", "DenseIndexer", "IncompleteIndexError"]


class DenseIndex(PackagedArtifact):
    """A dense index: float32/float16 vectors on disk plus a docno lookup, as a PyTerrier artifact.

    ``DenseIndex(path)`` never touches the disk; the index is opened (and checked) lazily when first used for
    retrieval.  An index directory is either a *single* index or a *sharded view* (``<path>/shards/<i>``
    built by ``indexer(shard=i, num_shards=n)``), which all retrievers except FAISS search as one index.
    Global document ids (``docid``) of a sharded view equal the rows of the merged index.
    """

    ARTIFACT_TYPE = io.ARTIFACT_TYPE
    ARTIFACT_FORMAT = io.ARTIFACT_FORMAT
    ARTIFACT_PACKAGE_HINT = io.PACKAGE_HINT
    PACKAGE_EXCLUDE = (io.FAISS_DIR,)  # FAISS caches: rebuilt on first use, not shared

    def __init__(self, path: Union[str, Path]):
        super().__init__(path)
        self._cache: Optional[Tuple[Any, dict, List[Part], list]] = None

    def __repr__(self) -> str:
        return f"DenseIndex({str(self.path)!r})"

    # -- state ---------------------------------------------------------------------------------------------
    def built(self) -> bool:
        """Whether the index is completely built (``pt_meta.json`` exists and is valid)."""
        try:
            return io.read_meta(Path(self.path)) is not None
        except ValueError:
            return False

    def _incomplete_message(self) -> str:
        path = Path(self.path)
        if (path / io.MERGE_FILE).exists():
            return (f"the dense index at {path} is incomplete (DenseIndex.merge() into it was interrupted); run the "
                    "merge again with mode='overwrite'")
        if (path / io.BUILD_FILE).exists():
            return (f"the dense index at {path} is incomplete (indexing was interrupted); resume it with "
                    f"`(encoder >> DenseIndex({str(path)!r}).indexer(mode='resume')).index(<the same corpus>)` or "
                    "rebuild it with mode='overwrite'")
        shards = io.shard_dirs(path)
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

    def meta(self) -> dict:
        """The parsed ``pt_meta.json``.

        Raises:
            IncompleteIndexError: when the index is not (completely) built.
            ValueError: when ``pt_meta.json`` is corrupt.
        """
        meta = io.read_meta(Path(self.path))
        if meta is None:
            raise IncompleteIndexError(self._incomplete_message())
        return meta

    def _open(self) -> Tuple[dict, List[Part], list]:
        """Opens (and checks) vectors and docno lookups of all parts; cached until pt_meta.json changes."""
        meta_path = Path(self.path) / io.META_FILE
        try:
            stamp = meta_path.stat().st_mtime_ns
        except FileNotFoundError:
            raise IncompleteIndexError(self._incomplete_message()) from None
        if self._cache is not None and self._cache[0] == stamp:
            return self._cache[1], self._cache[2], self._cache[3]
        meta = self.meta()
        path = Path(self.path)
        _remove_leftovers_if_idle(path)
        if meta.get("layout") == "sharded":
            for s in range(int(meta["num_shards"])):
                _remove_leftovers_if_idle(path / io.SHARDS_DIR / str(s))
        if meta.get("layout") == "sharded":
            n = int(meta["num_shards"])
            metas = []
            for s in range(n):
                m = io.read_meta(path / io.SHARDS_DIR / str(s))
                if m is None:
                    raise ValueError(f"corrupt sharded dense index {path}: shard {s} is missing or incomplete")
                metas.append(m)
            check_shard_metas(path, metas)
            parts = [(io.open_vectors(path / io.SHARDS_DIR / str(s), metas[s]), s, n) for s in range(n)]
            lookups = [io.open_docnos(path / io.SHARDS_DIR / str(s), metas[s]) for s in range(n)]
        else:
            parts = [(io.open_vectors(path, meta), 0, 1)]
            lookups = [io.open_docnos(path, meta)]
        self._cache = (stamp, meta, parts, lookups)
        return meta, parts, lookups

    def __len__(self) -> int:
        return int(self.meta()["count"])

    @property
    def dim(self) -> int:
        """The vector dimension."""
        return int(self.meta()["dim"])

    @property
    def dtype(self) -> str:
        """The storage dtype (``"float32"`` or ``"float16"``)."""
        return str(self.meta()["dtype"])

    @property
    def num_shards(self) -> int:
        """1 for a single index, else the number of shards of the sharded view."""
        meta = self.meta()
        return int(meta["num_shards"]) if meta.get("layout") == "sharded" else 1

    def vectors(self) -> np.memmap:
        """The stored vectors as a read-only ``np.memmap`` of shape ``(len(self), dim)`` (single index only)."""
        meta, parts, _ = self._open()
        if len(parts) != 1:
            raise ValueError(f"{self.path} is a sharded view; vectors() needs a single index — run merge_shards()")
        return parts[0][0]

    @property
    def docnos(self):
        """The ``npids.Lookup`` of the docnos (row -> docno via ``.fwd``, docno -> row via ``.inv``; single index only)."""
        _, parts, lookups = self._open()
        if len(lookups) != 1:
            raise ValueError(f"{self.path} is a sharded view; docnos needs a single index — run merge_shards()")
        return lookups[0]

    # -- id helpers (work for single indexes and sharded views) ------------------------------------------
    def _docnos_of(self, ids: np.ndarray) -> np.ndarray:
        """Docnos (object array of str) of global document ids."""
        _, parts, lookups = self._open()
        ids = np.asarray(ids, dtype=np.int64)
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

    def _ids_of(self, docnos: Sequence[str]) -> np.ndarray:
        """Global document ids of docnos; -1 for docnos that are not in the index.

        The lookups hold npids' hash inverse (written by ``_index_io.build_docno_lookup``), which compares whole
        docnos, so unknown docnos (``"7"`` where ``"007"`` is stored) never map to a real row.
        """
        _, parts, lookups = self._open()
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

    def _vectors_of(self, ids: np.ndarray) -> np.ndarray:
        """float32 vectors of global document ids (all must be valid)."""
        _, parts, _ = self._open()
        n = len(parts)
        out = np.empty((len(ids), self.dim), dtype=np.float32)
        for s, (vectors, _, _) in enumerate(parts):
            mask = (ids % n == s) if n > 1 else np.ones(len(ids), dtype=bool)
            if mask.any():
                local = ids[mask] // n
                order = np.argsort(local)  # sorted access pattern for the memmap
                rows = np.empty((len(local), vectors.shape[1]), dtype=np.float32)
                rows[order] = vectors[local[order]]
                out[mask] = rows
        return out

    # -- indexing --------------------------------------------------------------------------------------------
    def indexer(self, mode: str = "create", dtype: Optional[str] = None, shard: Optional[int] = None,
                num_shards: Optional[int] = None, *, presharded: bool = False, batch_size: int = 1024,
                checkpoint_every: int = 65536, verbose: bool = False) -> DenseIndexer:
        """A ``pt.Indexer`` that streams ``docno``/``doc_vec`` records into this index.

        Args:
            mode: ``"create"`` (fails if the directory holds anything), ``"overwrite"`` (deletes this index's
                files first) or ``"resume"`` (continues an interrupted build from its last durable record, or
                starts one).
            dtype: ``"float32"`` (default) or ``"float16"`` storage; on resume, defaults to the stored dtype.
            shard: index only every ``num_shards``-th record, starting at record ``shard``, into
                ``<path>/shards/<shard>``.  Defaults to torchrun's ``RANK``/``WORLD_SIZE`` when
                ``WORLD_SIZE > 1`` (pass ``shard=0, num_shards=1`` to force a single index).
            num_shards: number of shards.
            presharded: the input already holds only this shard's records (made with
                :meth:`DenseIndex.shard_iter`), e.g. so that an encoder in front of the indexer only encodes
                this shard's documents.
            batch_size: records converted and written per batch.
            checkpoint_every: records between fsyncs of the data files + progress record updates.
            verbose: unused, for interface compatibility.
        """
        return DenseIndexer(self, mode=mode, dtype=dtype, shard=shard, num_shards=num_shards,
                            presharded=presharded, batch_size=batch_size, checkpoint_every=checkpoint_every,
                            verbose=verbose)

    @staticmethod
    def shard_iter(docs: Iterable[Any], shard: int, num_shards: int) -> Iterator[Any]:
        """The records of ``docs`` for ``shard`` (record ``i`` goes to shard ``i % num_shards``)."""
        return shard_iter(docs, shard, num_shards)

    # -- search ------------------------------------------------------------------------------------------------
    def search(self, query_vecs: np.ndarray, k: int, *, backend: str = "auto",
               **kwargs: Any) -> Tuple[np.ndarray, np.ndarray]:
        """Exact top-``k`` inner-product search streaming the index in blocks (memory independent of its size).

        Args:
            query_vecs: ``(q, dim)`` query vectors.
            k: results per query (capped at ``len(self)``).
            backend: ``"numpy"``, ``"torch"`` or ``"auto"`` (torch on CUDA when available, else numpy).
            **kwargs: passed to the kernel (numpy: ``block_size``, ``query_batch_size``; torch: ``device``,
                ``chunk_size``, ``query_batch_size``, ``pin_memory``).

        Returns:
            ``(scores, doc_indices)``: float32 and int64 arrays of shape ``(q, min(k, len(self)))``, scores
            descending; doc_indices are rows of the (merged) index, see :meth:`_docnos_of`/``docnos.fwd``.
        """
        meta, parts, _ = self._open()
        query_vecs = np.asarray(query_vecs, dtype=np.float32)
        if query_vecs.ndim != 2 or query_vecs.shape[1] != int(meta["dim"]):
            raise ValueError(f"query_vecs must have shape (q, {meta['dim']}), got {query_vecs.shape}")
        if backend == "auto":
            backend = _auto_backend()
        if backend == "numpy":
            return numpy_search(parts, query_vecs, k, **kwargs)
        if backend == "torch":
            return torch_search(parts, query_vecs, k, **kwargs)
        raise ValueError(f"backend must be 'auto', 'numpy' or 'torch', got {backend!r}")

    def retriever(self, num_results: int = 1000, *, drop_query_vec: bool = False) -> ExactRetriever:
        """The best exact retriever for this machine: torch on CUDA when available, else numpy."""
        if _auto_backend() == "torch":
            return self.torch_retriever(num_results=num_results, drop_query_vec=drop_query_vec)
        return self.np_retriever(num_results=num_results, drop_query_vec=drop_query_vec)

    def np_retriever(self, num_results: int = 1000, *, block_size: int = 16384, query_batch_size: int = 1024,
                     drop_query_vec: bool = False) -> ExactRetriever:
        """Exact numpy retrieval streaming ``block_size`` rows at a time from the memmap."""
        return ExactRetriever(self, backend="numpy", num_results=num_results, block_size=block_size,
                              query_batch_size=query_batch_size, drop_query_vec=drop_query_vec)

    def torch_retriever(self, num_results: int = 1000, *, device: Optional[str] = None,
                        chunk_size: Optional[int] = None, query_batch_size: int = 4096,
                        drop_query_vec: bool = False) -> ExactRetriever:
        """Exact torch retrieval streaming the index through ``device`` (default CUDA if available) in chunks."""
        return ExactRetriever(self, backend="torch", num_results=num_results, device=device, block_size=chunk_size,
                              query_batch_size=query_batch_size, drop_query_vec=drop_query_vec)

    def faiss_flat_retriever(self, num_results: int = 1000, **kwargs: Any) -> FaissRetriever:
        """Exact FAISS ``IndexFlatIP`` retrieval (GPU with faiss-gpu)."""
        return FaissRetriever(self, "flat", num_results=num_results, **kwargs)

    def faiss_hnsw_retriever(self, num_results: int = 1000, neighbours: int = 32, ef_construction: int = 40,
                             ef_search: int = 128, **kwargs: Any) -> FaissRetriever:
        """Approximate FAISS HNSW retrieval (``efSearch`` is raised to ``num_results`` when smaller)."""
        return FaissRetriever(self, "hnsw", num_results=num_results, neighbours=neighbours,
                              ef_construction=ef_construction, ef_search=ef_search, **kwargs)

    def faiss_ivf_retriever(self, num_results: int = 1000, n_list: Optional[int] = None, n_probe: int = 16,
                            pq_m: Optional[int] = None, **kwargs: Any) -> FaissRetriever:
        """Approximate FAISS IVF retrieval (``IndexIVFFlat``, or ``IndexIVFPQ`` with ``pq_m`` sub-quantisers).

        ``n_list`` defaults to ``4 * sqrt(len(index))`` (at most ``len(index) // 39``).
        """
        return FaissRetriever(self, "ivf", num_results=num_results, n_list=n_list, n_probe=n_probe, pq_m=pq_m,
                              **kwargs)

    def scorer(self, num_results: Optional[int] = None) -> DenseScorer:
        """Re-scores a result frame (``qid``, ``docno``, ``query_vec``) with the stored vectors."""
        return DenseScorer(self, num_results=num_results)

    # -- merging ---------------------------------------------------------------------------------------------
    @classmethod
    def merge(cls, sources: Sequence[Union["DenseIndex", str, Path]], path: Union[str, Path], *,
              mode: str = "create", block_size: int = 65536) -> "DenseIndex":
        """Concatenates built single indexes (in the given order) into a new index at ``path``.

        The destination's build lock is held throughout (a concurrent build or merge into ``path`` gets
        ``ConcurrentBuildError``).  A merge killed midway leaves ``path`` clearly unbuilt (rerun it with
        ``mode="overwrite"``).

        Raises:
            ValueError: when the sources differ in dim/dtype or share docnos (the result is left unbuilt), or
                when ``path`` is one of the sources or contains one (``mode="overwrite"`` would delete it
                before reading it).
        """
        from ._locking import build_lock

        sources = [s if isinstance(s, DenseIndex) else DenseIndex(s) for s in sources]
        if not sources:
            raise ValueError("merge needs at least one source index")
        if mode not in ("create", "overwrite"):
            raise ValueError(f"mode must be 'create' or 'overwrite', got {mode!r}")
        target = Path(path)
        resolved = target.resolve()
        for s in sources:
            src = Path(s.path).resolve()
            if src == resolved or resolved in src.parents:
                raise ValueError(f"cannot merge into {target}: it {'is' if src == resolved else 'contains'} the "
                                 f"source index {s.path} (which mode={mode!r} would destroy before it is read); "
                                 "merge into another path")
        with build_lock(target, "dense index"):
            metas = [s._open()[0] for s in sources]
            for s, m in zip(sources, metas):
                if m.get("layout") == "sharded":
                    raise ValueError(f"{s.path} is a sharded view; use its merge_shards()")
                if (m["dim"], m["dtype"]) != (metas[0]["dim"], metas[0]["dtype"]):
                    raise ValueError(f"cannot merge {s.path} (dim={m['dim']}, dtype={m['dtype']}) with "
                                     f"{sources[0].path} (dim={metas[0]['dim']}, dtype={metas[0]['dtype']})")
            _prepare_output(target, mode)
            io.write_json_atomic(target / io.MERGE_FILE, {"sources": [str(s.path) for s in sources],
                                                           "keep_shards": True})

            def vector_blocks():
                for s in sources:
                    vecs = s.vectors()
                    for start in range(0, len(vecs), block_size):
                        yield np.asarray(vecs[start:start + block_size])

            def docnos():
                for s in sources:
                    yield from s.docnos.fwd

            _write_merged(target, vector_blocks(), docnos(), metas[0], sum(int(m["count"]) for m in metas))
            io.remove_leftovers(target)
        return DenseIndex(path)

    def merge_shards(self, *, keep_shards: bool = False, block_size: int = 65536) -> "DenseIndex":
        """Merges a sharded view in place into a single index (row ``j`` = shard ``j % n``, row ``j // n``).

        The result is identical to indexing the same input without sharding.  The build lock of the index is
        held throughout.  ``_merge.json`` records the merge while it runs: the sharded view stays valid until
        the merged ``pt_meta.json`` replaces it, and a merge killed at any point is finished (or its partial
        files removed) by rerunning ``merge_shards()``, by ``indexer(mode="resume")`` or when the index is
        next opened.

        Args:
            keep_shards: keep ``<path>/shards`` after merging (default: delete it).
        """
        from ._locking import build_lock

        target = Path(self.path)
        with build_lock(target, "dense index"):
            finished = (target / io.MERGE_FILE).exists()
            io.remove_leftovers(target)  # of a merge killed before or after its commit
            self._cache = None
            meta, parts, lookups = self._open()
            if meta.get("layout") != "sharded":
                if finished:  # an interrupted merge_shards() had committed; its cleanup is now complete
                    return DenseIndex(self.path)
                raise ValueError(f"{self.path} is not a sharded view (nothing to merge)")
            n = len(parts)
            total = int(meta["count"])
            rows = max(1, block_size // n)

            def vector_blocks():
                for start in range(0, len(parts[0][0]), rows):
                    # shard sizes differ by at most one (round-robin), the short shards being the last ones, so
                    # row i of shard s lands at merged row i * n + s
                    blocks = [np.asarray(p[0][start:start + rows]) for p in parts]
                    merged = np.empty((sum(len(b) for b in blocks), blocks[0].shape[1]), dtype=blocks[0].dtype)
                    for s, b in enumerate(blocks):
                        merged[s::n] = b
                    yield merged

            def docnos():
                for start in range(0, len(lookups[0]), rows):
                    chunk = [lk.fwd.lookup(np.arange(start, min(start + rows, len(lk)))) for lk in lookups]
                    for i in range(len(chunk[0])):
                        for s in range(n):
                            if i < len(chunk[s]):
                                yield str(chunk[s][i])

            single = {k: v for k, v in meta.items() if k not in ("layout", "num_shards")}
            io.write_json_atomic(target / io.MERGE_FILE, {"keep_shards": bool(keep_shards)})
            for name in (io.VECTORS_FILE, io.DOCNOS_FILE):
                (target / name).unlink(missing_ok=True)
            _write_merged(target, vector_blocks(), docnos(), single, total)
            self._cache = None
            for lookup in lookups:
                lookup.close()
            io.remove_leftovers(target)  # shards/ (unless kept), then _merge.json
        return DenseIndex(self.path)


def _auto_backend() -> str:
    try:
        import torch
        return "torch" if torch.cuda.is_available() else "numpy"
    except ImportError:  # pragma: no cover
        return "numpy"


def _remove_leftovers_if_idle(path: Path) -> None:
    """Finishes a commit that a killed build/merge left unfinished, unless another process is building there.

    Best effort: nothing happens when another process holds the build lock or the directory (or its parent,
    where the lock lives) is not writable; the index is complete and searchable either way.
    """
    from ._locking import ConcurrentBuildError, build_lock

    if not io.has_leftovers(path):
        return
    try:
        with build_lock(path, "dense index"):
            io.remove_leftovers(path)
    except (ConcurrentBuildError, OSError):
        pass


def _prepare_output(target: Path, mode: str) -> None:
    if mode not in ("create", "overwrite"):
        raise ValueError(f"mode must be 'create' or 'overwrite', got {mode!r}")
    if target.exists() and any(target.iterdir()):
        if mode == "create":
            raise FileExistsError(f"{target} already exists; use mode='overwrite' to replace it")
        DenseIndexer(DenseIndex(target), mode="overwrite", shard=0, num_shards=1)._prepare()  # caller holds the lock
    target.mkdir(parents=True, exist_ok=True)


def _write_merged(target: Path, vector_blocks: Iterator[np.ndarray], docnos: Iterator[str], meta: dict,
                  total: int) -> None:
    """Writes vectors + docno lookup of a merged index, then (last) its pt_meta.json."""
    written = 0
    with open(target / io.VECTORS_FILE, "wb") as fout:
        for block in vector_blocks:
            fout.write(np.ascontiguousarray(block).tobytes())
            written += len(block)
        fout.flush()
        os.fsync(fout.fileno())
    if written != total:
        raise ValueError(f"merge wrote {written} vectors but expected {total}")
    io.build_docno_lookup(docnos, target / io.DOCNOS_FILE)
    out_meta = io.base_meta(dim=meta["dim"], count=total, dtype=meta["dtype"], layout="single")
    io.write_json_atomic(target / io.META_FILE, out_meta)
