"""Tests of the CPDAE encoder against naive one-text-at-a-time computations and sentence-transformers."""
from __future__ import annotations

import random

import numpy as np
import pandas as pd
import pyterrier as pt
import pytest
import torch
from transformers import AutoModel, AutoTokenizer, BertForMaskedLM

from pyterrier_cpdae.encoder import CPDAE

WORDS = ("retrieval dense encoder query document vector bag of words reconstruction contrastive masked language "
         "model pre training corpus token river apple ocean planet").split()


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny models on a shared 2-core machine run far faster on one thread (no OpenMP spin-waits)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _texts(n: int, seed: int = 0, max_words: int = 40) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words))) for _ in range(n)]


def _naive(path: str, texts: list[str], pooling: str, max_length: int) -> np.ndarray:
    """One text at a time, no padding: [CLS] vector or mean over all tokens."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    out = []
    with torch.no_grad():
        for t in texts:
            enc = tok(t, truncation=True, max_length=max_length, return_tensors="pt")
            h = model(**enc).last_hidden_state[0]
            out.append((h[0] if pooling == "cls" else h.mean(0)).numpy())
    return np.stack(out)


class _CountRows:
    """Counts the rows the encoder's model is run on (forward pre-hook)."""

    def __init__(self, model: torch.nn.Module):
        self.rows = 0
        self.calls = 0
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        self.rows += kwargs["input_ids"].shape[0]
        self.calls += 1


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_pooling_matches_naive_and_restores_order(tiny_bert_dir, pooling):
    texts = _texts(23, seed=1)  # shuffled lengths; batches of 4 in windows of 8 (3 windows)
    enc = CPDAE.from_pretrained(tiny_bert_dir, pooling=pooling, batch_size=4, sort_window=2, doc_max_length=64)
    got = enc.encode_docs(texts)
    assert got.dtype == np.float32 and got.shape == (23, 32)
    np.testing.assert_allclose(got, _naive(tiny_bert_dir, texts, pooling, 64), atol=1e-5, rtol=1e-4)
    # the same through the transformer and through streamed dict records
    frame = pd.DataFrame({"docno": [f"d{i}" for i in range(23)], "text": texts})
    np.testing.assert_allclose(np.stack(enc.doc_encoder()(frame)["doc_vec"]), got, atol=1e-6)
    recs = list(enc.doc_encoder().transform_iter(iter(frame.to_dict(orient="records"))))
    assert [r["docno"] for r in recs] == list(frame["docno"])
    np.testing.assert_allclose(np.stack([r["doc_vec"] for r in recs]), got, atol=1e-6)


def test_truncation_and_model_length_limit(tiny_bert_dir):
    long_text = " ".join(WORDS * 20)  # ~500 tokens; the tiny model has 128 positions
    enc = CPDAE.from_pretrained(tiny_bert_dir, doc_max_length=256, query_max_length=8)
    assert enc.doc_max_length == 128  # clamped to the model's limit instead of failing at run time
    np.testing.assert_allclose(enc.encode_docs([long_text]), _naive(tiny_bert_dir, [long_text], "cls", 128),
                               atol=1e-5)
    np.testing.assert_allclose(enc.encode_queries([long_text]), _naive(tiny_bert_dir, [long_text], "cls", 8),
                               atol=1e-5)


def test_normalize(tiny_bert_dir):
    texts = _texts(6, seed=2)
    raw = CPDAE.from_pretrained(tiny_bert_dir, pooling="mean").encode_docs(texts)
    unit = CPDAE.from_pretrained(tiny_bert_dir, pooling="mean", normalize=True).encode_docs(texts)
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(unit, raw / np.linalg.norm(raw, axis=1, keepdims=True), atol=1e-6)


