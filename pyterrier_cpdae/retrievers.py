"""PyTerrier transformers over a :class:`~pyterrier_cpdae.dense_index.DenseIndex` (public names).

Create them with the index's factory methods (``index.retriever()``, ``index.np_retriever()``,
``index.torch_retriever()``, ``index.faiss_*_retriever()``, ``index.scorer()``); the classes live in the
modules that attach those factories (``_exact_retr``, ``_faiss_retr``) and are named here for ``isinstance``
checks and documentation.
"""
from __future__ import annotations

from ._exact_retr import DenseScorer, ExactRetriever
from ._faiss_retr import FAISS_KINDS, FaissRetriever
from ._retrieval import RESULT_COLUMNS, VectorRetriever

__all__ = ["ExactRetriever", "FaissRetriever", "DenseScorer", "VectorRetriever", "FAISS_KINDS", "RESULT_COLUMNS"]
