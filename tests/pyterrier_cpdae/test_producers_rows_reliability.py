"""Whose vectors a row holds travels with the row: the stamp column ``query_vec_producer`` (``doc_vec_producer``) an
encoder adds beside its vectors survives merge, concat, ``DataFrame(records)``, ``DataFrame(df)``, new frames,
``apply``, ``transform_iter``, ``compile()``, fusion operators and pickling, and every place where vectors meet an
index checks it; a frame of two producers is refused naming both; the weights key follows any edit of the weights'
contents; vectors too small for their scores to be representable are refused.

References: the naive inner-product ranking of the encoder's own vectors; a fresh copy of an edited module (its
digest computed without any cache); the float32 normal range (2**-126) and float16's (2**-14)."""
from __future__ import annotations

import copy
import json
import pickle

import numpy as np
import pandas as pd
import pyterrier as pt
import pytest
import torch

from pyterrier_cpdae import CPDAE, DenseIndex

from tests.helpers.producers import TEXTS, TOPICS, enc as _enc
from tests.helpers.dense import vector_frame as _frame


@pytest.fixture(scope="module")
def setup(tmp_path_factory, two_encoders):
    """Encoders A and B; an index built by A; B's query frame."""
    a, b = _enc(two_encoders[0]), _enc(two_encoders[1])
    index = DenseIndex(tmp_path_factory.mktemp("rows") / "idx")
    (a >> index.indexer()).index([{"docno": f"d{i}", "text": t} for i, t in enumerate(TEXTS)])
    return a, b, index


def _naive(enc, query, k):
    """Independent reference: the encoder's own inner products (float64, rounded once to float32) sorted by hand,
    equal scores by ascending docid (the documented tie rule)."""
    scores = (enc.encode_docs(TEXTS).astype(np.float64) @ enc.encode_queries([query])[0].astype(np.float64))
    scores = scores.astype(np.float32)
    return [f"d{i}" for i in sorted(range(len(TEXTS)), key=lambda i: (-scores[i], i))[:k]]


def _new_frame(df):
    """A stage that builds a new frame of the same columns (no attrs, no index of the old one)."""
    return pd.DataFrame({c: df[c].tolist() for c in df.columns})


# -- class: the stamp travels with the rows ------------------------------------------------------------------------
def _b_frames(b):
    """B's query vectors after the steps that used to drop a frame-level stamp."""
    qv = b.query_encoder()(TOPICS)
    extra = pd.DataFrame({"qid": ["q1", "q2"], "lang": ["en", "en"]})
    return {
        "merge": qv.merge(extra, on="qid"),
        "DataFrame(records)": pd.DataFrame(qv.to_dict("records")),
        "DataFrame(df)": pd.DataFrame(qv),
        "a new frame": _new_frame(qv),
        "apply": qv.apply(lambda r: r, axis=1),
        "transform_iter": pd.DataFrame(list(b.query_encoder().transform_iter(TOPICS.to_dict("records")))),
        "pickle": pickle.loads(pickle.dumps(qv)),
        "copy": qv.copy(),
    }


def test_every_pandas_step_keeps_the_producer_and_every_retriever_checks_it(setup):
    a, b, index = setup
    retrievers = {"numpy": index.np_retriever(num_results=3), "torch": index.torch_retriever(num_results=3,
                                                                                           device="cpu"),
                  "faiss": index.faiss_flat_retriever(num_results=3), "index": index}
    for step, frame in _b_frames(b).items():
        for name, retr in retrievers.items():
            with pytest.raises(ValueError, match="weights") as info:
                retr(frame)
            assert str(index.path) in str(info.value), (step, name)
        with pytest.raises(ValueError, match="weights"):  # the scorer of a result frame
            index.scorer()(frame.assign(docno="d1"))
    for step, frame in _b_frames(a).items():  # the index's own encoder: searched, ranked as the naive reference
        got = index.np_retriever(num_results=3)(frame)
        assert got[got["qid"] == "q1"]["docno"].tolist() == _naive(a, "dense vector retrieval", 3), step


