"""DenseIndex in PyTerrier pipelines: any text loader re-ranks, the index is a
``pt.Indexer``/transformer like pyterrier-dr's ``FlexIndex``, and ``meta()``/``metadata()`` mean the same for the
dense and the BM25 index.

The re-ranking tests compare with scores computed by hand here: the dot product of the encoder's own query and
document vectors (``encode_queries`` / ``encode_docs`` of the texts this file holds).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyterrier as pt
import pytest

from pyterrier_cpdae import CPDAE, BM25Index, DenseIndex
from pyterrier_cpdae.dense.format import IncompleteIndexError

DOCS = [
    {"docno": "a", "text": "apple banana cherry"},
    {"docno": "b", "text": "apple apple apple grape"},
    {"docno": "c", "text": "banana lemon mango grape lemon peach"},
    {"docno": "d", "text": "cherry cherry pie with cream"},
    {"docno": "e", "text": "mango smoothie and banana bread"},
    {"docno": "f", "text": "grape juice is purple"},
    {"docno": "g", "text": "lemon tart and apple pie"},
]
TEXT = {d["docno"]: d["text"] for d in DOCS}
TOPICS = pd.DataFrame({"qid": ["1", "2", "3"], "query": ["apple pie", "banana mango", "grape lemon"]})


class DictTextLoader(pt.Transformer):
    """Any text loader: adds ``text`` for ``docno`` from a dict (stands in for ``dataset.text_loader()``)."""

    def __init__(self, texts: dict):
        self.texts = texts

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        return inp.assign(text=[self.texts[d] for d in inp["docno"]])


@pytest.fixture(scope="module")
def enc(tiny_bert_dir):
    return CPDAE.from_pretrained(tiny_bert_dir, dtype="float32")


@pytest.fixture(scope="module")
def dense(enc, tmp_path_factory):
    index = DenseIndex(tmp_path_factory.mktemp("dense") / "ix")
    built = (enc >> index).index(DOCS)  # DenseIndex is a pt.Indexer: the default indexer builds it
    assert built is index and index.built() and len(index) == len(DOCS)
    return index


@pytest.fixture(scope="module")
def bm25(tmp_path_factory):
    index = BM25Index(tmp_path_factory.mktemp("bm25") / "ix")
    index.indexer(threads=1).index(DOCS)
    return index


def assert_rescored_by_hand(res: pd.DataFrame, enc: CPDAE, expected_pairs: pd.DataFrame) -> None:
    """``res`` holds exactly the (qid, docno) pairs of ``expected_pairs``, scored with the dot product of the
    encoder's vectors of the query and document texts, and ranked by that score per query."""
    assert sorted(zip(res["qid"], res["docno"])) == sorted(zip(expected_pairs["qid"], expected_pairs["docno"]))
    queries = dict(zip(TOPICS["qid"], TOPICS["query"]))
    for qid, r in res.groupby("qid"):
        q = enc.encode_queries([queries[qid]])[0].astype(np.float64)
        d = enc.encode_docs([TEXT[x] for x in r["docno"]]).astype(np.float64)
        hand = d @ q
        np.testing.assert_allclose(r["score"].to_numpy(), hand, rtol=1e-5, atol=1e-5)
        assert list(r.sort_values("rank")["docno"]) == list(r["docno"].to_numpy()[np.argsort(-hand, kind="stable")])
        assert sorted(r["rank"]) == list(range(len(r)))


def test_bm25_then_its_text_loader_then_text_scorer(bm25, enc):
    first = bm25.bm25(num_results=4)(TOPICS)
    assert "text" not in first.columns and len(first)
    res = (bm25.bm25(num_results=4) >> bm25.text_loader() >> enc.text_scorer())(TOPICS)
    assert list(res["text"]) == [TEXT[d] for d in res["docno"]]
    assert_rescored_by_hand(res, enc, first)


@pytest.mark.parametrize("drop_query_vec", [False, True])
def test_dense_retriever_then_any_text_loader_then_text_scorer(dense, enc, drop_query_vec):
    """With ``query_vec`` kept the scorer reuses it; dropped, it encodes the ``query`` text again."""
    retrieve = enc >> dense.retriever(num_results=5, drop_query_vec=drop_query_vec)
    first = retrieve(TOPICS)
    res = (retrieve >> DictTextLoader(TEXT) >> enc.text_scorer())(TOPICS)
    assert ("query_vec" in res.columns) is not drop_query_vec
    assert_rescored_by_hand(res, enc, first)
    # the index holds this encoder's vectors: re-encoding the text gives the retriever's scores again
    merged = first.merge(res, on=["qid", "docno"], suffixes=("_index", "_text"))
    np.testing.assert_allclose(merged["score_text"], merged["score_index"], rtol=1e-5, atol=1e-5)


def test_dense_retriever_then_bm25_text_loader(dense, bm25, enc):
    """A text loader of another index (here BM25's stored text) works after the dense retriever too."""
    first = (enc >> dense.retriever(num_results=3))(TOPICS)
    res = (enc >> dense.retriever(num_results=3) >> bm25.text_loader() >> enc.text_scorer())(TOPICS)
    assert_rescored_by_hand(res, enc, first)


def test_dense_index_is_an_indexer_and_a_transformer(dense, enc):
    assert dense.index_inputs() == [["docno", "doc_vec"]] == dense.indexer().index_inputs()
    assert pt.inspect.indexer_inputs(dense) == [["docno", "doc_vec"]]
    topics = enc.query_encoder()(TOPICS)
    pd.testing.assert_frame_equal((enc >> dense)(TOPICS), dense.retriever()(topics))  # query frame: retrieval
    res = dense.np_retriever(num_results=3)(topics)
    pd.testing.assert_frame_equal(dense(res), dense.scorer()(res))  # result frame: re-scoring
    with pytest.raises(FileExistsError):
        dense.index(DOCS)  # mode="create"


def test_meta_and_metadata_mean_the_same_for_both_indexes(dense, bm25, tmp_path):
    for index in (dense, bm25):
        meta = index.meta()
        assert meta == index.metadata() == json.loads((Path(index.path) / "pt_meta.json").read_text())
        assert meta["num_docs"] == len(index) == len(DOCS)
        assert (meta["type"], meta["format"], meta["package_hint"]) == (
            index.ARTIFACT_TYPE, index.ARTIFACT_FORMAT, "pyterrier-cpdae")
    for unbuilt in (DenseIndex(tmp_path / "none-dense"), BM25Index(tmp_path / "none-bm25")):
        for method in (unbuilt.meta, unbuilt.metadata):
            with pytest.raises(IncompleteIndexError) as info:
                method()
            assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, RuntimeError)


def test_dense_meta_written_before_num_docs_still_reads(dense, tmp_path):
    """Indexes written before ``num_docs`` was stored get it from ``count``; a contradicting one is corrupt."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(dense.path, old)
    meta = json.loads((old / "pt_meta.json").read_text())
    del meta["num_docs"]
    (old / "pt_meta.json").write_text(json.dumps(meta))
    assert DenseIndex(old).meta()["num_docs"] == len(DOCS)
    meta["num_docs"] = 3
    (old / "pt_meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="num_docs=3 differs from count=7"):
        DenseIndex(old).meta()
