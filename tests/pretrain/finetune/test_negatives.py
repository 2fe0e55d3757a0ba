"""Training-group handling: query selection/sampling, negative sampling, mining, groups files."""
from __future__ import annotations

import json
import logging

import numpy as np
import pandas as pd
import pytest

from pretrain.finetune import negatives as neg


def _topics_qrels():
    topics = pd.DataFrame({"qid": ["1", "2", "3", "4"], "query": ["a", "b", "c", "d"]})
    qrels = pd.DataFrame({"qid": ["1", "1", "2", "3", "9"], "docno": ["d1", "d2", "d3", "d4", "d5"],
                          "label": [1, 2, 0, 1, 1]})
    return topics, qrels


def test_select_queries_skips_and_counts_queries_without_positive(caplog):
    topics, qrels = _topics_qrels()
    with caplog.at_level(logging.WARNING, logger="pretrain.finetune.negatives"):
        kept, pos = neg.select_queries(topics, qrels)
    assert kept["qid"].tolist() == ["1", "3"]           # 2: only label 0; 4: no qrels
    assert pos == {"1": ["d1", "d2"], "3": ["d4"]}
    assert "skipped 2 of 4 training queries" in caplog.text


def test_select_queries_empty_is_an_error():
    topics, qrels = _topics_qrels()
    qrels["label"] = 0
    with pytest.raises(ValueError, match="no training query has a judged positive"):
        neg.select_queries(topics, qrels)


def test_sample_queries_reproducible_and_order_independent():
    qids = [str(i) for i in range(100)]
    a = neg.sample_queries(qids, 10, seed=3)
    assert len(a) == 10 and set(a) <= set(qids)
    assert neg.sample_queries(list(reversed(qids)), 10, seed=3) == a
    assert neg.sample_queries(qids, 10, seed=4) != a
    assert neg.sample_queries(qids, -1, seed=3) == sorted(qids)
    assert neg.sample_queries(qids, 500, seed=3) == sorted(qids)
    with pytest.raises(ValueError):
        neg.sample_queries(qids, 0, seed=3)


def _groups():
    texts = {f"d{i}": f"text {i}" for i in range(20)}
    groups = [neg.Group("q1", "query one", ["d0"], [f"d{i}" for i in range(1, 11)]),
              neg.Group("q2", "query two", ["d11", "d12"], ["d13", "d14"]),
              neg.Group("q3", "query three", ["d15"], [])]
    return groups, texts


def _rows(ds):
    cols = [c for c in ds.column_names if c.startswith("negative_")]
    return [(r["query"], [r["positive"]] + [r[c] for c in cols]) for r in ds]


def test_build_dataset_draws_reproducibly_and_per_query(caplog):
    groups, texts = _groups()
    with caplog.at_level(logging.WARNING, logger="pretrain.finetune.negatives"):
        a = _rows(neg.build_dataset(groups, 4, texts=texts, few_negatives="replace", seed=1))
    assert a == _rows(neg.build_dataset(groups, 4, texts=texts, few_negatives="replace", seed=1))
    assert len(a) == 2                                   # q3 has no candidate at all
    q, passages = a[0]
    assert q == "query one" and passages[0] == "text 0" and len(passages) == 5
    assert len(set(passages[1:])) == 4                   # without replacement when the pool is large enough
    assert set(passages[1:]) <= {texts[f"d{i}"] for i in range(1, 11)}
    q2 = a[1][1]
    assert q2[0] in ("text 11", "text 12") and set(q2[1:]) <= {"text 13", "text 14"} and len(q2) == 5
    assert "1 queries had fewer than 4 negatives (drawn with replacement), 1 none (dropped)" in caplog.text
    # a query's draw does not depend on the other queries
    assert _rows(neg.build_dataset(groups[:1], 4, texts=texts, seed=1)) == a[:1]
    seeds = {tuple(_rows(neg.build_dataset(groups[:1], 4, texts=texts, seed=s))[0][1]) for s in range(5)}
    assert len(seeds) > 1
    ds = neg.build_dataset(groups, 2, texts=texts, seed=1)
    assert ds.column_names == ["query", "positive", "negative_1", "negative_2"]


def test_build_dataset_drop_and_empty(caplog):
    groups, texts = _groups()
    with caplog.at_level(logging.WARNING, logger="pretrain.finetune.negatives"):
        out = _rows(neg.build_dataset(groups, 4, texts=texts, few_negatives="drop", seed=1))
    assert [q for q, _ in out] == ["query one"]
    assert "1 queries had fewer than 4 negatives (dropped)" in caplog.text
    with pytest.raises(ValueError, match="no training example left"):
        neg.build_dataset(groups[1:], 4, texts=texts, few_negatives="drop")