def test_minilm_mean_normalized_matches_sentence_transformers(minilm_path):
    import sentence_transformers as st
    texts = _texts(10, seed=3, max_words=60) + ["", "A short one."]
    ref = st.SentenceTransformer(minilm_path, device="cpu").encode(texts, batch_size=4)
    enc = CPDAE.from_pretrained(minilm_path, pooling="mean", normalize=True, batch_size=4, device="cpu")
    np.testing.assert_allclose(enc.encode_docs(texts), ref, atol=1e-5)


def test_dedup_of_queries(tiny_bert_dir):
    enc = CPDAE.from_pretrained(tiny_bert_dir, batch_size=8)
    counter = _CountRows(enc.model)
    frame = pd.DataFrame({"qid": ["1", "2", "3", "4", "5"], "query": ["apple", "river", "apple", "apple", "river"]})
    out = enc.query_encoder()(frame)
    assert counter.rows == 2
    vecs = np.stack(out["query_vec"])
    np.testing.assert_array_equal(vecs[0], vecs[2])
    np.testing.assert_array_equal(vecs[1], vecs[4])
    np.testing.assert_allclose(vecs[:2], _naive(tiny_bert_dir, ["apple", "river"], "cls", 32), atol=1e-5)
    enc.encode_docs(["apple", "apple"])  # documents are not de-duplicated
    assert counter.rows == 4


def test_text_scorer_is_dot_product_and_ranks(tiny_bert_dir):
    enc = CPDAE.from_pretrained(tiny_bert_dir, pooling="mean")
    docs = _texts(5, seed=4)
    res = pd.DataFrame({"qid": ["q1"] * 3 + ["q2"] * 2, "query": ["apple river"] * 3 + ["ocean"] * 2,
                        "docno": [f"d{i}" for i in range(5)], "text": docs})
    out = enc.text_scorer()(res)
    q = enc.encode_queries(res["query"].tolist())
    d = enc.encode_docs(docs)
    np.testing.assert_allclose(out["score"].to_numpy(), [float(np.dot(a, b)) for a, b in zip(q, d)], rtol=1e-5)
    for _, g in out.groupby("qid"):
        assert sorted(g["rank"]) == list(range(len(g)))
        assert list(g.sort_values("rank")["score"]) == sorted(g["score"], reverse=True)
    assert {"qid", "query", "docno", "text", "score", "rank"} <= set(out.columns)
    # normalize=True scores are cosine similarities of the un-normalised vectors
    cos = CPDAE.from_pretrained(tiny_bert_dir, pooling="mean", normalize=True).text_scorer()(res)
    expected = [float(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b)) for a, b in zip(q, d)]
    np.testing.assert_allclose(cos["score"].to_numpy(), expected, rtol=1e-5)
    # precomputed vectors are used as they are
    with_vecs = res.assign(query_vec=list(q), doc_vec=list(d)).drop(columns=["query", "text"])
    np.testing.assert_allclose(enc.text_scorer()(with_vecs)["score"].to_numpy(), out["score"].to_numpy(), rtol=1e-6)


def test_mode_selection(tiny_bert_dir):
    enc = CPDAE.from_pretrained(tiny_bert_dir)
    q = enc(pd.DataFrame({"qid": ["1"], "query": ["apple"]}))
    assert "query_vec" in q.columns and "doc_vec" not in q.columns
    d = enc(pd.DataFrame({"docno": ["d1"], "text": ["apple"]}))
    assert "doc_vec" in d.columns and "query_vec" not in d.columns
    np.testing.assert_allclose(q["query_vec"][0], d["doc_vec"][0], atol=1e-6)  # same text, both short
    s = enc(pd.DataFrame({"qid": ["1"], "query": ["apple"], "docno": ["d1"], "text": ["river"]}))
    assert {"score", "rank"} <= set(s.columns)
    recs = enc([{"docno": "d1", "text": "apple"}])  # a list of dicts goes through transform_iter
    assert isinstance(recs, list) and recs[0]["doc_vec"].shape == (32,)
    with pytest.raises(KeyError, match="text"):
        enc(pd.DataFrame({"docno": ["d1"], "body": ["apple"]}))


