"""``ExactRetriever``'s search options grouped in ``ExactOptions``: the flat keywords and factories still work, each
option lands in its group and reaches the store's search, and a retriever pickled with flat attributes still loads.

Reference: the top documents by a naive ``vectors @ query`` over all vectors."""
from __future__ import annotations

import pickle

import numpy as np
import pandas as pd
import pytest

from pyterrier_cpdae import DenseIndex
from pyterrier_cpdae.dense import ExactRetriever
from pyterrier_cpdae.dense.exact_retr import BatchOptions, ExactOptions, KernelOptions, MemoryOptions

FLAT = dict(backend="torch", device="cpu", precision="fp32", resident=False, pinned=None, block_size=7,
            query_batch_size=3)


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((60, 8)).astype("float32")
    ix = DenseIndex(tmp_path_factory.mktemp("exact") / "x.dense")
    ix.indexer().index({"docno": f"d{i}", "doc_vec": v} for i, v in enumerate(vecs))
    return ix, vecs


def naive_top(vecs, queries, k):
    return [[f"d{i}" for i in np.argsort(-(vecs @ q), kind="stable")[:k]] for q in queries]


def test_exact_options_group_every_keyword_and_round_trip():
    opts = ExactOptions.from_kwargs(**FLAT)
    assert opts.to_kwargs() == FLAT
    assert opts.kernel == KernelOptions(backend="torch", device="cpu", precision="fp32")
    assert opts.memory == MemoryOptions(resident=False, pinned=None)
    assert opts.batching == BatchOptions(block_size=7, query_batch_size=3)
    assert ExactOptions.from_kwargs(**opts.to_kwargs()) == opts and pickle.loads(pickle.dumps(opts)) == opts
    assert opts.search_kwargs() == dict(query_batch_size=3, device="cpu", chunk_size=7, resident=False,
                                        precision="fp32", pinned=None)
    assert ExactOptions.from_kwargs(block_size=16).search_kwargs() == {"block_size": 16}
    with pytest.raises(TypeError, match=r"unknown ExactRetriever option\(s\) \['chunk'\]"):
        ExactOptions.from_kwargs(chunk=3)


@pytest.mark.parametrize("kwargs, message", [
    (dict(backend="faiss"), "backend must be 'numpy' or 'torch'"),
    (dict(resident=True), "resident applies to backend='torch' only"),
    (dict(precision="fp16"), "precision applies to backend='torch' only"),
    (dict(precision="int4", backend="torch"), "precision must be one of"),
    (dict(pinned=True), "pinned applies to backend='torch' only"),
    (dict(backend="torch", pinned=True, resident=True), "pass one of them"),
    (dict(resident="yes", backend="torch"), "resident must be None, True or False"),
    (dict(backend="torch", block_size=0), "chunk_size must be an integer >= 1"),
    (dict(block_size=0), "block_size must be an integer >= 1")])
def test_bad_options_are_named(index, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ExactRetriever(index[0], **kwargs)


def test_old_keyword_calls_and_factories_still_work(index):
    ix, vecs = index
    queries = np.random.default_rng(1).standard_normal((5, 8)).astype("float32")
    topics = pd.DataFrame({"qid": [f"q{i}" for i in range(5)], "query_vec": list(queries)})
    expected = naive_top(vecs, queries, 4)
    for retr in (ExactRetriever(ix, num_results=4, **FLAT), ExactRetriever(ix, num_results=4, block_size=9),
                 ix.np_retriever(num_results=4, block_size=5, query_batch_size=2),
                 ix.torch_retriever(num_results=4, device="cpu", chunk_size=11, precision="fp32"),
                 ix.retriever(num_results=4)):
        res = retr(topics)
        assert [res[res.qid == f"q{i}"].sort_values("rank")["docno"].tolist() for i in range(5)] == expected, retr
    retr = ix.torch_retriever(num_results=4, device="cpu", chunk_size=11)
    assert (retr.backend, retr.device, retr.block_size, retr.query_batch_size, retr.precision, retr.resident,
            retr.pinned) == ("torch", "cpu", 11, 4096, "auto", None, None)  # each keyword is still an attribute
    assert retr.options.batching.block_size == 11


def test_equality_setting_and_pickling_go_through_the_options(index):
    ix, _ = index
    a, b = ExactRetriever(ix, num_results=4, **FLAT), ExactRetriever(ix, num_results=4, **FLAT)
    assert a == b and hash(a) == hash(b)
    b.block_size = 8
    assert a != b and b.options.batching.block_size == 8
    with pytest.raises(ValueError, match="chunk_size must be an integer >= 1"):
        b.block_size = -1
    assert pickle.loads(pickle.dumps(a)) == a
    # a retriever pickled before the options were grouped held them as flat attributes
    state = {k: v for k, v in a.__dict__.items() if k != "options"}
    state.update(a.options.to_kwargs())
    old = ExactRetriever.__new__(ExactRetriever)
    old.__setstate__(state)
    assert old == a and old.options == a.options