def test_build_dataset_names_unknown_positives_and_drops_unknown_negatives():
    texts = {"d1": "x", "d2": "y"}
    corpus = lambda: iter([{"docno": "d1", "text": "x"}, {"docno": "d2", "text": "y"}])  # noqa: E731
    with pytest.raises(ValueError, match="not in the corpus: zz9"):
        neg.build_dataset([neg.Group("q", "q", ["zz9"], ["d1"])], 1, corpus=corpus)
    out = _rows(neg.build_dataset([neg.Group("q", "q", ["d1"], ["d2", "nope"])], 2, corpus=corpus, texts=texts))
    assert out[0][1][1:] == ["y", "y"]


def test_pools_are_stored_as_parquet_and_reused_only_for_their_key(tmp_path, caplog):
    groups, _ = _groups()
    path = str(tmp_path / "negatives" / "round-0.parquet")
    neg.save_pools(path, groups, {"source": "bm25", "data": "a"})
    import pyarrow.parquet as pq
    assert pq.read_table(path).column_names == ["qid", "query", "pos", "negs"]
    assert neg.load_pools(path, {"source": "bm25", "data": "a"}) == groups
    with caplog.at_level(logging.WARNING, logger="pretrain.finetune.negatives"):
        assert neg.load_pools(path, {"source": "bm25", "data": "b"}) is None
    assert "made from other data" in caplog.text


def test_groups_file_roundtrip_and_inline_texts(tmp_path):
    groups, _ = _groups()
    path = tmp_path / "g" / "round-0.jsonl"
    neg.write_groups(str(path), groups)
    back, texts = neg.read_groups(str(path))
    assert back == groups and texts == {}
    inline = tmp_path / "inline.jsonl"
    inline.write_text(json.dumps({"qid": 7, "query": "q", "pos": {"text": "a positive"},
                                  "negs": [{"docno": "n1", "text": "neg one"}, {"text": "neg two"}, "d3"]}) + "\n")
    (g,), texts = neg.read_groups(str(inline))
    assert g.qid == "7" and texts[g.pos[0]] == "a positive" and g.pos[0].startswith(neg.TEXT_ID_PREFIX)
    assert g.negs[0] == "n1" and texts["n1"] == "neg one" and texts[g.negs[1]] == "neg two" and g.negs[2] == "d3"