def test_empty_frames_do_not_load_the_model(tiny_bert_dir):
    enc = CPDAE.from_pretrained(tiny_bert_dir)
    q = enc(pd.DataFrame({"qid": pd.Series([], dtype=str), "query": pd.Series([], dtype=str)}))
    d = enc.doc_encoder()(pd.DataFrame({"docno": [], "text": []}))
    s = enc.text_scorer()(pd.DataFrame({"qid": [], "query": [], "docno": [], "text": []}))
    # the same columns as a non-empty frame's: the vectors and their producer stamp
    assert list(q.columns) == ["qid", "query", "query_vec", "query_vec_producer"] and len(q) == 0
    assert list(d.columns) == ["docno", "text", "doc_vec", "doc_vec_producer"] and len(d) == 0
    assert {"score", "rank"} <= set(s.columns) and len(s) == 0
    assert list(enc.transform_iter([])) == []
    assert enc.encode_queries([]).shape == (0, 32)
    assert enc._model is None
    assert enc.dim == 32


def test_bad_inputs(tiny_bert_dir):
    enc = CPDAE.from_pretrained(tiny_bert_dir)
    with pytest.raises(KeyError, match="query"):
        enc.query_encoder()(pd.DataFrame({"qid": ["1"], "text": ["x"]}))
    with pytest.raises(KeyError, match="text"):
        enc.doc_encoder()(pd.DataFrame({"docno": ["1"], "body": ["x"]}))
    with pytest.raises(ValueError, match=r"'text' is missing .*row 1 \(docno='d2'\)"):
        enc.doc_encoder()(pd.DataFrame({"docno": ["d1", "d2"], "text": ["ok", None]}))
    with pytest.raises(ValueError, match=r"'query' is missing .*row 0 \(qid='q1'\)"):
        enc.query_encoder()(pd.DataFrame({"qid": ["q1"], "query": [float("nan")]}))
    with pytest.raises(TypeError, match=r"'text' must hold strings, but row 0 \(docno='d1'\) holds int 7"):
        enc.doc_encoder()(pd.DataFrame({"docno": ["d1"], "text": [7]}))
    with pytest.raises(ValueError, match="record 1 has keys"):
        list(enc.doc_encoder().transform_iter([{"docno": "a", "text": "x"}, {"docno": "b"}]))
    with pytest.raises(TypeError, match="must hold strings"):
        enc.encode_docs([b"bytes"])
    res = pd.DataFrame({"qid": ["1", "1"], "query_vec": [np.zeros(32), np.zeros(31)], "docno": ["a", "b"],
                        "text": ["x", "y"]})
    with pytest.raises(ValueError, match=r"query_vec of qid '1' has dimension 31, expected 32"):
        enc.text_scorer()(res)
    res = pd.DataFrame({"qid": ["1"], "query": ["x"], "docno": ["a"], "doc_vec": [np.zeros((2, 16))]})
    with pytest.raises(ValueError, match=r"doc_vec of docno 'a' must be a 1-d vector, got shape \(2, 16\)"):
        enc.text_scorer()(res)
    with pytest.raises(KeyError, match="qid"):
        enc.text_scorer()(pd.DataFrame({"query": ["x"], "text": ["y"]}))
    with pytest.raises(ValueError, match="pooling"):
        CPDAE.from_pretrained(tiny_bert_dir, pooling="max")
    with pytest.raises(ValueError, match="dtype"):
        CPDAE.from_pretrained(tiny_bert_dir, dtype="int8")
    with pytest.raises(ValueError, match="batch_size"):
        CPDAE.from_pretrained(tiny_bert_dir, batch_size=0)
    with pytest.raises(OSError):
        CPDAE.from_pretrained(str(tiny_bert_dir) + "-does-not-exist")


