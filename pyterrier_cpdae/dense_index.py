"""A resumable, shardable on-disk dense vector index with exact, FAISS and GPU retrieval.

Example::

    from pyterrier_cpdae import CPDAE, DenseIndex

    enc = CPDAE.from_pretrained("path/to/model")
    index = DenseIndex("indexes/vaswani.cpdae")
    (enc >> index.indexer()).index(dataset.get_corpus_iter())
    pipeline = enc >> index.retriever(num_results=100)

This module is the public home of :class:`DenseIndex`.  The index is built from layers that import one way only
(``tests/test_module_graph.py`` checks it)::

    dense_index ─┬─> _exact_retr, _faiss_retr  (retrievers; attach their factories to DenseIndex)
                 │        └─> _retrieval (result frames) ─┐
                 └─> _dense_core (DenseIndex) ─> _indexing (writers) ─┴─> _store (open, check, search)
                                                                              └─> _index_io, _exact_search

See ``_index_io`` for the directory format.
"""
from __future__ import annotations

from . import _exact_retr, _faiss_retr  # noqa: F401  (attach the retriever factories to DenseIndex)
from ._dense_core import DenseIndex
from ._index_io import IncompleteIndexError
from ._indexing import DenseIndexer

__all__ = ["DenseIndex", "DenseIndexer", "IncompleteIndexError"]
