"""What the retrievers of a :class:`~pyterrier_cpdae.dense.DenseIndex` share: the result frame and its checks.

All retrievers take a query frame with ``qid`` and ``query_vec`` and return a result frame with the input
columns plus ``docno``, ``docid`` (the row in the index), ``score`` (inner product) and ``rank`` (from 0,
scores descending).  Create them with the index's factory methods (``index.np_retriever()`` etc.), which the
retrievers' modules (:mod:`~pyterrier_cpdae.dense.exact_retr`,
:mod:`~pyterrier_cpdae.dense.faiss_retr`) attach to the index class.  The retrievers read the index
through its :class:`~pyterrier_cpdae.dense.store.DenseStore` (``index.store``).
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Optional, Sequence, Tuple

import numpy as np
import pandas as pd
import pyterrier as pt
import pyterrier_alpha as pta

from .._checks import check_int
from . import format as io
from .store import check_query_producer, check_vectors_producer, producer_column

RESULT_COLUMNS = ["docno", "docid", "score", "rank"]


def optional_int(value: Any, name: str) -> Optional[int]:
    """``None`` (the default is used) or an integer >= 1 (see :func:`check_int`)."""
    return None if value is None else check_int(value, name)


def query_matrix(inp: pd.DataFrame, dim: int) -> np.ndarray:
    """Stacks the ``query_vec`` column into a float32 ``(q, dim)`` matrix, checking shapes and values."""
    return io.stack_vectors(list(inp["query_vec"]), [str(q) for q in inp["qid"]], dim, what="query_vec",
                            id_name="qid")


def corrupt_vectors(index: pta.Artifact, which: str) -> ValueError:
    """The error for stored vectors that are not finite (the indexer refuses them: the file was damaged)."""
    return ValueError(f"the stored vectors of {which} are not finite, so {Path(index.path) / io.VECTORS_FILE} is "
                      "corrupt — rebuild the index with indexer(mode='overwrite')")


def check_scores(index: pta.Artifact, scores: np.ndarray, qids: Sequence[Any], docnos: Sequence[str]) -> None:
    """Refuses NaN/infinite scores (the query vectors are checked finite, so a stored vector is corrupt).

    The indexer refuses non-finite vectors, so only a damaged ``vectors.bin`` gets here; without this check a
    NaN score would rank arbitrarily (retrievers) or fail in ``add_ranks`` (scorer).

    Raises:
        ValueError: naming the first (qid, docno) pairs and the index file.
    """
    bad = np.nonzero(~np.isfinite(scores))[0]
    if len(bad):
        pairs = [(qids[i], docnos[i]) for i in bad[:5]]
        raise corrupt_vectors(index, f"the documents of {len(bad)} NaN/infinite score(s), e.g. (qid, docno) {pairs},")


def result_frame(index: pta.Artifact, inp: pd.DataFrame, scores: np.ndarray, ids: np.ndarray,
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
            "docno": index.store.docnos_of(flat_ids),
            "docid": flat_ids.astype(np.int64),
            "score": scores[valid].astype(np.float32),
            "rank": np.arange(len(flat_ids)) - np.repeat(starts, counts),
        }
        check_scores(index, columns["score"], inp["qid"].to_numpy()[columns["_index"]], columns["docno"])
        if len(flat_ids) == 1:  # DataFrameBuilder treats length-1 arrays as scalars; lists of 1 are fine
            columns = {k: v.tolist() for k, v in columns.items()}
        res.extend(columns)
    if drop_query_vec:
        inp = inp.drop(columns=["query_vec", producer_column("query_vec")], errors="ignore")
    return res.to_df(inp)


def empty_result(inp: pd.DataFrame, drop_query_vec: bool = False) -> pd.DataFrame:
    """An empty result frame with the input's columns plus the result columns."""
    if drop_query_vec:
        inp = inp.drop(columns=["query_vec", producer_column("query_vec")], errors="ignore")
    out = pta.DataFrameBuilder(RESULT_COLUMNS).to_df(inp)
    return out.astype({"docno": object, "docid": np.int64, "score": np.float32, "rank": np.int64})


class EncoderChecked:
    """What the retrievers and the scorer of an index share: composed after an encoder (``enc >> retriever``,
    ``enc.query_encoder() >> retriever``; the encoder calls :meth:`with_producer`), they compare it with the producer
    recorded by the index (:func:`~pyterrier_cpdae.dense.store.check_query_producer`): at composition when the index
    is built, else before the first search, and again after a rebuild. ``for_any_encoder()`` turns this off."""

    check_encoder = True
    _query_encoder: Any = None
    _checked_build: Any = None

    def with_producer(self, encoder: Any) -> Any:
        """This transformer, told that ``encoder`` (with a ``producer()`` method) makes its query vectors.

        Raises:
            ValueError: when the index is built and its vectors come from another encoder."""
        if not self.check_encoder or not callable(getattr(encoder, "producer", None)):
            return self
        clone = copy.copy(self)
        clone._query_encoder, clone._checked_build = encoder, None
        if clone.index.built():
            clone.check_query_encoder()
        return clone

    def for_any_encoder(self) -> Any:
        """This transformer without the query encoder check (an asymmetric pair of encoders on purpose)."""
        clone = copy.copy(self)
        clone.check_encoder, clone._query_encoder = False, None
        return clone

    def check_frame_producer(self, inp: pd.DataFrame) -> None:
        """Checks the producer an encoder stamped on the rows of the frame's ``query_vec`` (the column
        ``query_vec_producer``, added by :class:`~pyterrier_cpdae.CPDAE`'s query encoder) against the index's,
        whatever the pipeline's shape: the column stays with the rows through merge, concat, ``DataFrame(records)``,
        apply, ``transform_iter``, fusion and pickling (:mod:`~pyterrier_cpdae._producers`). Rows without a
        stamp column (vectors from user code) are searched without a check.

        Raises:
            ValueError: the rows' vectors come from more than one producer, or from another encoder than the one
                that built the index."""
        if self.check_encoder and producer_column("query_vec") in inp.columns:
            check_vectors_producer(Path(self.index.path), self.index.meta().get("producer"), inp)

    def check_query_encoder(self) -> None:
        """Checks the query encoder it was composed with against the index's producer (once per build)."""
        if self._query_encoder is None or not self.check_encoder:
            return
        meta = self.index.meta()
        if self._checked_build is not None and self._checked_build == meta.get("build_id"):
            return
        check_query_producer(Path(self.index.path), meta.get("producer"), self._query_encoder.producer())
        self._checked_build = meta.get("build_id")


class VectorRetriever(EncoderChecked, pt.Transformer):
    """Base of the retrievers: query frame (``qid``, ``query_vec``) in, standard result frame out.

    Subclasses implement :meth:`_search` and :meth:`_params` (their identity, used by ``==``/``hash`` so that
    ``pt.Experiment(..., plan="tree")`` can share equal pipeline prefixes).
    """

    def __init__(self, index: pta.Artifact, *, num_results: int, drop_query_vec: bool):
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

    def fuse_rank_cutoff(self, k: int) -> Optional["VectorRetriever"]:
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
        self.check_query_encoder()
        self.check_frame_producer(inp)
        inp = inp.reset_index(drop=True)
        scores, ids = self._search(query_matrix(inp, self.index.dim))
        return result_frame(self.index, inp, scores, ids, self.drop_query_vec)