def test_empty_string_encodes_as_cls_sep(tiny_bert_dir):
    enc = CPDAE.from_pretrained(tiny_bert_dir)
    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    model = AutoModel.from_pretrained(tiny_bert_dir).eval()
    ids = torch.tensor([[tok.cls_token_id, tok.sep_token_id]])
    with torch.no_grad():
        ref = model(input_ids=ids).last_hidden_state[0, 0].numpy()
    np.testing.assert_allclose(enc.encode_docs(["", "apple"])[0], ref, atol=1e-5)


def test_equality_hash_repr(tiny_bert_dir, tmp_path):
    a = CPDAE.from_pretrained(tiny_bert_dir, pooling="mean")
    b = CPDAE.from_pretrained(tiny_bert_dir, pooling="mean", batch_size=7)  # batch size does not change vectors
    assert a == b and hash(a) == hash(b)
    assert a.query_encoder() == b.query_encoder() and hash(a.doc_encoder()) == hash(b.doc_encoder())
    assert a.query_encoder() != a.doc_encoder()
    assert a != CPDAE.from_pretrained(tiny_bert_dir, pooling="cls")
    assert a != CPDAE.from_pretrained(tiny_bert_dir, pooling="mean", normalize=True)
    assert a != CPDAE.from_pretrained(tiny_bert_dir, pooling="mean", doc_max_length=64)
    assert repr(a).startswith("CPDAE.from_pretrained(") and "pooling='mean'" in repr(a) and str(tiny_bert_dir) in repr(a)
    assert repr(a.text_scorer()).endswith(".text_scorer()")
    model, tok = AutoModel.from_pretrained(tiny_bert_dir), AutoTokenizer.from_pretrained(tiny_bert_dir)
    m1, m2 = CPDAE(model, tok), CPDAE(model, tok)
    assert m1 == m2 and hash(m1) == hash(m2)
    assert m1 != CPDAE(AutoModel.from_pretrained(tiny_bert_dir), tok)
    assert "BertModel" in repr(m1)


class _BruteForce(pt.Transformer):
    """Exact inner-product retrieval over a fixed matrix (an independent little retriever)."""

    def __init__(self, docnos, vecs, k):
        self.docnos, self.vecs, self.k = list(docnos), np.asarray(vecs), k

    def transform(self, inp):
        rows = []
        for rec in inp.itertuples(index=False):
            scores = self.vecs @ rec.query_vec
            for rank, i in enumerate(np.argsort(-scores)[: self.k]):
                rows.append({"qid": rec.qid, "docno": self.docnos[i], "score": float(scores[i]), "rank": rank})
        return pd.DataFrame(rows, columns=["qid", "docno", "score", "rank"])


def test_experiment_tree_plan_shares_the_encoder(tiny_bert_dir):
    docs = _texts(8, seed=5)
    docnos = [f"d{i}" for i in range(8)]
    enc_a = CPDAE.from_pretrained(tiny_bert_dir)
    vecs = enc_a.encode_docs(docs)
    topics = pd.DataFrame({"qid": ["q1", "q2"], "query": [docs[2], docs[5]]})
    qrels = pd.DataFrame({"qid": ["q1", "q2"], "docno": ["d2", "d5"], "label": [1, 1]})
    enc_b = CPDAE.from_pretrained(tiny_bert_dir)  # a different object, equal to enc_a
    counter = _CountRows(enc_a.model)
    counter_b = _CountRows(enc_b.model)
    res = pt.Experiment([enc_a.query_encoder() >> _BruteForce(docnos, vecs, 3),
                         enc_b.query_encoder() >> _BruteForce(docnos, vecs, 5)],
                        topics, qrels, eval_metrics=["recip_rank"], plan="tree", names=["k3", "k5"])
    assert counter.calls + counter_b.calls == 1  # the shared query_encoder() prefix ran once
    assert list(res["recip_rank"]) == [1.0, 1.0]  # a query equal to a document's text finds it first


