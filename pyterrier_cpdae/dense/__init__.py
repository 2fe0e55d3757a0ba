"""A resumable, shardable on-disk dense vector index with exact, FAISS and GPU retrieval.

Example::

    from pyterrier_cpdae import CPDAE, DenseIndex

    enc = CPDAE.from_pretrained("path/to/model")
    index = DenseIndex("indexes/vaswani.cpdae")
    (enc >> index.indexer()).index(dataset.get_corpus_iter())
    pipeline = enc >> index.retriever(num_results=100)

This package (the dense wing) is the public home of :class:`DenseIndex` and its retrievers; it imports the
retrievers' modules so that they attach their factories.  The parts import one way only
(``tests/project/test_module_graph.py`` checks that there is no cycle and that the wing imports only itself and the shared
helpers ``_artifact``, ``_checks``, ``_files``, ``_locking``)::

    exact_retr, faiss_retr     retrievers; attach retriever()/np_retriever()/.../faiss_*_retriever()/scorer()
    binary_retr -> exact_retr  the binary index's retriever (rescore_multiplier); attaches binary_retriever()
        -> index               DenseIndex: state, meta(), indexing, merging
        -> retrieval           result frames and their checks
    index -> indexing          DenseIndexer (crash-resumable writer), merge_indexes, merge_shards
    index, indexing, exact_retr -> store
                               DenseStore: opens and checks vectors + docnos (single or sharded), exact search()
    store -> format, kernels, ties, compressed -> int8, binary
                               the file format; the numpy/torch search kernels; exact near ties; the searches of
                               compressed indexes (int8: exact, with a proof; binary: Hamming scan + rescoring)
    int8, binary -> codes -> format, kernels
                               compressed codes: their files, calibration and int8 scan (indexing writes them)

See :mod:`pyterrier_cpdae.dense.format` for the directory format.
"""
from __future__ import annotations

from .._artifact import IncompleteIndexError
from .exact_retr import DenseScorer, ExactRetriever  # (importing it attaches the retriever factories to DenseIndex)
from .faiss_retr import FAISS_KINDS, FaissRetriever  # (and the faiss_*_retriever factories)
from .binary_retr import BinaryRetriever  # (and the binary_retriever factory)
from .index import DenseIndex
from .indexing import DenseIndexer
from .retrieval import RESULT_COLUMNS, VectorRetriever

__all__ = ["DenseIndex", "DenseIndexer", "IncompleteIndexError", "ExactRetriever", "FaissRetriever", "DenseScorer",
           "BinaryRetriever",
           "VectorRetriever", "FAISS_KINDS", "RESULT_COLUMNS"]
