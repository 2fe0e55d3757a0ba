"""The retriever of a binary :class:`~pyterrier_cpdae.dense.DenseIndex` with its ``rescore_multiplier``, attached as
``binary_retriever`` (``retriever()`` / ``np_retriever()`` / ``torch_retriever()`` search a binary index with the
default multiplier, :data:`.binary.DEFAULT_RESCORE_MULTIPLIER`).
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import numpy as np

from .._checks import check_int
from .binary import DEFAULT_RESCORE_MULTIPLIER, DEFAULT_SCAN, SCANS
from .exact_retr import ExactRetriever
from .index import DenseIndex

__all__ = ["BinaryRetriever"]


class BinaryRetriever(ExactRetriever):
    """Hamming scan of a binary index, then float32 rescoring of each query's best ``num_results *
    rescore_multiplier`` candidates from the float copy (sentence-transformers' option name): approximate, the
    larger ``rescore_multiplier`` the closer to the float32 ranking (equal once every document is rescored)."""

    def __init__(self, index: DenseIndex, *, rescore_multiplier: int = DEFAULT_RESCORE_MULTIPLIER,
                 scan: str = DEFAULT_SCAN, **kwargs: Any):
        super().__init__(index, backend="numpy", **kwargs)
        self.rescore_multiplier = check_int(rescore_multiplier, "rescore_multiplier")
        if scan not in SCANS:
            raise ValueError(f"scan must be 'faiss', 'numpy' or 'torch' for a binary index, got {scan!r}")
        self.scan = scan

    def _params(self) -> Tuple:
        return super()._params() + (self.rescore_multiplier, self.scan)

    def __repr__(self) -> str:
        return (f"BinaryRetriever({str(self.index.path)!r}, num_results={self.num_results}, "
                f"rescore_multiplier={self.rescore_multiplier}, scan={self.scan!r})")

    def _search(self, queries: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        meta = self.index.meta()
        if meta["dtype"] != "binary":
            raise ValueError(f"binary_retriever() searches dtype='binary' indexes; {self.index.path} stores "
                             f"dtype={meta['dtype']!r} (use retriever())")
        kwargs: Dict[str, Any] = {"rescore_multiplier": self.rescore_multiplier, "scan": self.scan}
        if self.query_batch_size:
            kwargs["query_batch_size"] = self.query_batch_size
        if self.block_size:
            kwargs["block_size"] = self.block_size
        return self.index.store.search(queries, self.num_results, backend=self.backend, **kwargs)


def _binary_retriever(self: DenseIndex, num_results: int = 1000, *,
                      rescore_multiplier: int = DEFAULT_RESCORE_MULTIPLIER, scan: str = DEFAULT_SCAN,
                      block_size: int = 16384, query_batch_size: int = 1024,
                      drop_query_vec: bool = False) -> BinaryRetriever:
    """Retrieval from a binary index: the ``num_results * rescore_multiplier`` nearest in Hamming distance, rescored
    in float32 (``scan``: the Hamming scan, ``"faiss"`` popcount, ``"numpy"`` ``np.bitwise_count`` or ``"torch"`` +-1
    int8 products, the same results; all on the CPU)."""
    return BinaryRetriever(self, rescore_multiplier=rescore_multiplier, scan=scan, num_results=num_results,
                           block_size=block_size, query_batch_size=query_batch_size, drop_query_vec=drop_query_vec)


DenseIndex.binary_retriever = _binary_retriever