def test_loads_mlm_checkpoint_as_encoder(tiny_bert_dir):
    mlm = BertForMaskedLM.from_pretrained(tiny_bert_dir).eval()
    enc = CPDAE.from_pretrained(tiny_bert_dir, pooling="cls")
    model = enc.model
    assert type(model).__name__ == "BertModel" and getattr(model, "pooler", None) is None
    ref_sd = mlm.bert.state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, ref_sd[k])
    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    inputs = tok(["apple river ocean"], return_tensors="pt")
    with torch.no_grad():
        ref = mlm.bert(**inputs).last_hidden_state[:, 0].numpy()
    np.testing.assert_allclose(enc.encode_docs(["apple river ocean"]), ref, atol=1e-5)


def test_in_memory_model_restores_training_mode(tiny_bert_dir):
    model, tok = AutoModel.from_pretrained(tiny_bert_dir), AutoTokenizer.from_pretrained(tiny_bert_dir)
    model.train()
    enc = CPDAE(model, tok, pooling="cls")
    texts = _texts(4, seed=6)
    first = enc.encode_docs(texts)
    np.testing.assert_array_equal(first, enc.encode_docs(texts))  # dropout off while encoding
    assert model.training
    np.testing.assert_allclose(first, CPDAE.from_pretrained(tiny_bert_dir).encode_docs(texts), atol=1e-6)


class _CollectingIndexer(pt.Indexer):
    def __init__(self):
        self.batches = []

    def index(self, it):
        for rec in it:
            self.batches.append(rec)
        return self


def test_indexing_pipeline_streams(tiny_bert_dir):
    enc = CPDAE.from_pretrained(tiny_bert_dir, batch_size=4, sort_window=16)  # sorting windows of 64 texts
    texts = _texts(250, seed=7, max_words=8)
    consumed = []

    def corpus():
        for i, t in enumerate(texts):
            consumed.append(i)
            yield {"docno": f"d{i}", "text": t}

    counter = _CountRows(enc.model)
    first_seen_after = []

    class Probe(_CollectingIndexer):
        def index(self, it):
            for rec in it:
                if not first_seen_after:
                    first_seen_after.append(len(consumed))
                self.batches.append(rec)
            return self

    probe = Probe()
    (enc >> probe).index(corpus())
    assert [r["docno"] for r in probe.batches] == [f"d{i}" for i in range(250)]
    # records come out once the first chunk was read, not the whole corpus (PyTerrier's Compose.index reads chunks
    # of max(100, the first stage's batch_size) records: here the window of 64)
    assert first_seen_after[0] == max(100, 64)
    np.testing.assert_allclose(np.stack([r["doc_vec"] for r in probe.batches]), enc.encode_docs(texts), atol=1e-6)
    assert counter.rows == 2 * 250


def test_dense_index_pipelines(tiny_bert_dir, tmp_path):
    import pyterrier_cpdae.dense as dense_index
    enc = CPDAE.from_pretrained(tiny_bert_dir, pooling="mean", normalize=True)
    docs = _texts(30, seed=8)
    index = dense_index.DenseIndex(tmp_path / "idx")
    (enc >> index.indexer()).index({"docno": f"d{i}", "text": t} for i, t in enumerate(docs))
    res = (enc >> index.retriever(num_results=3))(pd.DataFrame({"qid": ["q1"], "query": [docs[7]]}))
    assert res.sort_values("rank")["docno"].iloc[0] == "d7"


def test_bf16_autocast_is_close_to_float32(tiny_bert_dir):
    texts = _texts(6, seed=9)
    fp32 = CPDAE.from_pretrained(tiny_bert_dir, pooling="mean", normalize=True)
    bf16 = CPDAE.from_pretrained(tiny_bert_dir, pooling="mean", normalize=True, dtype=torch.bfloat16)
    assert bf16.dtype == "bfloat16" and bf16 != fp32 and "dtype='bfloat16'" in repr(bf16)
    a, b = fp32.encode_docs(texts), bf16.encode_docs(texts)
    assert b.dtype == np.float32
    assert np.all(np.sum(a * b, axis=1) > 0.99) and not np.allclose(a, b, atol=1e-6)  # autocast did run in bf16


