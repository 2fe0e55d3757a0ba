"""The :class:`DenseIndex` artifact: state, metadata, indexing and merging.

Retrieval is attached from the retrievers' own modules (:mod:`~pyterrier_cpdae.dense.exact_retr`: ``retriever``,
``np_retriever``, ``torch_retriever``, ``scorer``; :mod:`~pyterrier_cpdae.dense.faiss_retr`: ``faiss_*_retriever``), as pyterrier-dr attaches its
``FlexIndex`` retrievers; :mod:`pyterrier_cpdae.dense` imports them all, so import ``DenseIndex`` from there.
This module depends only on the store (:mod:`~pyterrier_cpdae.dense.store`) and the writers
(:mod:`~pyterrier_cpdae.dense.indexing`), which never import it back.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import pandas as pd
import pyterrier as pt
import pyterrier_alpha as pta

from . import format as io
from .._artifact import IncompleteIndexError, PackagedArtifact
from .indexing import DenseIndexer, merge_indexes, merge_shards, shard_iter
from .store import DenseStore, check_producer, check_query_producer, parse_stamp

__all__ = ["DenseIndex", "DenseIndexer", "IncompleteIndexError"]


class DenseIndex(PackagedArtifact, pt.Indexer):
    """A dense index: float32/float16 vectors (or int8/binary codes beside a float32 copy) on disk plus a docno
    lookup, as a PyTerrier artifact and indexer.

    ``DenseIndex(path)`` never touches the disk; the index is opened (and checked) lazily when first used for
    retrieval.  An index directory is either a *single* index or a *sharded view* (``<path>/shards/<i>``
    built by ``indexer(shard=i, num_shards=n)``), which all retrievers except FAISS search as one index.
    Global document ids (``docid``) of a sharded view equal the rows of the merged index.

    Like pyterrier-dr's ``FlexIndex`` it is also a ``pt.Indexer`` (``(enc >> index).index(docs)`` builds it with
    the default :meth:`indexer`) and, in a pipeline, a transformer: a query frame with ``query_vec`` is retrieved
    with :meth:`retriever`, a result frame with ``query_vec`` re-scored with :meth:`scorer`.
    """

    __module__ = "pyterrier_cpdae.dense"  # the public home, which attaches the retrievers (also for pickle)

    ARTIFACT_TYPE = io.ARTIFACT_TYPE
    ARTIFACT_FORMAT = io.ARTIFACT_FORMAT
    ARTIFACT_PACKAGE_HINT = io.PACKAGE_HINT
    PACKAGE_EXCLUDE = (io.FAISS_DIR,)  # FAISS caches: rebuilt on first use, not shared
    PACKAGE_MEMBERS = (io.META_FILE, io.VECTORS_FILE, io.DOCNOS_FILE, io.SHARDS_DIR)  # a single index or a sharded view

    def __init__(self, path: Union[str, Path]):
        super().__init__(path)
        self._store = DenseStore(self.path)

    def __repr__(self) -> str:
        return f"DenseIndex({str(self.path)!r})"

    # -- state ---------------------------------------------------------------------------------------------
    @property
    def store(self) -> DenseStore:
        """The low-level :class:`~pyterrier_cpdae.dense.store.DenseStore` of this directory (what retrievers read)."""
        return self._store

    def built(self) -> bool:
        """Whether the index is completely built (``pt_meta.json`` exists and is valid)."""
        try:
            return io.read_meta(Path(self.path)) is not None
        except ValueError:
            return False

    def meta(self) -> dict:
        """The parsed ``pt_meta.json`` of the built index (the same as :meth:`metadata`).

        Holds, as :meth:`BM25Index.meta() <pyterrier_cpdae.bm25.BM25Index.meta>` does, ``type``, ``format``,
        ``package_hint`` and ``num_docs`` (the number of documents), plus ``dim``, ``count`` (= ``num_docs``),
        ``dtype``, ``layout`` (``"single"``/``"sharded"``) and ``format_version``.

        Raises:
            IncompleteIndexError: when the index is not (completely) built (a ``FileNotFoundError``).
            ValueError: when ``pt_meta.json`` is corrupt.
        """
        return self._store.meta()

    metadata = meta

    def __len__(self) -> int:
        """The number of documents, once ``pt_meta.json`` is checked against the files (``DenseStore.open``)."""
        return len(self._store)

    @property
    def dim(self) -> int:
        """The vector dimension (checked against the files, as ``len()``)."""
        return self._store.dim

    @property
    def dtype(self) -> str:
        """The storage dtype (``"float32"``, ``"float16"``, ``"int8"`` or ``"binary"``)."""
        return str(self._store.checked_meta()["dtype"])

    @property
    def num_shards(self) -> int:
        """1 for a single index, else the number of shards of the sharded view."""
        meta = self._store.checked_meta()
        return int(meta["num_shards"]) if meta.get("layout") == "sharded" else 1

    def vectors(self) -> np.memmap:
        """The stored vectors as a read-only ``np.memmap`` of shape ``(len(self), dim)`` (single index only)."""
        return self._store.vectors()

    @property
    def docnos(self):
        """The ``npids.Lookup`` of the docnos (row -> docno via ``.fwd``, docno -> row via ``.inv``; single index only)."""
        return self._store.docnos()

    # -- indexing --------------------------------------------------------------------------------------------
    def indexer(self, mode: str = "create", dtype: Optional[str] = None, shard: Optional[int] = None,
                num_shards: Optional[int] = None, *, presharded: bool = False, batch_size: int = 1024,
                checkpoint_every: int = 65536, verbose: bool = False, producer: Any = None) -> DenseIndexer:
        """A ``pt.Indexer`` that streams ``docno``/``doc_vec`` records into this index.

        Args:
            mode: ``"create"`` (fails if the directory holds anything), ``"overwrite"`` (deletes this index's
                files first) or ``"resume"`` (continues an interrupted build from its last durable record, or
                starts one).
            dtype: ``"float32"`` (default) or ``"float16"`` storage, or a compressed index: ``"int8"`` (int8 codes
                calibrated per dimension on the indexed vectors, scanned with a per-query proof that the ranking is
                the float32 one; :mod:`~pyterrier_cpdae.dense.int8`) or ``"binary"`` (sign bits, Hamming scan and
                float32 rescoring, approximate: :meth:`binary_retriever`'s ``rescore_multiplier``), both beside a
                float32 copy of the vectors that only rescoring reads; on resume, defaults to the stored dtype.
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
            producer: what made the vectors, recorded in ``pt_meta.json`` as ``producer``: an encoder with a
                ``producer()`` method (a :class:`~pyterrier_cpdae.CPDAE`), a dict of its settings or a name.
                ``enc >> index.indexer()`` with a CPDAE encoder (or its ``doc_encoder()``) records it without
                this argument. Shards, resumed builds and merged indexes whose producers differ are refused
                (``DenseIndex.merge``, :meth:`merge_shards`, the last shard's build), naming both.
        """
        return DenseIndexer(self, mode=mode, dtype=dtype, shard=shard, num_shards=num_shards,
                            presharded=presharded, batch_size=batch_size, checkpoint_every=checkpoint_every,
                            verbose=verbose, producer=producer)

    def index(self, inp: Any) -> "DenseIndex":
        """Builds the index with the default :meth:`indexer` (``mode="create"``): ``(enc >> index).index(docs)``."""
        return self.indexer().index(inp)

    def index_inputs(self) -> List[List[str]]:
        """The record fields :meth:`index` needs (PyTerrier's indexer inspection)."""
        return [["docno", "doc_vec"]]

    @staticmethod
    def shard_iter(docs: Iterable[Any], shard: int, num_shards: int) -> Iterator[Any]:
        """The records of ``docs`` for ``shard`` (record ``i`` goes to shard ``i % num_shards``)."""
        return shard_iter(docs, shard, num_shards)

    # -- search ------------------------------------------------------------------------------------------------
    def search(self, query_vecs: np.ndarray, k: int, *, backend: str = "auto", producer: Any = None,
               **kwargs: Any) -> Tuple[np.ndarray, np.ndarray]:
        """Exact top-``k`` inner-product search streaming the index in blocks (memory independent of its size).

        Unlike ``pt.Transformer.search`` (a text query), this takes query *vectors*; see
        :meth:`DenseStore.search <pyterrier_cpdae.dense.store.DenseStore.search>` for the arguments.
        ``producer``: what made ``query_vecs`` (an encoder with a ``producer()`` method, e.g. the
        :class:`~pyterrier_cpdae.CPDAE` whose ``encode_queries`` made them, its ``producer()`` dict, or the stamp of
        a frame's rows, ``frame["query_vec_producer"].iloc[0]``): checked
        against the index's producer as the retrievers check a pipeline's (a plain array carries no stamp, so
        without it nothing is checked).

        Raises:
            ValueError: ``producer`` is another encoder than the one that built the index; a stored vector of a
                result is not finite (naming its docno).

        Returns:
            ``(scores, doc_indices)``: float32 and int64 arrays of shape ``(q, min(k, len(self)))``, scores
            descending; doc_indices are rows of the (merged) index (``index.store.docnos_of`` / ``docnos.fwd``).
        """
        if producer is not None:
            query = producer.producer() if callable(getattr(producer, "producer", None)) else producer
            if isinstance(query, str) and query.startswith("{"):  # a stamp (a query_vec_producer value)
                query = parse_stamp(query, "producer")
            check_query_producer(Path(self.path), self.meta().get("producer"), check_producer(query))
        return self._store.search(query_vecs, k, backend=backend, **kwargs)

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        """In a pipeline: retrieves for a query frame (``qid``, ``query_vec``) or re-scores a result frame."""
        with pta.validate.any(inp) as v:
            v.result_frame(extra_columns=["query_vec"], mode="scorer")
            v.query_frame(extra_columns=["query_vec"], mode="retriever")
        if v.mode == "scorer":
            return self.scorer()(inp)
        return self.retriever()(inp)

    # -- merging ---------------------------------------------------------------------------------------------
    @classmethod
    def merge(cls, sources: Sequence[Union["DenseIndex", str, Path]], path: Union[str, Path], *,
              mode: str = "create", block_size: int = 65536) -> "DenseIndex":
        """Concatenates built single indexes (in the given order) into a new index at ``path``.

        The destination's build lock is held throughout (a concurrent build or merge into ``path`` gets
        ``ConcurrentBuildError``).  A merge killed midway leaves ``path`` clearly unbuilt (rerun it with
        ``mode="overwrite"``).

        Raises:
            ValueError: when the sources differ in dim/dtype or in the producer of their vectors (the encoder and
                its settings, when recorded: see :meth:`indexer`), or share docnos (the result is left unbuilt), or
                when ``path`` is one of the sources or contains one (``mode="overwrite"`` would delete it
                before reading it).
        """
        paths = [Path(s.path) if isinstance(s, DenseIndex) else Path(s) for s in sources]
        merge_indexes(paths, Path(path), mode=mode, block_size=block_size)
        return cls(path)

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
        merge_shards(self._store, keep_shards=keep_shards, block_size=block_size)
        return self
