"""Encoding batches cut by a token budget: ``CPDAE(batch_tokens=...)``.

The cuts are checked against hand-computed cases; the encoder is checked to respect the budget in every forward
pass, to encode each row once and write it back to its own row, and to give the text-count batching's vectors and
top-10 rankings on the real MiniLM weights over texts of very different lengths.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pyterrier_cpdae.encoder import CPDAE
from pyterrier_cpdae.encoder import cpdae as enc_mod
from pyterrier_cpdae.encoder import stages as stages_mod
from pyterrier_cpdae.encoder.backends import padded as padded_mod
from pyterrier_cpdae.encoder.backends import unpadded as unpadded_mod
from pyterrier_cpdae.encoder.batching import length_sorted_batches, token_budget_batches
from pyterrier_cpdae.encoder.attention import reference_kernel, varlen_kernel
from pyterrier_cpdae.encoder.backends.unpadded import supports_packing



def async_on_cpu(monkeypatch) -> None:
    """The CPU treated as a device whose work is queued asynchronously (as CUDA), by the encoder and its stages."""
    for mod in (enc_mod, stages_mod, padded_mod):
        monkeypatch.setattr(mod, "ASYNC_DEVICES", ("cpu",))

def _cuts(lengths, budget, padded=True):
    return [b.tolist() for b in token_budget_batches(np.array(lengths), budget, padded=padded)]


@pytest.mark.parametrize("lengths, budget, padded, expected", [
    # padded: rows x longest <= budget, rows sorted longest first
    ([10, 3, 7, 3], 20, True, [[0, 2], [1, 3]]),          # 2 x 10 = 20; then 2 x 3 = 6
    ([10, 3, 7, 3], 19, True, [[0], [2, 1], [3]]),        # 1 x 10; 2 x 7 = 14 (3 x 7 = 21 > 19); 1 x 3
    ([4, 4, 4, 4, 4], 12, True, [[0, 1, 2], [3, 4]]),     # ties keep input order; 3 x 4 = 12
    ([2, 9, 2, 2, 2, 2, 2, 2], 9, True, [[1], [0, 2, 3, 4], [5, 6, 7]]),  # 4 x 2 = 8 <= 9 < 10
    ([30, 3], 20, True, [[0], [1]]),                      # a row above the budget: a batch of its own
    ([5], 100, True, [[0]]),
    ([], 10, True, []),
    # packed: sum of lengths <= budget
    ([10, 3, 7, 3], 20, False, [[0, 2, 1], [3]]),         # 10 + 7 + 3 = 20
    ([10, 3, 7, 3], 16, False, [[0], [2, 1, 3]]),         # 10 (+7 = 17 > 16); 7 + 3 + 3 = 13
    ([30, 3, 3], 20, False, [[0], [1, 2]]),
])
def test_cuts_match_hand_computed(lengths, budget, padded, expected):
    assert _cuts(lengths, budget, padded) == expected


def test_cuts_respect_the_budget_and_cover_every_row_once():
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 257, size=1000)
    for budget in (256, 1000, 4096):
        for padded in (True, False):
            batches = token_budget_batches(lengths, budget, padded=padded)
            rows = np.concatenate(batches)
            assert sorted(rows.tolist()) == list(range(len(lengths)))
            # longest first: the same order as the text-count batching's
            assert rows.tolist() == np.concatenate(length_sorted_batches(lengths, 7)).tolist()
            for b in batches:
                size = len(b) * lengths[b].max() if padded else lengths[b].sum()
                assert size <= budget
                # greedy: the next row (if any) would not have fitted
            for b, nxt in zip(batches, batches[1:]):
                grown = np.append(b, nxt[0])
                size = len(grown) * lengths[grown].max() if padded else lengths[grown].sum()
                assert size > budget


# ---------------------------------------------------------------------------------------------- the encoder
def _varied_texts(n: int = 60) -> list:
    """Texts from 1 word to ~300 words (many truncated at 128 tokens), shuffled, with two repeats."""
    rng = np.random.default_rng(1)
    words = ("protein cell gene tumour vaccine immune response river country mountain music theory model data "
             "network signal energy climate ocean").split()
    texts = [" ".join(rng.choice(words, size=int(k))) for k in rng.choice([1, 3, 8, 20, 60, 150, 300], size=n)]
    return texts + texts[:2]


class _Spy:
    """Records the shape of every forward pass of a model."""

    def __init__(self, model):
        self.shapes = []
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        self.shapes.append(tuple(kwargs["input_ids"].shape))


def test_encoder_batches_respect_the_budget_and_rows_come_back_in_place(tiny_bert_dir):
    texts = _varied_texts()
    enc = CPDAE.from_pretrained(tiny_bert_dir, pooling="mean", batch_size=4, sort_window=4, doc_max_length=128,
                                batch_tokens=600, backend="torch", device="cpu")
    spy = _Spy(enc.model)
    vecs = enc.encode_docs(texts)
    lengths = [len(x) for x in enc.tokenizer(texts, truncation=True, max_length=128)["input_ids"]]
    assert spy.shapes and all(rows * width <= 600 for rows, width in spy.shapes)
    assert sum(rows for rows, _ in spy.shapes) == len(texts)  # every row once
    assert sum(rows * width for rows, width in spy.shapes) >= sum(lengths)
    assert max(rows for rows, _ in spy.shapes) > 4  # short texts: more rows than batch_size
    # each vector is its own text's: encoded alone (a batch of one, no padding) it is the same
    single = CPDAE(enc.model, enc.tokenizer, pooling="mean", batch_size=1, doc_max_length=128, backend="torch")
    alone = np.stack([single.encode_docs([t])[0] for t in texts])
    np.testing.assert_allclose(vecs, alone, atol=2e-5, rtol=0)
    assert np.allclose(vecs[-2:], vecs[:2])


def test_default_budget_is_batch_size_times_length_capped_on_cpu(tiny_bert_dir):
    cpu = CPDAE.from_pretrained(tiny_bert_dir, batch_size=8, device="cpu")
    assert cpu.batch_tokens is None
    assert cpu.token_budget(32) == 8 * 32 and cpu.token_budget(256) == 2048  # 8 x 256 is 2,048, the cap
    big = CPDAE.from_pretrained(tiny_bert_dir, batch_size=32, device="cpu")
    assert big.token_budget(256) == 2048 and big.token_budget(64) == 2048 and big.token_budget(16) == 32 * 16
    assert CPDAE.from_pretrained(tiny_bert_dir, batch_size=2, device="cpu", doc_max_length=4096).token_budget(4096) \
        == 4096  # one text of the maximum length always fits
    assert CPDAE.from_pretrained(tiny_bert_dir, batch_size=8, device="cpu", batch_tokens=0).token_budget(256) is None
    cuda = CPDAE.from_pretrained(tiny_bert_dir, batch_size=8, device="cuda")  # weights load lazily: no GPU needed
    assert cuda.token_budget(256) == 8 * 256 and cuda.token_budget(32) == 8 * 32
    assert CPDAE.from_pretrained(tiny_bert_dir, device="cuda", batch_tokens=0).token_budget(256) is None
    assert CPDAE.from_pretrained(tiny_bert_dir, device="cpu", batch_tokens=4096).token_budget(32) == 4096


@pytest.mark.parametrize("value", [-1, 1.5, True, "512", 100, np.float64(512)])
def test_bad_batch_tokens_refused_naming_the_option(tiny_bert_dir, value):
    with pytest.raises(ValueError, match="batch_tokens"):
        CPDAE.from_pretrained(tiny_bert_dir, doc_max_length=256, batch_tokens=value)


def _scifact_varied(scifact_dir, n_docs=48):
    """SciFact documents cut to very different lengths (titles only, a sentence, full text) and queries."""
    docs = []
    with open(scifact_dir / "corpus.jsonl", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i >= n_docs:
                break
            rec = json.loads(line)
            full = (rec.get("title", "") + " " + rec.get("text", "")).strip()
            docs.append([rec.get("title", ""), full[:200], full][i % 3])
    with open(scifact_dir / "queries.jsonl", encoding="utf-8") as f:
        queries = [json.loads(line)["text"] for line in f][:20]
    return docs, queries


def _top10(q, d):
    return np.argsort(-(q @ d.T), axis=1, kind="stable")[:, :10]


def test_vectors_and_top10_equal_text_count_batching_on_minilm(minilm_path, scifact_dir, monkeypatch):
    """Token-budget batches, padded and packed (unpadded, with the reference varlen kernel on the CPU), give the
    text-count batching's vectors and top-10s."""
    docs, queries = _scifact_varied(scifact_dir)
    common = dict(dtype="float32", backend="torch", batch_size=8, doc_max_length=160)
    # queries cut at 32 tokens, as counted below (left unset, the MiniLM folder's max_seq_length, 256, would cut them)
    by_count = CPDAE.from_pretrained(minilm_path, batch_tokens=0, device="cpu", query_max_length=32, **common)
    settings = dict(pooling=by_count.pooling, normalize=by_count.normalize, query_max_length=by_count.query_max_length,
                    **common)
    by_tokens = CPDAE(by_count.model, by_count.tokenizer, batch_tokens=640, unpad=False, **settings)
    packed = CPDAE(by_count.model, by_count.tokenizer, batch_tokens=640, unpad=True, **settings)
    lengths = [len(x) for x in by_count.tokenizer(docs, truncation=True, max_length=160)["input_ids"]]
    assert min(lengths) < 30 and max(lengths) == 160  # very different lengths
    spy = _Spy(by_count.model)
    d_count, q_count = by_count.encode_docs(docs), by_count.encode_queries(queries)
    count_shapes, spy.shapes = spy.shapes, []
    d_tok, q_tok = by_tokens.encode_docs(docs), by_tokens.encode_queries(queries)
    assert len(spy.shapes) < len(count_shapes)  # really different batches: fewer, larger ones
    assert all(r * w <= 640 for r, w in spy.shapes)
    np.testing.assert_allclose(d_tok, d_count, atol=1e-5, rtol=0)
    np.testing.assert_allclose(q_tok, q_count, atol=1e-5, rtol=0)
    assert (_top10(q_tok, d_tok) == _top10(q_count, d_count)).all()

    monkeypatch.setattr(unpadded_mod, "varlen_kernel", lambda device, dtype: reference_kernel)
    spy.shapes = []
    d_packed, q_packed = packed.encode_docs(docs), packed.encode_queries(queries)
    assert all(r == 1 and w <= 640 for r, w in spy.shapes)  # one row of real tokens per batch
    assert sum(w for _, w in spy.shapes) == sum(lengths) + sum(
        len(x) for x in by_count.tokenizer(queries, truncation=True, max_length=32)["input_ids"])
    np.testing.assert_allclose(d_packed, d_count, atol=1e-5, rtol=0)
    np.testing.assert_allclose(q_packed, q_count, atol=1e-5, rtol=0)
    assert (_top10(q_packed, d_packed) == _top10(q_count, d_count)).all()
    assert by_count.model.config._attn_implementation == "sdpa"  # restored after the packed calls