def _expected_batches(model_dir: str, texts: list[str], *, window: int, batch: int,
                      max_length: int) -> tuple[list[int], list[tuple[int, int]]]:
    """The texts' token counts from the tokenizer itself, and the ``(rows, width)`` of each batch expected when
    each window of ``window`` texts is sorted by length (longest first) and cut into batches of ``batch``."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    lengths = [len(tok(t, truncation=True, max_length=max_length)["input_ids"]) for t in texts]
    expected = []
    for start in range(0, len(texts), window):
        part = sorted(lengths[start:start + window], reverse=True)
        expected += [(len(part[b:b + batch]), part[b]) for b in range(0, len(part), batch)]
    return lengths, expected


def test_batches_are_length_sorted_padded_to_their_own_length_in_inference_mode(tiny_bert_dir):
    """Reference: the batch widths expected from the tokenizer's own token counts, sorted within each window."""
    texts = _texts(23, seed=10)
    enc = CPDAE.from_pretrained(tiny_bert_dir, batch_size=4, sort_window=2, doc_max_length=64,
                                batch_tokens=0)  # windows of 8, batches of 4 texts (not the CPU's token budget)
    lengths, expected = _expected_batches(tiny_bert_dir, texts, window=8, batch=4, max_length=64)
    seen = []
    handle = enc.model.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append((tuple(kwargs["input_ids"].shape), torch.is_inference_mode_enabled(),
                                             int(kwargs["attention_mask"].sum()))), with_kwargs=True)
    enc.encode_docs(texts)
    handle.remove()
    assert [shape for shape, _, _ in seen] == expected  # (rows, width = longest text of the batch)
    assert all(mode for _, mode, _ in seen)
    assert sum(n for _, _, n in seen) == sum(lengths)  # padding is masked out


@pytest.mark.parametrize("stage", ["encoder", "doc_encoder"])
def test_indexing_pipeline_sorts_over_whole_windows(tiny_bert_dir, tmp_path, stage):
    """``enc >> indexer`` and ``enc.doc_encoder() >> indexer``: PyTerrier's ``Compose.index`` cuts the corpus into
    chunks of the first stage's ``batch_size``; the encoder's stages report the sorting window (here 4 x 64 = 256
    texts, above PyTerrier's floor of 100), so the batches are those of windows of 256, as ``encode_docs`` makes
    them. Reference: the widths expected from the tokenizer's own token counts sorted within each window."""
    from pyterrier_cpdae.dense import DenseIndex

    texts = _texts(300, seed=11)
    enc = CPDAE.from_pretrained(tiny_bert_dir, batch_size=4, sort_window=64, doc_max_length=64, backend="torch",
                                batch_tokens=0)  # batches of 4 texts, as the reference cuts them
    _, expected = _expected_batches(tiny_bert_dir, texts, window=256, batch=4, max_length=64)
    seen = []
    handle = enc.model.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    index = DenseIndex(tmp_path / "idx")
    first = enc if stage == "encoder" else enc.doc_encoder()
    (first >> index.indexer()).index({"docno": f"d{i}", "text": t} for i, t in enumerate(texts))
    handle.remove()
    assert seen == expected
    np.testing.assert_array_equal(np.asarray(index.vectors()), enc.encode_docs(texts))
    assert f"({enc!r} >> DenseIndexer(" in repr(enc >> index.indexer())  # shown as the encoder it is