def test_every_pipeline_shape_checks_the_rows(setup):
    a, b, index = setup
    retr = index.np_retriever(num_results=5)
    new = pt.apply.generic(_new_frame)
    shapes = {
        "a stage that returns a new frame": lambda enc: enc.query_encoder() >> new >> retr,
        "retr + retr": lambda enc: enc.query_encoder() >> (retr + retr),
        "retr + retr after a new frame": lambda enc: enc.query_encoder() >> new >> (retr + retr),
        "retr | retr": lambda enc: enc.query_encoder() >> new >> (retr | retr),
        "scorer ** scorer": lambda enc: enc.query_encoder() >> retr.for_any_encoder() >> new
        >> (index.scorer() ** index.scorer()),
        "compile()": lambda enc: (enc.query_encoder() >> new >> retr % 2).compile(),
        "compile() direct": lambda enc: (enc.query_encoder() >> retr % 2).compile(),
        "index as transformer": lambda enc: enc.query_encoder() >> new >> index,
        "retr >> new frame >> scorer": lambda enc: enc.query_encoder() >> retr >> new >> index.scorer(),
    }
    for name, make in shapes.items():
        with pytest.raises(ValueError, match="weights"):
            make(b)(TOPICS)
        if name in ("a stage that returns a new frame", "compile()", "index as transformer"):
            with pytest.raises(ValueError, match="weights"):  # a list of dicts given to the pipeline
                make(b)(TOPICS.to_dict("records"))
        out = make(a)(TOPICS)
        assert len(out), name
    got = (a.query_encoder() >> new >> retr)(TOPICS)
    assert got[got["qid"] == "q2"]["docno"].tolist() == _naive(a, "ranking passages", 5)


def test_search_takes_a_rows_stamp(setup):
    a, b, index = setup
    qb = b.query_encoder()(TOPICS)
    with pytest.raises(ValueError, match="weights"):
        index.search(np.stack(qb["query_vec"]), 3, producer=qb["query_vec_producer"].iloc[0])
    qa = a.query_encoder()(TOPICS)
    _, ids = index.search(np.stack(qa["query_vec"]), 3, producer=qa["query_vec_producer"].iloc[0])
    assert index.store.docnos_of(ids[0]).tolist() == _naive(a, "dense vector retrieval", 3)


def test_the_stamp_is_the_producers_canonical_json(setup):
    from pyterrier_cpdae._producers import parse_stamp, stamp
    a, _, index = setup
    docs = a.doc_encoder()(pd.DataFrame({"docno": ["d0"], "text": [TEXTS[0]]}))
    assert docs["doc_vec_producer"].iloc[0] == stamp(a.producer())
    assert parse_stamp(docs["doc_vec_producer"].iloc[0], "x") == index.meta()["producer"]
    q = a.query_encoder()(TOPICS)
    assert json.loads(q["query_vec_producer"].iloc[0]) == dict(a.producer(), max_length=a.query_max_length)
    assert q["query_vec_producer"].nunique() == 1
    assert index.np_retriever(drop_query_vec=True)(q).columns.tolist() == ["qid", "query", "docno", "docid",
                                                                           "score", "rank"]


# -- class: mixed producers in one frame ---------------------------------------------------------------------------
def test_a_frame_of_two_producers_is_refused_naming_both(setup, two_encoders):
    a, b, index = setup
    mixed = pd.concat([a.query_encoder()(TOPICS.iloc[:1]), b.query_encoder()(TOPICS.iloc[1:])], ignore_index=True)
    for retr in (index.np_retriever(num_results=3), index, index.faiss_flat_retriever(num_results=3)):
        with pytest.raises(ValueError, match="more than one producer") as info:
            retr(mixed)
        msg = str(info.value)
        assert "'q1'" in msg and "'q2'" in msg and two_encoders[0] in msg and two_encoders[1] in msg
    with pytest.raises(ValueError, match="more than one producer"):
        index.scorer()(mixed.assign(docno="d1"))
    with pytest.raises(ValueError, match="more than one producer"):  # also against an index of vectors from anywhere
        raw = DenseIndex(index.path.parent / "raw")
        if not raw.built():
            raw.indexer().index(pd.DataFrame({"docno": ["x", "y"], "doc_vec": list(np.eye(2, 16, dtype="f4"))}))
        raw.np_retriever(num_results=1)(mixed)
    # stamped rows beside rows of unknown origin: no one producer either
    plain = pd.DataFrame({"qid": ["q9"], "query": ["x"], "query_vec": [np.ones(16, "f4")]})
    with pytest.raises(ValueError, match="no known encoder"):
        index.np_retriever(num_results=3)(pd.concat([a.query_encoder()(TOPICS), plain], ignore_index=True))
    # one encoder's queries cut at two lengths are one producer's vectors (the query length is not the index's)
    two_lengths = pd.concat([a.query_encoder()(TOPICS.iloc[:1]),
                             _enc(two_encoders[0], query_max_length=8).query_encoder()(TOPICS.iloc[1:])])
    assert two_lengths["query_vec_producer"].nunique() == 2
    assert len(index.np_retriever(num_results=2)(two_lengths)) == 4