def test_packed_cls_pooling_and_positions_match_padded(tiny_bert_dir, monkeypatch):
    """[CLS] pooling reads each text's own first token, and positions restart at 0 for every text."""
    texts = _varied_texts(20)
    padded = CPDAE.from_pretrained(tiny_bert_dir, pooling="cls", batch_size=4, doc_max_length=64, unpad=False,
                                   device="cpu", backend="torch")
    monkeypatch.setattr(unpadded_mod, "varlen_kernel", lambda device, dtype: reference_kernel)
    packed = CPDAE(padded.model, padded.tokenizer, pooling="cls", batch_size=4, doc_max_length=64,
                   backend="torch")  # unpad=None: automatic, the (patched) kernel is there
    spy = _Spy(padded.model)
    np.testing.assert_allclose(packed.encode_docs(texts), padded.encode_docs(texts), atol=2e-5, rtol=0)
    assert spy.shapes[0][0] == 1 and spy.shapes[-1][0] > 1  # the first call packed, the second padded


def test_unpad_without_the_kernel(tiny_bert_dir):
    """On the CPU there is no varlen kernel: automatic means padded; unpad=True is refused, naming the option."""
    assert varlen_kernel(torch.device("cpu"), torch.bfloat16) is None
    assert varlen_kernel(torch.device("cuda"), torch.float32) is None  # FlashAttention has no float32
    enc = CPDAE.from_pretrained(tiny_bert_dir, device="cpu", backend="torch")
    assert supports_packing(enc.model) and enc._packing_kernel(enc.model) is None
    with pytest.raises(ValueError, match="unpad=True"):
        CPDAE.from_pretrained(tiny_bert_dir, device="cpu", unpad=True).encode_docs(["a text"])
    for bad in ("yes", 1, 0.0):
        with pytest.raises(ValueError, match="unpad"):
            CPDAE.from_pretrained(tiny_bert_dir, unpad=bad)