def test_autocast_dtype_defaults(tiny_bert_dir, monkeypatch):
    """bf16 autocast on CUDA where supported, else fp16; float32 on CPU (the model is not loaded here)."""
    cuda = CPDAE.from_pretrained(tiny_bert_dir, device="cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert cuda._autocast_dtype() == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert cuda._autocast_dtype() == torch.float16
    assert CPDAE.from_pretrained(tiny_bert_dir, device="cuda", dtype="float32")._autocast_dtype() == torch.float32
    assert CPDAE.from_pretrained(tiny_bert_dir, device="cpu")._autocast_dtype() == torch.float32
    assert CPDAE.from_pretrained(tiny_bert_dir, device="cpu", dtype="fp16")._autocast_dtype() == torch.float16
    assert cuda._model is None and cuda.device.type == "cuda"


def test_experiment_tree_plan_shares_the_encoder_before_dense_retrievers(tiny_bert_dir, tmp_path):
    """The issue's pipeline shape ``enc >> index.retriever()``: with plan="tree", the queries are encoded once for
    all systems (and once per system without it, which shows the counter sees every encoding)."""
    from pyterrier_cpdae.dense import DenseIndex

    docs = _texts(40, seed=11)
    enc = CPDAE.from_pretrained(tiny_bert_dir, pooling="mean", normalize=True)
    index = DenseIndex(tmp_path / "idx")
    (enc >> index.indexer()).index({"docno": f"d{i}", "text": t} for i, t in enumerate(docs))
    topics = pd.DataFrame({"qid": ["q1", "q2", "q3"], "query": [docs[3], docs[17], docs[29]]})
    qrels = pd.DataFrame({"qid": ["q1", "q2", "q3"], "docno": ["d3", "d17", "d29"], "label": [1, 1, 1]})
    same = CPDAE.from_pretrained(tiny_bert_dir, pooling="mean", normalize=True)  # equal to enc, another object
    systems = [enc >> index.np_retriever(num_results=5), same >> index.torch_retriever(num_results=5, device="cpu"),
               enc >> index.faiss_flat_retriever(num_results=10)]
    calls = []
    for model in (enc.model, same.model):
        model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape[0]), with_kwargs=True)
    tree = pt.Experiment(systems, topics, qrels, eval_metrics=["recip_rank"], plan="tree", names=["np", "torch", "flat"])
    assert calls == [3]
    assert list(tree["recip_rank"]) == [1.0, 1.0, 1.0]
    calls.clear()
    with pytest.warns(UserWarning, match="shared pipeline components among 3 pipelines"):
        pt.Experiment(systems, topics, qrels, eval_metrics=["recip_rank"], names=["np", "torch", "flat"])
    assert calls == [3, 3, 3]


def test_progress_bar_by_default_on_long_calls_only(tiny_bert_dir, capsys):
    """As PyTerrier's transformers show a bar when verbose: by default (verbose=None) a call that runs longer than
    PROGRESS_DELAY_S shows ``pt.tqdm``'s bar and a short one prints nothing; verbose=False never, True always."""
    import time

    from pyterrier_cpdae.encoder.cpdae import PROGRESS_DELAY_S

    texts = _texts(8, seed=3)
    enc = CPDAE.from_pretrained(tiny_bert_dir, pooling="mean", batch_size=1, batch_tokens=0, backend="torch")
    assert enc.verbose is None
    enc.encode_docs(texts)
    assert "Encoding" not in capsys.readouterr().err                     # a short call: no output
    handle = enc.model.register_forward_pre_hook(lambda *a: time.sleep(1.2 * PROGRESS_DELAY_S / 4))
    try:
        start = time.perf_counter()
        enc.encode_docs(texts)                                            # 8 batches: over the delay
        assert time.perf_counter() - start > PROGRESS_DELAY_S
        err = capsys.readouterr().err
        assert "Encoding" in err and "/8" in err, err                     # the bar, counting texts
        quiet = CPDAE(enc.model, enc.tokenizer, pooling="mean", batch_size=1, batch_tokens=0, backend="torch",
                      verbose=False)
        quiet.encode_docs(texts)
        assert "Encoding" not in capsys.readouterr().err
    finally:
        handle.remove()
    loud = CPDAE(enc.model, enc.tokenizer, pooling="mean", batch_size=1, batch_tokens=0, backend="torch",
                 verbose=True)
    loud.encode_docs(texts[:2])
    assert "Encoding" in capsys.readouterr().err                          # asked for: even a short call