def test_vectors_without_a_stamp_are_searched_as_before(setup):
    a, b, index = setup
    plain = b.query_encoder()(TOPICS).drop(columns="query_vec_producer")
    assert len(index.np_retriever(num_results=2)(plain)) == 4  # documented: made outside the plugin
    bad = b.query_encoder()(TOPICS).assign(query_vec_producer="not a stamp")
    with pytest.raises(ValueError, match="query_vec_producer of qid 'q1' holds 'not a stamp'"):
        index.np_retriever(num_results=2)(bad)


# -- class: the weights key is a digest of the contents -------------------------------------------------------------
def test_swapping_two_embedding_rows_in_place_changes_the_weights_key_and_the_producer(tmp_path, two_encoders):
    from pyterrier_cpdae.encoder.identity import content_digest, weights_key
    enc = _enc(two_encoders[0])
    index = DenseIndex(tmp_path / "idx")
    (enc >> index.indexer()).index([{"docno": f"d{i}", "text": t} for i, t in enumerate(TEXTS)])
    before, key = enc.producer(), weights_key(enc.model)
    emb = enc.model.embeddings.word_embeddings.weight
    ids = enc.tokenizer("dense vector retrieval", add_special_tokens=False)["input_ids"]
    i, j = ids[0], ids[1]
    version, total = emb._version, float(emb.detach().double().sum())
    emb.data[[i, j]] = emb.data[[j, i]].clone()  # in place, unseen by the version counter, the same sum
    assert emb._version == version and float(emb.detach().double().sum()) == total
    assert weights_key(enc.model) != key
    after = enc.producer()
    assert after["weights_content"] != before["weights_content"]
    assert after["weights_content"] == content_digest(copy.deepcopy(enc.model))  # a fresh module: no cache
    assert after["weights_sha256"] != before["weights_sha256"]  # no longer the file's weights
    with pytest.raises(ValueError, match="weights"):  # the edited encoder's queries: another producer's
        (enc.query_encoder() >> index.np_retriever(num_results=2))(TOPICS)
    emb.data[[i, j]] = emb.data[[j, i]].clone()  # swapped back: the original weights, the original producer
    assert enc.producer() == before and weights_key(enc.model) == key


def test_the_weights_key_is_equal_for_equal_contents_only(two_encoders):
    from pyterrier_cpdae.encoder.identity import weights_key
    from pyterrier_cpdae.encoder.loading import load_encoder
    m0, m0b, m1 = load_encoder(two_encoders[0]), load_encoder(two_encoders[0]), load_encoder(two_encoders[1])
    assert weights_key(m0) == weights_key(m0b) != weights_key(m1)
    for dtype in (torch.float16, torch.bfloat16):  # every dtype is read as its stored bytes
        half = copy.deepcopy(m0).to(dtype)
        k = weights_key(half)
        w = half.encoder.layer[0].output.dense.weight
        w.data[0, 0], w.data[0, 1] = w.data[0, 1].clone(), w.data[0, 0].clone()
        assert weights_key(half) != k


# -- class: vectors whose scores underflow ---------------------------------------------------------------------------
def test_vectors_of_norm_1e_23_are_refused_at_indexing_and_search(tmp_path):
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((6, 8)).astype("f4")
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    tiny = vecs.copy()
    tiny[2] *= 1e-23
    with pytest.raises(ValueError, match=r"docno\(s\) 'd2' \(norm 1e-23\) fall\(s\) below the smallest norm"):
        DenseIndex(tmp_path / "tiny").indexer().index(_frame(tiny))
    assert not DenseIndex(tmp_path / "tiny").built()
    # the example: a query of that norm against documents of that norm scores 1e-46, which float32 rounds to 0
    assert np.float32(1e-23) * np.float32(1e-23) == 0
    index = DenseIndex(tmp_path / "ok")
    index.indexer().index(_frame(vecs))
    q = pd.DataFrame({"qid": ["q1", "q2"], "query_vec": [vecs[0], vecs[1] * 1e-23]})
    for retr in (index.np_retriever(num_results=2), index.torch_retriever(num_results=2, device="cpu"),
                 index.faiss_flat_retriever(num_results=2), index):
        with pytest.raises(ValueError, match=r"qid\(s\) 'q2' \(norm 1e-23\)"):
            retr(q)
    with pytest.raises(ValueError, match=r"row\(s\) 1 \(norm 1e-23\)"):
        index.search(np.stack(q["query_vec"]), 2)
    with pytest.raises(ValueError, match="become zero in float32"):  # float64, below float32's subnormals
        index.search(np.array([vecs[0], vecs[1].astype(np.float64) * 1e-50]), 2)
    # zeros score exactly 0 against everything: kept, ranked by the tie rule
    zeros = vecs.copy()
    zeros[3] = 0
    DenseIndex(tmp_path / "zeros").indexer().index(_frame(zeros))


