"""A resumable, shardable on-disk dense vector index with exact, FAISS and GPU retrieval.

Example::

    from pyterrier_cpdae import CPDAE, DenseIndex

    enc = CPDAE.from_pretrained("path/to/model")
    index = DenseIndex("indexes/vaswani.cpdae")
    (enc >> index.indexer()).index(dataset.get_corpus_iter())
    pipeline = enc >> index.retriever(num_results=100)

This module is the public home of :class:`DenseIndex`; it imports the retrievers' modules so that they attach their
factories.  The parts import one way only (``tests/test_module_graph.py`` checks that the package has no cycle)::

    _exact_retr, _faiss_retr   retrievers; attach retriever()/np_retriever()/.../faiss_*_retriever()/scorer()
        -> _dense_core         DenseIndex: state, meta(), indexing, merging
        -> _retrieval          result frames and their checks
    _dense_core -> _indexing   DenseIndexer (crash-resumable writer), merge_indexes, merge_shards
    _dense_core, _indexing, _exact_retr -> _store
                               DenseStore: opens and checks vectors + docnos (single or sharded), exact search()
    _store -> _index_io, _exact_search
                               the file format and pt_meta.json reader; the numpy/torch search kernels

See ``_index_io`` for the directory format.
"""
from __future__ import annotations

from .._artifact import IncompleteIndexError
from .exact_retr import DenseScorer, ExactRetriever  # (importing it attaches the retriever factories to DenseIndex)
from .faiss_retr import FAISS_KINDS, FaissRetriever  # (and the faiss_*_retriever factories)
from .index import DenseIndex
from .indexing import DenseIndexer
from .retrieval import RESULT_COLUMNS, VectorRetriever

__all__ = ["DenseIndex", "DenseIndexer", "IncompleteIndexError", "ExactRetriever", "FaissRetriever", "DenseScorer",
           "VectorRetriever", "FAISS_KINDS", "RESULT_COLUMNS"]