def test_groups_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        neg.read_groups(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"qid": "1", "query": "q", "pos": ["a"], "negs": []}\n{"qid": "2", "pos": ["b"]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: missing key\(s\) \['query'\]"):
        neg.read_groups(str(bad))
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: not valid JSON"):
        neg.read_groups(str(bad))


def test_groups_from_docpairs():
    pairs = [("1", "p1", "n1"), ("1", "p1", "n2"), ("2", "p2", "n3"), ("3", "p3", "n4"), ("1", "p1", "n1")]
    groups = neg.groups_from_docpairs(pairs, {"1": "one", "2": "two"})
    assert groups == [neg.Group("1", "one", ["p1"], ["n1", "n2"]), neg.Group("2", "two", ["p2"], ["n3"])]


def test_mine_bm25_drops_positives_and_keeps_depth():
    calls = []

    def fake_bm25(topics: pd.DataFrame) -> pd.DataFrame:  # ranks d0..d9 for every query
        calls.append(len(topics))
        rows = [(q, f"d{r}", r) for q in topics["qid"] for r in range(10)]
        return pd.DataFrame(rows, columns=["qid", "docno", "rank"]).sample(frac=1.0, random_state=0)

    topics = pd.DataFrame({"qid": ["a", "b", "c"], "query": ["x", "y", "z"]})
    pools = neg.mine_bm25(fake_bm25, topics, {"a": ["d1"], "b": ["d7"], "c": []}, depth=5, chunk_size=2)
    assert calls == [2, 1]                                         # queries retrieved in chunks
    assert pools == {"a": ["d0", "d2", "d3", "d4"], "b": ["d0", "d1", "d2", "d3", "d4"],
                     "c": ["d0", "d1", "d2", "d3", "d4"]}


class _VecEncoder:
    """Queries are given as ids into a fixed matrix of query vectors."""

    def __init__(self, vecs):
        self.vecs = vecs

    def encode_queries(self, texts):
        return self.vecs[[int(t) for t in texts]]


def test_mine_dense_streams_through_dense_index_and_equals_full_scoring(tmp_path):
    import pyterrier_cpdae.dense as dense_index
    rng = np.random.default_rng(0)
    docs = rng.standard_normal((300, 8)).astype(np.float32)
    queries = rng.standard_normal((5, 8)).astype(np.float32)
    index = dense_index.DenseIndex(str(tmp_path / "idx"))
    index.indexer().index({"docno": f"doc{i}", "doc_vec": docs[i]} for i in range(len(docs)))
    calls = []
    search = index.search
    index_proxy = type("Proxy", (), {"docnos": index.docnos, "__len__": lambda self: len(index),
                                     "search": lambda self, v, k: calls.append(k) or search(v, k)})()
    topics = pd.DataFrame({"qid": [f"q{i}" for i in range(5)], "query": [str(i) for i in range(5)]})
    full = queries @ docs.T                                           # naive: every score
    positives = {f"q{i}": [f"doc{int(np.argmax(full[i]))}"] for i in range(5)}
    pools = neg.mine_dense(_VecEncoder(queries), index_proxy, topics, positives, depth=20, chunk_size=2)
    assert calls == [20, 20, 20]
    for i in range(5):
        ranked = [f"doc{j}" for j in np.argsort(-full[i], kind="stable")[:20]]
        assert pools[f"q{i}"] == [d for d in ranked if d not in positives[f"q{i}"]]
        assert len(pools[f"q{i}"]) == 19


def test_groups_from_docpairs_keeps_only_training_queries_and_caps_negatives():
    pairs = [("1", "p1", "n1"), ("2", "p2", "m1"), ("1", "p1", "n2"), ("1", "p1", "n3"), ("2", "p2", "m2")]
    groups = neg.groups_from_docpairs(iter(pairs), {"1": "one"}, max_negatives=2)  # the training queries' texts
    assert groups == [neg.Group("1", "one", ["p1"], ["n1", "n2"])]


class _Corpus:
    """A corpus callable that counts its passes and the texts it hands out."""

    def __init__(self, n: int):
        self.docs = [{"docno": f"d{i}", "text": f"text {i}"} for i in range(n)]
        self.passes = 0

    def __call__(self):
        self.passes += 1
        return iter(self.docs)


def test_build_dataset_equals_naive_sampling_and_reads_the_corpus_twice():
    corpus = _Corpus(400)
    full = {d["docno"]: d["text"] for d in corpus.docs}
    groups = [neg.Group(f"q{i}", f"query {i}", [f"d{i}"],
                        [f"d{j}" for j in range(100 + 50 * i, 150 + 50 * i)] + ["ghost-1", "ghost-2"])
              for i in range(5)]
    groups.append(neg.Group("q9", "few", ["d9"], ["d10", "ghost-3"]))       # 1 known negative: replaced
    # naive reference: the unknown ids dropped by hand, every text given
    known = [neg.Group(g.qid, g.query, g.pos, [d for d in g.negs if d in full]) for g in groups]
    naive = _rows(neg.build_dataset(known, 3, texts=full, seed=7))
    got = _rows(neg.build_dataset(groups, 3, corpus=corpus, seed=7))
    assert got == naive and corpus.passes == 2
    with pytest.raises(ValueError, match="no corpus"):
        neg.build_dataset([neg.Group("q", "q", ["d1"], [])], 0)
    assert _rows(neg.build_dataset([neg.Group("q", "q", ["a"], ["b"])], 1, texts={"a": "A", "b": "B"})) == \
        [("q", ["A", "B"])]


def test_mine_dense_memory_does_not_grow_with_the_corpus(tmp_path):
    """Peak traced memory of dense mining stays flat as the corpus grows 4x and below one full score matrix."""
    import tracemalloc

    import pyterrier_cpdae.dense as dense_index
    rng = np.random.default_rng(0)
    num_q, dim = 256, 16
    queries = rng.standard_normal((num_q, dim)).astype(np.float32)
    topics = pd.DataFrame({"qid": [f"q{i}" for i in range(num_q)], "query": [str(i) for i in range(num_q)]})
    peaks = {}
    for n in (20_000, 80_000):
        index = dense_index.DenseIndex(str(tmp_path / f"idx{n}"))
        docs = rng.standard_normal((n, dim)).astype(np.float32)
        index.indexer().index({"docno": f"d{i}", "doc_vec": docs[i]} for i in range(n))
        del docs
        tracemalloc.start()
        pools = neg.mine_dense(_VecEncoder(queries), index, topics, {}, depth=10)
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert all(len(p) == 10 for p in pools.values())
    full_scores = num_q * 80_000 * 4                 # what scoring every document at once would take
    assert peaks[80_000] < 1.3 * peaks[20_000] + (1 << 20)
    assert peaks[80_000] < full_scores, peaks