def test_the_smallest_norm_is_two_to_the_minus_63(tmp_path):
    """The bound derived in docs: norms in [2**-63, 2**63] make |q||d| lie in float32's normal range."""
    from pyterrier_cpdae.dense.format import MAX_NORM, MIN_NORM
    assert MIN_NORM * MIN_NORM == np.finfo(np.float32).tiny == 2.0 ** -126  # the smallest normal float32
    assert MAX_NORM * MIN_NORM == 1.0
    e = np.zeros(4, dtype="f4")
    ok, low = e.copy(), e.copy()
    ok[0], low[0] = np.float32(2.0 ** -63), np.nextafter(np.float32(2.0 ** -63), np.float32(0))
    DenseIndex(tmp_path / "ok").indexer().index(_frame([ok, np.ones(4, "f4")]))
    with pytest.raises(ValueError, match="'d0'"):
        DenseIndex(tmp_path / "low").indexer().index(_frame([low, np.ones(4, "f4")]))


def test_vectors_too_small_for_float16_storage_are_refused(tmp_path):
    rng = np.random.default_rng(1)
    vecs = rng.standard_normal((4, 384)).astype("f4")
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    index = DenseIndex(tmp_path / "ok")
    index.indexer(dtype="float16").index(_frame(vecs))  # unit vectors: float16 keeps them
    small = vecs.copy()
    small[1] *= 1e-6  # components ~5e-8: below float16's smallest subnormal (6e-8), stored as (nearly) zero
    stored = small[1].astype(np.float16).astype(np.float64)
    assert np.linalg.norm(stored - small[1]) > 0.3 * np.linalg.norm(small[1])  # what float16 keeps of them
    with pytest.raises(ValueError, match=r"'d1' \(norm 1e-06, off by .* in float16\) is too small for float16"):
        DenseIndex(tmp_path / "small").indexer(dtype="float16").index(_frame(small))
    DenseIndex(tmp_path / "f32").indexer().index(_frame(small))  # float32 storage keeps them


# -- the indexer reads the rows' stamp too ---------------------------------------------------------------------------
def _docs():
    return pd.DataFrame({"docno": [f"d{i}" for i in range(len(TEXTS))], "text": TEXTS})


def test_the_indexer_records_and_checks_the_rows_producer(tmp_path, setup, two_encoders):
    a, b, _ = setup
    docs_a, docs_b = a.doc_encoder()(_docs()), b.doc_encoder()(_docs())
    # vectors encoded earlier, saved as records and indexed later: the index records their producer
    later = DenseIndex(tmp_path / "later")
    later.indexer().index(pd.DataFrame(pickle.loads(pickle.dumps(docs_a.to_dict("records")))))
    assert later.meta()["producer"] == a.producer()
    with pytest.raises(ValueError, match="weights"):  # so B's queries are refused there too
        (b.query_encoder() >> later.np_retriever(num_results=2))(TOPICS)
    # half of A's documents and half of B's: refused naming both, before anything is written
    mixed = pd.concat([docs_a.iloc[:6], docs_b.iloc[6:]], ignore_index=True)
    for name, feed in (("frame", mixed), ("records", mixed.to_dict("records"))):
        with pytest.raises(ValueError, match="more than one producer") as info:
            DenseIndex(tmp_path / f"mixed_{name}").indexer(batch_size=4).index(feed)
        msg = str(info.value)  # a frame is checked whole; a stream batch by batch (d4-d7: A's d4, B's d6)
        assert f"'d{0 if name == 'frame' else 4}'" in msg and "'d6'" in msg
        assert two_encoders[0] in msg and two_encoders[1] in msg
        assert not DenseIndex(tmp_path / f"mixed_{name}").built()
    # B's vectors into an indexer told they are A's
    with pytest.raises(ValueError, match="weights"):
        DenseIndex(tmp_path / "told").indexer(producer=a).index(docs_b)
    # a shard of A's pipeline and one of B's stamped vectors: refused when the second shard starts
    sharded = DenseIndex(tmp_path / "sharded")
    (a >> sharded.indexer(shard=0, num_shards=2)).index(_docs().to_dict("records"))
    with pytest.raises(ValueError, match="shard 1 was encoded by"):
        sharded.indexer(shard=1, num_shards=2).index(docs_b)
    # unstamped vectors: indexed as before, no producer recorded
    plain = DenseIndex(tmp_path / "plain")
    plain.indexer().index(docs_b.drop(columns="doc_vec_producer"))
    assert "producer" not in plain.meta()
