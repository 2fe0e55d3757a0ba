"""Reliability of the retrieval side (issue 9): one test per promise of the README's encoder and retriever
error-behaviour paragraphs — a rebuilt index is noticed, a read-only index is searchable, and bad input (``k``,
texts, vectors, paths) gets an error that names the problem.

References: retrieval results are compared with a naive full numpy sort (``naive_topk``).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pyterrier_cpdae import DenseIndex

sys.path.insert(0, str(Path(__file__).parent))
from test_dense_index import DIM, assert_matches_naive, make_docs, make_topics  # noqa: E402


@pytest.fixture(scope="module")
def small_index(tmp_path_factory):
    docs, vecs = make_docs(300)
    index = DenseIndex(tmp_path_factory.mktemp("rel") / "ix")
    index.indexer().index(docs)
    return index, vecs


# ------------------------------------------------------------------------------------------- k and num_results
@pytest.mark.parametrize("k", [-1, 0, 2.5, "10", None, True])
def test_search_refuses_a_bad_k(small_index, k):
    """issue 9 #23: ``index.search(q, -1)`` said numpy's "negative dimensions are not allowed"."""
    index, _ = small_index
    q = np.zeros((1, DIM), dtype=np.float32)
    for backend in ("numpy", "torch"):
        with pytest.raises(ValueError, match=r"k must be an integer >= 1, got"):
            index.search(q, k, backend=backend)


@pytest.mark.parametrize("factory", [
    lambda ix, **kw: ix.retriever(**kw), lambda ix, **kw: ix.np_retriever(**kw),
    lambda ix, **kw: ix.torch_retriever(**kw), lambda ix, **kw: ix.faiss_flat_retriever(**kw),
    lambda ix, **kw: ix.faiss_hnsw_retriever(**kw), lambda ix, **kw: ix.faiss_ivf_retriever(**kw),
    lambda ix, **kw: ix.scorer(**kw),
], ids=["retriever", "np", "torch", "flat", "hnsw", "ivf", "scorer"])
@pytest.mark.parametrize("num_results", [-1, 0, 10.0, "10"])
def test_every_retriever_factory_refuses_a_bad_num_results(small_index, factory, num_results):
    index, _ = small_index
    with pytest.raises(ValueError, match=r"num_results must be an integer >= 1, got"):
        factory(index, num_results=num_results)


@pytest.mark.parametrize("factory, option", [
    (lambda ix: ix.np_retriever(block_size=0), "block_size"),
    (lambda ix: ix.np_retriever(query_batch_size=-5), "query_batch_size"),
    (lambda ix: ix.torch_retriever(chunk_size=0), "block_size"),
    (lambda ix: ix.faiss_hnsw_retriever(ef_search=0), "ef_search"),
    (lambda ix: ix.faiss_hnsw_retriever(neighbours=1.5), "neighbours"),
    (lambda ix: ix.faiss_ivf_retriever(n_probe=0), "n_probe"),
    (lambda ix: ix.faiss_ivf_retriever(n_list=-3), "n_list"),
    (lambda ix: ix.faiss_flat_retriever(query_batch_size=0), "query_batch_size"),
])
def test_retrievers_refuse_bad_integer_options_when_created(small_index, factory, option):
    index, _ = small_index
    with pytest.raises(ValueError, match=rf"{option} must be an integer >= 1"):
        factory(index)


def test_search_kernel_options_are_checked(small_index):
    index, _ = small_index
    q = np.zeros((1, DIM), dtype=np.float32)
    with pytest.raises(ValueError, match="block_size must be an integer >= 1, got 0"):
        index.search(q, 5, backend="numpy", block_size=0)
    with pytest.raises(ValueError, match="chunk_size must be an integer >= 1, got 0"):
        index.search(q, 5, backend="torch", chunk_size=0)


def test_rank_cutoff_keeps_its_meaning(small_index):
    """``retriever % k`` is fused for 1 <= k < num_results and still matches the naive top k."""
    index, vecs = small_index
    topics = make_topics(3)
    for r in (index.np_retriever(num_results=20), index.faiss_flat_retriever(num_results=20)):
        assert_matches_naive((r % 7)(topics), topics, vecs, 7)
