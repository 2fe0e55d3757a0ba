"""An artifact's parts come from one producer, and merge_shards names the missing or duplicated
shard: a dense index records the encoder that made its vectors, and shards or indexes of two encoders
of the same dimension are refused when put together, naming both encoders and the part."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pandas as pd
import pytest

from pyterrier_cpdae import DenseIndex
from tests.helpers.producers import enc as _enc

TEXTS = [f"document {i} about {w} and {v}" for i, (w, v) in enumerate(
    zip("dense sparse lexical neural vector index query model token corpus passage ranking".split() * 2,
        "retrieval search encoding scoring learning pooling storage batching".split() * 3))]


def _docs():
    return [{"docno": f"d{i}", "text": t} for i, t in enumerate(TEXTS)]


def test_producer_is_recorded_by_the_pipeline(tmp_path, two_encoders):
    enc = _enc(two_encoders[0])
    index = DenseIndex(tmp_path / "idx")
    (enc >> index.indexer()).index(_docs())
    rec = index.meta()["producer"]
    assert rec == enc.producer()
    assert rec["pooling"] == "cls" and rec["normalize"] is False and rec["max_length"] == 32
    assert rec["dtype"] == "float32" and rec["dim"] == 16 and rec["model"] == two_encoders[0]
    # the digest is that of the weights file (independent reference: hashlib over the file)
    import hashlib
    with open(os.path.join(two_encoders[0], "model.safetensors"), "rb") as f:
        assert rec["weights_sha256"] == hashlib.sha256(f.read()).hexdigest()[:16]
    # the doc_encoder stage records it too; an encoder's settings are part of it
    index2 = DenseIndex(tmp_path / "idx2")
    (_enc(two_encoders[0], normalize=True).doc_encoder() >> index2.indexer()).index(_docs())
    assert index2.meta()["producer"]["normalize"] is True
    # an index of vectors from anywhere records none (as before)
    vecs = DenseIndex(tmp_path / "raw")
    vecs.indexer().index(pd.DataFrame({"docno": ["a", "b"], "doc_vec": list(np.eye(2, dtype="float32"))}))
    assert "producer" not in vecs.meta()


def test_shards_of_two_encoders_are_refused_at_the_last_shard(tmp_path, two_encoders):
    a, b = _enc(two_encoders[0]), _enc(two_encoders[1])
    index = DenseIndex(tmp_path / "idx")
    (a >> index.indexer(shard=0, num_shards=2)).index(_docs())
    with pytest.raises(ValueError) as info:
        (b >> index.indexer(shard=1, num_shards=2)).index(_docs())
    msg = str(info.value)
    assert "shard 1" in msg and "shard 0" in msg and "weights_sha256" in msg
    assert two_encoders[0] in msg and two_encoders[1] in msg
    assert not index.built()  # no searchable view of mixed vectors
    # with the same encoder the view is built and records it
    (a >> index.indexer(shard=1, num_shards=2, mode="overwrite")).index(_docs())
    assert index.built() and index.meta()["producer"] == a.producer()


def test_rebuilding_every_shard_with_a_new_encoder_by_overwrite_works(tmp_path, two_encoders):
    """mode='overwrite' of one shard may start a rebuild with a new encoder: the view waits for the others."""
    a, b = _enc(two_encoders[0]), _enc(two_encoders[1])
    index = DenseIndex(tmp_path / "idx")
    for s in (0, 1):
        (a >> index.indexer(shard=s, num_shards=2)).index(_docs())
    assert index.meta()["producer"] == a.producer()
    with pytest.warns(UserWarning, match="shard 1 was encoded by"):
        (b >> index.indexer(shard=0, num_shards=2, mode="overwrite")).index(_docs())
    assert not index.built()  # never a searchable view of both encoders
    with pytest.raises(ValueError, match="shard 1 was encoded by"):
        index.merge_shards()
    (b >> index.indexer(shard=1, num_shards=2, mode="overwrite")).index(_docs())
    assert index.built() and index.meta()["producer"] == b.producer()


def test_last_shard_check_also_holds_when_shards_are_built_concurrently(tmp_path, two_encoders):
    """The early check sees no sibling when both shards start at once: the view is refused when it is written."""
    from pyterrier_cpdae.dense import indexing
    a, b = _enc(two_encoders[0]), _enc(two_encoders[1])
    index = DenseIndex(tmp_path / "idx")
    (a >> index.indexer(shard=0, num_shards=2)).index(_docs())
    meta0 = index.store.path / "shards" / "0"
    hidden = tmp_path / "hidden0"
    shutil.move(meta0, hidden)  # shard 0 invisible while shard 1 starts, as if both ran at once
    (b >> index.indexer(shard=1, num_shards=2)).index(_docs())
    shutil.move(hidden, meta0)
    with pytest.raises(ValueError, match="shard 1 was encoded by"):
        indexing.write_sharded_meta_if_complete(index.store.path, 2)
    assert not index.built()


def test_merge_shards_refuses_shards_of_two_encoders(tmp_path, two_encoders):
    a, b = _enc(two_encoders[0]), _enc(two_encoders[1])
    index = DenseIndex(tmp_path / "idx")
    (a >> index.indexer(shard=0, num_shards=2)).index(_docs())
    (a >> index.indexer(shard=1, num_shards=2)).index(_docs())
    assert index.built()
    other = DenseIndex(tmp_path / "other")
    (b >> other.indexer(shard=1, num_shards=2)).index(_docs())
    shutil.rmtree(index.store.path / "shards" / "1")  # shard 1 replaced by another encoder's (copied in)
    shutil.copytree(other.store.path / "shards" / "1", index.store.path / "shards" / "1")
    with pytest.raises(ValueError, match=r"shard 1 was encoded by .*weights_sha256"):
        index.merge_shards()
    assert index.meta()["layout"] == "sharded"  # nothing merged


def test_dense_index_merge_refuses_indexes_of_two_encoders(tmp_path, two_encoders):
    a, b = _enc(two_encoders[0]), _enc(two_encoders[1])
    docs = _docs()
    first, second = DenseIndex(tmp_path / "first"), DenseIndex(tmp_path / "second")
    (a >> first.indexer()).index(docs[:10])
    (b >> second.indexer()).index(docs[10:])
    with pytest.raises(ValueError) as info:
        DenseIndex.merge([first, second], tmp_path / "merged")
    msg = str(info.value)
    assert str(first.path) in msg and str(second.path) in msg and two_encoders[1] in msg
    assert not DenseIndex(tmp_path / "merged").built()
    # another max length is another producer too
    third = DenseIndex(tmp_path / "third")
    (_enc(two_encoders[0], doc_max_length=16) >> third.indexer()).index(docs[10:])
    with pytest.raises(ValueError, match="max_length"):
        DenseIndex.merge([first, third], tmp_path / "merged2")
    # the same encoder merges, and the merged index keeps the producer
    fourth = DenseIndex(tmp_path / "fourth")
    (a >> fourth.indexer()).index(docs[10:])
    merged = DenseIndex.merge([first, fourth], tmp_path / "merged3")
    assert merged.meta()["producer"] == a.producer() and len(merged) == len(docs)


def test_explicit_producer_and_resume(tmp_path, two_encoders):
    a, b = _enc(two_encoders[0]), _enc(two_encoders[1])
    vecs = a.encode_docs(TEXTS)
    frame = pd.DataFrame({"docno": [f"d{i}" for i in range(len(TEXTS))], "doc_vec": list(vecs)})
    index = DenseIndex(tmp_path / "idx")
    index.indexer(producer=a).index(frame)
    assert index.meta()["producer"] == a.producer()
    named = DenseIndex(tmp_path / "named")
    named.indexer(producer="my-encoder-v2").index(frame)
    assert named.meta()["producer"] == {"name": "my-encoder-v2"}
    with pytest.raises(ValueError, match="producer must be"):
        DenseIndex(tmp_path / "bad").indexer(producer=[1, 2])
    # a resume by another encoder is refused before anything is encoded
    state = {"format_version": 1, "dim": 16, "dtype": "float32", "count": 0, "vec_bytes": 0, "docno_bytes": 0,
             "shard": None, "num_shards": None, "presharded": False, "producer": a.producer()}
    part = tmp_path / "part"
    part.mkdir()
    import json
    (part / "_build.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match="this resume was encoded by"):
        (b >> DenseIndex(part).indexer(mode="resume")).index(_docs())


def test_a_shard_without_a_producer_beside_one_with_is_refused(tmp_path, two_encoders):
    a = _enc(two_encoders[0])
    vecs = a.encode_docs(TEXTS)
    index = DenseIndex(tmp_path / "idx")
    (a >> index.indexer(shard=0, num_shards=2)).index(_docs())
    frame = pd.DataFrame({"docno": [f"d{i}" for i in range(len(TEXTS))], "doc_vec": list(vecs)})
    with pytest.raises(ValueError, match="records no producer"):
        index.indexer(shard=1, num_shards=2).index(frame)


# -- class 6: merge_shards names the missing or duplicated shard ---------------------------------------------------
def _three_shards(tmp_path):
    rng = np.random.default_rng(0)
    frame = pd.DataFrame({"docno": [f"d{i}" for i in range(20)],
                          "doc_vec": list(rng.standard_normal((20, 8)).astype("float32"))})
    index = DenseIndex(tmp_path / "idx")
    index.indexer(shard=0, num_shards=3).index(frame)
    index.indexer(shard=1, num_shards=3).index(frame)
    return index, frame


def test_merge_shards_names_a_missing_shard(tmp_path):
    index, _ = _three_shards(tmp_path)
    with pytest.raises(ValueError) as info:
        index.merge_shards()
    msg = str(info.value)
    assert "shard 2 is missing" in msg and "num_shards=3" in msg
    assert f"pid {os.getpid()}" not in msg and "being built" not in msg


def test_merge_shards_names_a_duplicated_shard(tmp_path):
    index, _ = _three_shards(tmp_path)
    shutil.copytree(index.store.path / "shards" / "1", index.store.path / "shards" / "2")
    with pytest.raises(ValueError) as info:
        index.merge_shards()
    msg = str(info.value)
    assert "shard 2 is a copy of shard 1" in msg and "being built" not in msg


def test_a_copied_shard_in_a_built_view_is_named(tmp_path):
    index, frame = _three_shards(tmp_path)
    index.indexer(shard=2, num_shards=3).index(frame)
    assert index.built()
    shards = index.store.path / "shards"
    shutil.rmtree(shards / "2")
    shutil.copytree(shards / "1", shards / "2")
    with pytest.raises(ValueError, match="shard 2 is a copy of shard 1"):
        index.merge_shards()
    with pytest.raises(ValueError, match="shard 2 is a copy of shard 1"):
        DenseIndex(index.path).retriever()(pd.DataFrame({"qid": ["q"], "query": ["x"],
                                                         "query_vec": [np.ones(8, "float32")]}))


# -- a query encoder is checked against the producer of the index it searches -----------------------------------
def _naive_top(doc_vecs, query_vec, k):
    """Independent reference: the inner products sorted by hand."""
    scores = doc_vecs @ query_vec
    return [f"d{i}" for i in sorted(range(len(scores)), key=lambda i: -scores[i])[:k]]


def test_searching_with_another_encoders_queries_is_refused(tmp_path, two_encoders):
    a, b = _enc(two_encoders[0]), _enc(two_encoders[1])
    index = DenseIndex(tmp_path / "idx")
    (a >> index.indexer()).index(_docs())
    topics = pd.DataFrame({"qid": ["q1"], "query": ["dense retrieval of passages"]})
    # the same encoder: searched, and the ranking is the naive one over its own vectors
    res = (a.query_encoder() >> index.np_retriever(num_results=5))(topics)
    qv = a.encode_queries(["dense retrieval of passages"])[0]
    assert list(res["docno"]) == _naive_top(a.encode_docs(TEXTS), qv, 5)
    # another encoder's weights: refused at composition, naming the index, both models and the field
    for compose in (lambda r: b.query_encoder() >> r, lambda r: b >> r):
        with pytest.raises(ValueError) as info:
            compose(index.np_retriever())
        msg = str(info.value)
        assert str(index.path) in msg and "weights_sha256" in msg
        assert two_encoders[0] in msg and two_encoders[1] in msg and "for_any_encoder" in msg
    with pytest.raises(ValueError, match="weights_sha256"):
        b.query_encoder() >> index.scorer()
    # the same weights pooled otherwise: refused, naming the pooling only
    with pytest.raises(ValueError) as info:
        _enc(two_encoders[0], pooling="mean").query_encoder() >> index.np_retriever()
    assert "differ in pooling)" in str(info.value)
    # neither the document length, the dtype nor the query normalisation changes which documents rank first
    _enc(two_encoders[0], doc_max_length=16, normalize=True).query_encoder() >> index.np_retriever()
    # on purpose: an asymmetric pair searches
    out = (b.query_encoder() >> index.np_retriever(num_results=3).for_any_encoder())(topics)
    assert len(out) == 3


def test_the_query_encoder_check_waits_for_the_index_and_follows_rebuilds(tmp_path, two_encoders):
    a, b = _enc(two_encoders[0]), _enc(two_encoders[1])
    index = DenseIndex(tmp_path / "idx")
    topics = pd.DataFrame({"qid": ["q1"], "query": ["vector index"]})
    pipe = b.query_encoder() >> (index.np_retriever(num_results=3) % 2)  # composed before the index exists
    (a >> index.indexer()).index(_docs())
    with pytest.raises(ValueError, match="weights_sha256"):
        pipe(topics)
    with pytest.raises(ValueError, match="weights_sha256"):  # built: refused at composition already
        b.query_encoder() >> index.np_retriever(num_results=3)
    (b >> index.indexer(mode="overwrite")).index(_docs())  # rebuilt by b: b's queries search it
    ok = b.query_encoder() >> index.np_retriever(num_results=3)
    assert len(ok(topics)) == 3 and len(pipe(topics)) == 2
    (a >> index.indexer(mode="overwrite")).index(_docs())  # rebuilt by a: the same pipeline now refuses
    with pytest.raises(ValueError, match="weights_sha256"):
        ok(topics)
    # an index of vectors from anywhere records no producer: nothing to check
    raw = DenseIndex(tmp_path / "raw")
    raw.indexer().index(pd.DataFrame({"docno": [f"d{i}" for i in range(4)],
                                      "doc_vec": list(np.random.default_rng(0).normal(size=(4, 16)).astype("f4"))}))
    assert len((b.query_encoder() >> raw.np_retriever(num_results=2))(topics)) == 2