def test_read_ahead_keeps_order_computes_in_a_worker_and_raises_at_the_failing_item():
    """``read_ahead`` yields the same items in the same order as plain iteration; each item is computed in the
    worker thread; an item's error comes out at that item (not earlier); closing early computes at most one more."""
    import threading

    from pyterrier_cpdae.encoder.batching import read_ahead

    made = []

    def make(i):
        made.append(i)
        if i == 3:
            raise KeyError("item 3")
        return i * i, threading.current_thread().name

    assert [v for v, _ in read_ahead(map(make, range(3)))] == [0, 1, 4]
    assert {name for _, name in read_ahead(map(make, range(3)))} == {"cpdae-read-ahead_0"}
    assert [v for v, name in read_ahead(map(make, range(3)), enabled=False)] == [0, 1, 4]
    got = []
    with pytest.raises(KeyError, match="item 3"):
        for v, _ in read_ahead(map(make, range(6))):
            got.append(v)
    assert got == [0, 1, 4]  # items before the failing one all arrived
    made.clear()
    gen = read_ahead(map(make, range(100)))
    assert next(gen)[0] == 0
    gen.close()
    assert made == [0, 1]  # the one in flight, no further


@pytest.mark.parametrize("pooling", ["mean", "cls"])  # cls: the last layer trimmed to [CLS] takes the host mask too
def test_windows_tokenized_ahead_give_the_same_vectors(tiny_bert_dir, monkeypatch, pooling):
    """As on CUDA (here forced on the CPU: ``ASYNC_DEVICES``), the next window is tokenized in the worker thread and
    a padded batch's attention mask is made on the host (none for a batch without padding, else ``(B, 1, 1, L)``
    booleans, so transformers never tests the mask on the device); padded and packed encodings of several windows
    equal those made the usual way, row for row."""
    import threading

    texts = _varied_texts() * 3
    settings = dict(pooling=pooling, batch_size=4, sort_window=2, doc_max_length=128, backend="torch")
    plain = CPDAE.from_pretrained(tiny_bert_dir, device="cpu", **settings)
    ref = plain.encode_docs(texts)
    monkeypatch.setattr(unpadded_mod, "varlen_kernel", lambda device, dtype: reference_kernel)
    ref_packed = CPDAE(plain.model, plain.tokenizer, unpad=True, **settings).encode_docs(texts)
    threads = []
    tokenize = type(plain.tokenizer).__call__

    def spy(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return tokenize(self, *args, **kwargs)

    monkeypatch.setattr(type(plain.tokenizer), "__call__", spy)
    masks = []
    plain.model.register_forward_pre_hook(lambda m, a, kw: masks.append(kw.get("attention_mask")), with_kwargs=True)
    async_on_cpu(monkeypatch)
    for unpad, expected in ((False, ref), (True, ref_packed)):
        threads.clear()
        masks.clear()
        got = CPDAE(plain.model, plain.tokenizer, unpad=unpad, **settings).encode_docs(texts)
        assert len(threads) == -(-len(texts) // 8) > 2 and set(threads) == {"cpdae-read-ahead_0"}, threads
        np.testing.assert_array_equal(got, expected)
        if not unpad:  # batches of equal lengths (the repeats, the texts cut at 128) and padded ones, both seen
            assert None in masks and all(m is None or (m.dim() == 4 and m.dtype == torch.bool) for m in masks)
            assert any(m is not None and not m.all() for m in masks)
    np.testing.assert_allclose(ref_packed, ref, atol=2e-5, rtol=0)


def test_records_streamed_with_the_next_window_read_ahead(tiny_bert_dir, monkeypatch):
    """``doc_encoder().transform_iter`` / ``query_encoder()`` as on CUDA (``ASYNC_DEVICES`` forced on the CPU): the
    next window of records is read from the input, checked and tokenized in the worker thread; the vectors equal
    those read in turn (queries: repeats encoded once); a bad record in the third window is raised after the first two
    windows' records have come out, naming its record number."""
    import threading

    texts = _varied_texts()
    enc = CPDAE.from_pretrained(tiny_bert_dir, pooling="mean", batch_size=4, sort_window=2, doc_max_length=128,
                                backend="torch", device="cpu")
    want = enc.encode_docs(texts)
    queries = [t for t in texts[:20] for _ in range(2)]  # each query twice in a row: 4 distinct per window of 8
    # queries' repeats are found per window when streamed, so the reference is the stream read in turn
    want_q = np.stack([r["query_vec"] for r in enc.query_encoder().transform_iter(
        {"qid": f"q{i}", "query": t} for i, t in enumerate(queries))])
    np.testing.assert_allclose(want_q, enc.encode_queries(queries), atol=1e-6, rtol=0)
    async_on_cpu(monkeypatch)
    sizes = []
    tokenize = enc._tokenize
    monkeypatch.setattr(enc, "_tokenize", lambda t, n: sizes.append(len(t)) or tokenize(t, n))
    readers = []

    def records(bad_at=None):
        for i, t in enumerate(texts):
            readers.append(threading.current_thread().name)
            yield {"docno": f"d{i}", "qid": f"q{i}"} if i == bad_at else {"docno": f"d{i}", "qid": f"q{i}",
                                                                            "text": t, "query": t}

    got = list(enc.doc_encoder().transform_iter(records()))
    assert [r["docno"] for r in got] == [f"d{i}" for i in range(len(texts))]
    np.testing.assert_array_equal(np.stack([r["doc_vec"] for r in got]), want)
    assert set(readers) == {"cpdae-read-ahead_0"}  # the input itself is read in the worker
    sizes.clear()
    got_q = list(enc.query_encoder().transform_iter({"qid": f"q{i}", "query": t} for i, t in enumerate(queries)))
    np.testing.assert_array_equal(np.stack([r["query_vec"] for r in got_q]), want_q)
    assert sizes == [4] * 5  # each window's repeats tokenized and encoded once
    out = []
    with pytest.raises(ValueError, match="record 19 has keys"):
        for r in enc.doc_encoder().transform_iter(records(bad_at=19)):  # windows of 8: the third holds record 19
            out.append(r["docno"])
    assert out == [f"d{i}" for i in range(16)]


def test_indexing_pipeline_hands_the_encoder_several_windows_on_async_devices(tiny_bert_dir, monkeypatch):
    """``(enc >> indexer).index(corpus)``: PyTerrier's ``Compose.index`` chunks the corpus by the stage's
    ``batch_size``, one sorting window on the CPU, ``STREAM_WINDOWS`` windows as on CUDA (forced here), so that
    within a chunk the next window is tokenized in the worker while this one is encoded; same vectors."""
    import threading

    import pyterrier as pt

    class Collect(pt.Indexer):
        def __init__(self):
            super().__init__()
            self.records = []

        def index(self, it):
            self.records.extend(it)
            return self

    texts = _varied_texts(250)
    enc = CPDAE.from_pretrained(tiny_bert_dir, pooling="mean", batch_size=4, sort_window=16, doc_max_length=128,
                                backend="torch", device="cpu")
    assert enc.doc_encoder().batch_size == 64
    want = enc.encode_docs(texts)
    async_on_cpu(monkeypatch)
    assert enc.doc_encoder().batch_size == 64 * enc_mod.STREAM_WINDOWS == 256
    threads = []
    tokenize = enc._tokenize
    monkeypatch.setattr(enc, "_tokenize", lambda t, n: threads.append(threading.current_thread().name) or tokenize(t, n))
    probe = (enc.doc_encoder() >> Collect()).index({"docno": f"d{i}", "text": t} for i, t in enumerate(texts))
    assert [r["docno"] for r in probe.records] == [f"d{i}" for i in range(len(texts))]
    np.testing.assert_array_equal(np.stack([r["doc_vec"] for r in probe.records]), want)
    # 252 texts: one chunk of 252 (< 256) in 4 windows, each tokenized in the worker
    assert threads == ["cpdae-read-ahead_0"] * 4
