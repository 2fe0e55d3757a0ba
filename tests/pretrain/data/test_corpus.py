"""Corpus readers, block packing, the tokenized cache and IDF weights (pretrain.data.readers / pretrain.data.corpus)."""
from __future__ import annotations

import bz2
import collections
import gzip
import json
import math
import os
import pickle
import re
import subprocess
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from pretrain.data import blocks as blocks_mod  # encode_batch lives there
from pretrain.data.blocks import block_lengths, fast_backend, pack_sentences, pack_texts, split_sentences
from pretrain.data.corpus import TokenCache, idf_weights, token_dtype, tokenizer_fingerprint
from pretrain.data.corpus import encode_batch as encode_corpus_batch
from pretrain.data.readers import iter_texts, iter_wiki_documents, resolve_spec
from tests.helpers.warm_python import warm_python

REPO = Path(__file__).resolve().parents[3]



DOCS = [
    {"_id": "d1", "title": "Anarchism", "text": "Anarchism is a political philosophy. It rejects rulers! Does it work? Many ask."},
    {"_id": "d2", "title": "", "text": "A short one."},
    {"_id": "d3", "title": "Albedo", "text": "Albedo is the measure of diffuse reflection. " * 30},
    {"_id": "d4", "title": "Empty", "text": ""},
]


def _write_jsonl(path: Path, rows, opener=open) -> Path:
    with opener(path, "wt") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
            f.write("\n")  # blank lines are skipped
    return path


def _wiki_doc(i: int, title: str, body: str) -> str:
    return f'<doc id="{i}" url="http://x/?curid={i}" title="{title}">\n{title}\n\n{body}\n</doc>\n'


@pytest.fixture()
def wiki_dir(tmp_path: Path) -> Path:
    root = tmp_path / "wiki"
    (root / "AA").mkdir(parents=True)
    (root / "AB").mkdir()
    # sorted order: AA/wiki_00 (plain), AA/wiki_01.bz2, AB/wiki_00.bz2; a non-wiki file is ignored
    (root / "AA" / "wiki_00").write_text(_wiki_doc(1, "One", "First body. Second sentence.") +
                                         _wiki_doc(2, "Two & <b>", "Body two."))
    with bz2.open(root / "AA" / "wiki_01.bz2", "wt") as f:
        f.write(_wiki_doc(3, "Three", "Line a.\nLine b."))
    with bz2.open(root / "AB" / "wiki_00.bz2", "wt") as f:
        f.write(_wiki_doc(4, "Four", "Body four."))
    (root / "AA" / "notes.txt").write_text("not a wiki file")
    return root


# ----------------------------------------------------------------------------- readers

def test_jsonl_default_and_selected_fields(tmp_path):
    p = _write_jsonl(tmp_path / "corpus.jsonl", DOCS)
    texts = list(iter_texts(str(p)))
    # d4 has only an (empty) text and a title -> "Empty"; d2 has no title
    assert texts[0] == "Anarchism\n" + DOCS[0]["text"]
    assert texts[1] == "A short one."
    assert texts[3] == "Empty"
    assert len(texts) == 4
    assert list(iter_texts(str(p), fields="text")) == [d["text"].strip() for d in DOCS if d["text"]]
    assert list(iter_texts(str(p), fields=["_id"])) == ["d1", "d2", "d3", "d4"]
    assert list(iter_texts(str(p), max_docs=2)) == texts[:2]
    # a BEIR folder resolves to its corpus.jsonl; gzip works too
    assert list(iter_texts(str(tmp_path))) == texts
    gz = _write_jsonl(tmp_path / "c.jsonl.gz", DOCS, opener=gzip.open)
    assert list(iter_texts(str(gz))) == texts


def test_jsonl_errors(tmp_path):
    p = _write_jsonl(tmp_path / "c.jsonl", DOCS)
    with pytest.raises(ValueError, match=r"field\(s\) \['body'\] not in the record"):
        list(iter_texts(str(p), fields="body"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        list(iter_texts(str(bad)))
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"contents": "x"}\n')
    with pytest.raises(ValueError, match="none of the default fields"):
        list(iter_texts(str(nofield)))
    empty = _write_jsonl(tmp_path / "empty.jsonl", [{"title": "", "text": "  "}])
    with pytest.raises(ValueError, match="holds no text"):
        list(iter_texts(str(empty)))


def test_txt_one_doc_per_line(tmp_path):
    p = tmp_path / "docs.txt"
    p.write_text("first doc here.\n\n   \nsecond doc.  \nthird\n")
    assert list(iter_texts(str(p))) == ["first doc here.", "second doc.", "third"]
    with pytest.raises(ValueError, match="has no fields"):
        list(iter_texts(str(p), fields="title"))
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n")
    with pytest.raises(ValueError, match="holds no text"):
        list(iter_texts(str(blank)))


def test_wiki_reader(wiki_dir):
    docs = list(iter_wiki_documents(wiki_dir))
    assert [d["id"] for d in docs] == ["1", "2", "3", "4"]
    assert [d["title"] for d in docs] == ["One", "Two & <b>", "Three", "Four"]
    assert docs[0]["text"] == "First body. Second sentence."
    assert docs[2]["text"] == "Line a.\nLine b."
    # the title line is kept once (as the title field), never duplicated
    assert list(iter_texts(f"wiki:{wiki_dir}"))[0] == "One\nFirst body. Second sentence."
    assert list(iter_texts(str(wiki_dir), fields="text")) == [d["text"] for d in docs]
    assert resolve_spec(str(wiki_dir))[0] == "wiki"
    with pytest.raises(ValueError, match=r"fields \['title', 'text'\], not \['url'\]"):
        list(iter_texts(f"wiki:{wiki_dir}", fields="url"))


def test_wiki_errors(wiki_dir, tmp_path):
    (wiki_dir / "AB" / "wiki_01.bz2").write_bytes(b"BZh91AY&SY this is not bzip2 data")
    with pytest.raises(ValueError, match=r"cannot read corpus file .*AB/wiki_01.bz2"):
        list(iter_texts(f"wiki:{wiki_dir}"))
    trunc = tmp_path / "t" / "AA"
    trunc.mkdir(parents=True)
    (trunc / "wiki_00").write_text('<doc id="9" url="u" title="T">\nT\nbody\n')
    with pytest.raises(ValueError, match=r'<doc id="9"> is not closed'):
        list(iter_texts(f"wiki:{trunc.parent}"))
    nowiki = tmp_path / "nowiki"
    nowiki.mkdir()
    with pytest.raises(ValueError, match="no WikiExtractor files"):
        list(iter_texts(f"wiki:{nowiki}"))
    with pytest.raises(ValueError, match="neither a BEIR corpus.jsonl nor WikiExtractor files"):
        list(iter_texts(str(nowiki)))


def test_spec_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="corpus not found"):
        list(iter_texts(str(tmp_path / "missing.jsonl")))
    with pytest.raises(FileNotFoundError, match="corpus not found"):
        list(iter_texts(f"wiki:{tmp_path / 'nodir'}"))
    with pytest.raises(ValueError, match="unknown corpus spec"):
        list(iter_texts("msmarco"))
    other = tmp_path / "x.csv"
    other.write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown corpus file type"):
        list(iter_texts(str(other)))
    with pytest.raises(ValueError, match="names no ir_datasets id"):
        list(iter_texts("irds:"))
    with pytest.raises(ValueError, match="max_docs"):
        list(iter_texts(str(tmp_path), max_docs=0))


def test_irds_fields(monkeypatch):
    import ir_datasets

    Doc = collections.namedtuple("Doc", ["doc_id", "url", "title", "body"])
    Doc.__annotations__ = {"doc_id": str, "url": str, "title": str, "body": str}

    class FakeDataset:
        def has_docs(self):
            return True

        def docs_cls(self):
            return Doc

        def docs_iter(self):
            yield Doc("1", "http://a", "Title A", "Body a.")
            yield Doc("2", "http://b", "", "Body b.")
            yield Doc("3", "http://c", "", "")

    seen = []
    monkeypatch.setattr(ir_datasets, "load", lambda i: seen.append(i) or FakeDataset())
    assert list(iter_texts("irds:fake/docs")) == ["Title A\nBody a.", "Body b."]
    assert seen == ["fake/docs"]
    assert list(iter_texts("irds:fake/docs", fields="url")) == ["http://a", "http://b", "http://c"]
    with pytest.raises(ValueError, match=r"field\(s\) \['text'\] not in the ir_datasets docs"):
        list(iter_texts("irds:fake/docs", fields="text"))


@pytest.mark.slow
def test_real_enwiki_first_files(enwiki_dir, tmp_path):
    files = sorted((enwiki_dir / "AA").glob("wiki_0[0-2].bz2"))
    assert len(files) == 3
    sub = tmp_path / "AA"
    sub.mkdir()
    for f in files:
        (sub / f.name).symlink_to(f)
    # independent reference: the <doc> tags' title attributes, read with a plain regex
    titles = []
    for f in files:
        with bz2.open(f, "rt", encoding="utf-8") as fh:
            titles += re.findall(r'^<doc id="\d+" url="[^"]*" title="([^"]*)">$', fh.read(), flags=re.M)
    docs = list(iter_wiki_documents(tmp_path))
    assert len(docs) == len(titles) > 30
    assert [d["title"] for d in docs] == titles
    texts = list(iter_texts(f"wiki:{tmp_path}"))
    assert len(texts) == len(titles)
    assert texts[0].startswith("Anarchism\nAnarchism is a political philosophy")
    assert all("<doc" not in t and "</doc>" not in t for t in texts)
    assert sum(len(t.split()) for t in texts) > 100_000


@pytest.mark.slow
def test_real_enwiki_cache_matches_direct_tokenisation(enwiki_dir, tok, tmp_path):
    cache = TokenCache.build_or_load(f"wiki:{enwiki_dir}", tok, 128, tmp_path / "c", max_docs=8, progress=False)
    texts = list(iter_texts(f"wiki:{enwiki_dir}", max_docs=8))
    direct = [t for text in texts for t in tok(text, add_special_tokens=False, verbose=False)["input_ids"]]
    lengths = cache.lengths()
    assert np.asarray(cache.tokens).tolist() == direct
    assert lengths.max() <= 126 and cache.num_documents == 8
    # sentence-boundary packing keeps most blocks close to full but rarely exactly full
    assert 0.7 * 126 < lengths.mean() < 126


# ----------------------------------------------------------------------------- packing

def test_split_sentences_hand_example():
    text = 'He said "Stop." Then it ended. See e.g. the rest!  Why? 3 more.\nNew line here'
    assert split_sentences(text) == ['He said "Stop."', "Then it ended.", "See e.g. the rest!", "Why?", "3 more.",
                                     "New line here"]
    assert split_sentences("  \n\n ") == []


def test_pack_sentences_hand_example():
    s = lambda n, v: [v] * n  # noqa: E731
    blocks = pack_sentences([s(3, 1), s(4, 2), s(2, 3), s(6, 4)], max_content=7)
    assert blocks == [s(3, 1) + s(4, 2), s(2, 3), s(6, 4)]
    # a sentence longer than the block is cut; its tail is continued by the next sentence
    blocks = pack_sentences([s(2, 1), s(16, 2), s(3, 3)], max_content=7)
    assert blocks == [s(2, 1), s(7, 2), s(7, 2), s(2, 2) + s(3, 3)]
    assert pack_sentences([[], []], 5) == []
    with pytest.raises(ValueError):
        pack_sentences([[1]], 0)
    # the same rule on lengths alone (what the cache build packs with)
    assert block_lengths([3, 4, 2, 6], 7) == [7, 2, 6]
    assert block_lengths([2, 16, 0, 3], 7) == [2, 7, 7, 5]
    assert block_lengths([0, 0], 5) == []


def test_pack_texts_respects_length_and_sentence_boundaries(tok):
    text = " ".join(f"Sentence number {i} talks about topic{i} in some words." for i in range(40))
    max_length = 40
    (blocks,) = pack_texts([text], tok, max_length)
    direct = tok(text, add_special_tokens=False)["input_ids"]
    assert [t for b in blocks for t in b] == direct
    assert all(len(b) <= max_length - 2 for b in blocks)
    assert len(blocks) > 5
    # every block ends on a sentence boundary (no sentence here is longer than a block)
    sent_lens = [len(tok(s, add_special_tokens=False)["input_ids"]) for s in split_sentences(text)]
    assert max(sent_lens) <= max_length - 2
    boundaries = set(np.cumsum(sent_lens).tolist())
    assert set(np.cumsum([len(b) for b in blocks]).tolist()) <= boundaries
    # greedy: the next block's first sentence would not have fitted
    ends = np.cumsum([len(b) for b in blocks]).tolist()
    starts = [0] + ends[:-1]
    for b, (st, en) in enumerate(zip(starts[1:], ends[1:])):
        first = next(n for c, n in zip(np.cumsum(sent_lens).tolist(), sent_lens) if c - n == st)
        assert len(blocks[b]) + first > max_length - 2
    # short documents stay separate blocks
    assert pack_texts(["One.", "Two."], tok, 512) == [[[tok.convert_tokens_to_ids("one"), 1012]],
                                                     [[tok.convert_tokens_to_ids("two"), 1012]]]


# ----------------------------------------------------------------------------- cache

@pytest.fixture()
def jsonl(tmp_path) -> Path:
    return _write_jsonl(tmp_path / "corpus.jsonl", DOCS)


def test_cache_roundtrip_equals_direct_tokenisation(jsonl, tok, tmp_path):
    cache = TokenCache.build_or_load(str(jsonl), tok, 32, tmp_path / "cache", batch_docs=2, progress=False)
    texts = list(iter_texts(str(jsonl)))
    direct = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    flat = [t for i in range(len(cache)) for t in cache[i]]
    assert flat == [t for d in direct for t in d]
    assert all(1 <= len(cache[i]) <= 30 for i in range(len(cache)))
    # no block spans two documents: the cumulative block lengths hit every document end
    doc_ends = set(np.cumsum([len(d) for d in direct]).tolist())
    assert doc_ends <= set(np.cumsum(cache.lengths()).tolist())
    assert len(cache) >= sum(math.ceil(len(d) / 30) for d in direct)
    assert cache.num_documents == len(texts) and cache.num_texts == len(cache)
    assert cache.meta["dtype"] == "uint16" and cache.tokens.dtype == np.uint16
    assert cache[-1] == cache[len(cache) - 1]
    with pytest.raises(IndexError):
        cache[len(cache)]
    # picklable for DataLoader workers without copying the memmap
    clone = pickle.loads(pickle.dumps(cache))
    assert len(pickle.dumps(cache)) < 10_000 and clone[3] == cache[3]
    assert TokenCache(cache.path)[0] == cache[0]


def test_cache_reuse_and_keys(jsonl, tok, tmp_path, monkeypatch):
    cdir = tmp_path / "cache"
    first = TokenCache.build_or_load(str(jsonl), tok, 32, cdir, progress=False)
    mtime = (first.path / "tokens.bin").stat().st_mtime_ns

    def no_build(*a, **k):
        raise AssertionError("rebuilt an existing cache")
    monkeypatch.setattr(TokenCache, "_build", staticmethod(no_build))
    again = TokenCache.build_or_load(str(jsonl), tok, 32, cdir, progress=False)
    assert again.path == first.path and (again.path / "tokens.bin").stat().st_mtime_ns == mtime
    monkeypatch.undo()
    other_len = TokenCache.cache_path(str(jsonl), tok, 64, cdir)
    other_fields = TokenCache.cache_path(str(jsonl), tok, 32, cdir, fields="text")
    other_max = TokenCache.cache_path(str(jsonl), tok, 32, cdir, max_docs=2)
    tok2 = tok.__class__.from_pretrained(tok.name_or_path, do_lower_case=False)
    assert tokenizer_fingerprint(tok2) != tokenizer_fingerprint(tok)
    other_tok = TokenCache.cache_path(str(jsonl), tok2, 32, cdir)
    paths = {first.path, other_len, other_fields, other_max, other_tok}
    assert len(paths) == 5
    # the same tokenizer saved elsewhere (e.g. in a run's output dir) reuses the cache
    tok.save_pretrained(tmp_path / "tokcopy")
    same = tok.__class__.from_pretrained(tmp_path / "tokcopy")
    assert TokenCache.cache_path(str(jsonl), same, 32, cdir) == first.path
    # an edited corpus gets a new cache
    _write_jsonl(jsonl, DOCS[:2])
    os.utime(jsonl, ns=(mtime + 10**9, mtime + 10**9))
    assert TokenCache.cache_path(str(jsonl), tok, 32, cdir) != first.path


def test_crash_mid_build_leaves_no_complete_cache(jsonl, tok, tmp_path, monkeypatch):
    cdir = tmp_path / "cache"
    calls = []
    real = blocks_mod._sentence_ids

    def flaky(texts, tokenizer, backend=None):
        calls.append(len(texts))
        if len(calls) == 2:
            raise RuntimeError("simulated crash")
        return real(texts, tokenizer, backend)
    monkeypatch.setattr(blocks_mod, "_sentence_ids", flaky)
    with pytest.raises(RuntimeError, match="simulated crash"):
        TokenCache.build_or_load(str(jsonl), tok, 32, cdir, batch_docs=1, progress=False, num_threads=1)
    path = TokenCache.cache_path(str(jsonl), tok, 32, cdir)
    assert not path.exists()
    assert not list(cdir.glob("*.tmp-*"))
    with pytest.raises(FileNotFoundError):
        TokenCache(path)
    monkeypatch.undo()
    # a killed build's temp dir (no cleanup ran) is ignored and removed by the next build
    stale = cdir / (path.name + ".tmp-99999-deadbeef")
    stale.mkdir()
    (stale / "meta.json").write_text('{"complete": true}')
    cache = TokenCache.build_or_load(str(jsonl), tok, 32, cdir, progress=False)
    assert cache.path == path and not stale.exists() and len(cache) > 0


def _cache_files(cache: TokenCache) -> dict[str, bytes]:
    files = {name: (cache.path / name).read_bytes() for name in ("tokens.bin", "offsets.bin", "df.npy")}
    meta = {k: v for k, v in cache.meta.items() if k not in ("build_seconds", "created")}
    return {**files, "meta.json": json.dumps(meta, sort_keys=True).encode()}


@pytest.mark.parametrize("num_threads", [2, 3])
def test_parallel_build_is_byte_identical(jsonl, tok, tmp_path, num_threads):
    """Several tokenizing threads write the same bytes as the single-thread build."""
    docs = DOCS + [{"_id": f"x{i}", "title": f"T{i}", "text": f"Sentence {i} about rivers. And mountains {i}! " * (i % 7)}
                   for i in range(40)]
    _write_jsonl(jsonl, docs)
    one = TokenCache.build_or_load(str(jsonl), tok, 24, tmp_path / "one", batch_docs=3, progress=False, num_threads=1)
    many = TokenCache.build_or_load(str(jsonl), tok, 24, tmp_path / "many", batch_docs=3, progress=False,
                                    num_threads=num_threads)
    assert _cache_files(one) == _cache_files(many)
    assert len(one) > 40


@pytest.mark.slow
def test_parallel_build_is_byte_identical_on_real_wikipedia(enwiki_dir, tok, tmp_path):
    spec = f"wiki:{enwiki_dir}"
    one = TokenCache.build_or_load(spec, tok, 128, tmp_path / "one", max_docs=60, batch_docs=8, progress=False,
                                   num_threads=1)
    two = TokenCache.build_or_load(spec, tok, 128, tmp_path / "two", max_docs=60, batch_docs=8, progress=False,
                                   num_threads=2)
    assert _cache_files(one) == _cache_files(two)
    assert one.num_documents == 60
    # reference: every sentence tokenized on its own by the Hugging Face call, packed per document
    naive = []
    for text in iter_texts(spec, max_docs=60):
        sents = [tok(x, add_special_tokens=False)["input_ids"] for x in split_sentences(text)]
        naive += pack_sentences(sents, 126)
    assert [two[i] for i in range(len(two))] == naive


def test_fast_backend_gives_the_tokenizer_call_ids(tok):
    """The Rust backend copy the build tokenizes with gives the ids of the Hugging Face call, also after the
    wrapper was used with truncation (which leaves truncation set on the wrapper's own backend)."""
    texts = ["A first document. It has two sentences!", "Second one: Über naïve café, 3.14 e.g. fine.\nNew line",
             "", "word " * 300]
    want = encode_corpus_batch(texts, tok, 64)
    tok(["x " * 50], truncation=True, max_length=8)  # leaves truncation on tok.backend_tokenizer
    assert tok.backend_tokenizer.truncation is not None
    got = encode_corpus_batch(texts, tok, 64, backend=fast_backend(tok))
    assert got[0] == want[0] == 3
    for a, b in zip(got[1], want[1]):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert fast_backend(_PoisonTokenizer(tok)) is None  # any other tokenizer is called as it is


class _PoisonTokenizer:
    """A real tokenizer, except that a sentence containing "poison" gets an id outside the vocabulary."""

    def __init__(self, tok):
        self.tok = tok

    def __getattr__(self, name):
        if name == "tok":
            raise AttributeError(name)
        return getattr(self.tok, name)

    def __len__(self):
        return len(self.tok)

    def __call__(self, texts, **kw):
        ids = self.tok(texts, **kw)["input_ids"]
        return {"input_ids": [x + [len(self.tok)] if "poison" in t else x for t, x in zip(texts, ids)]}


def test_bad_tokenizer_output_leaves_no_cache(jsonl, tok, tmp_path):
    _write_jsonl(jsonl, DOCS * 3 + [{"_id": "p", "title": "", "text": "poison"}] + DOCS * 3)
    with pytest.raises(ValueError, match="outside its vocabulary"):
        TokenCache.build_or_load(str(jsonl), _PoisonTokenizer(tok), 32, tmp_path / "c", batch_docs=1, progress=False,
                                 num_threads=2)
    # neither the cache nor a .tmp- build is left (only the lock file)
    assert [p.suffix for p in (tmp_path / "c").iterdir()] == [".lock"]


def test_tokenizing_thread_failure_leaves_no_cache(jsonl, tok, tmp_path, monkeypatch):
    """An error in one of the tokenizing threads reaches the caller and leaves no cache."""
    _write_jsonl(jsonl, DOCS * 5 + [{"_id": "p", "title": "", "text": "poison"}] + DOCS * 5)
    real = blocks_mod._sentence_ids
    threads = set()

    def poisoned(texts, tokenizer, backend=None):
        threads.add(threading.current_thread().name)
        if any("poison" in t for t in texts):
            raise RuntimeError("simulated failure in a tokenizing thread")
        return real(texts, tokenizer, backend)
    monkeypatch.setattr(blocks_mod, "_sentence_ids", poisoned)
    with pytest.raises(RuntimeError, match="simulated failure"):
        TokenCache.build_or_load(str(jsonl), tok, 32, tmp_path / "c", batch_docs=1, progress=False, num_threads=2)
    assert threads and all(name.startswith("tokenize") for name in threads)  # it ran on the threads
    assert [p.suffix for p in (tmp_path / "c").iterdir()] == [".lock"]


def test_document_frequency_and_idf(jsonl, tok, tmp_path):
    cache = TokenCache.build_or_load(str(jsonl), tok, 16, tmp_path / "c", progress=False)
    naive = collections.Counter(t for i in range(len(cache)) for t in set(cache[i]))
    df = cache.document_frequency()
    assert df.shape == (len(tok),) and df.dtype == np.int64
    assert {int(i): int(df[i]) for i in np.nonzero(df)[0]} == dict(naive)
    idf = idf_weights(cache)
    n = len(cache)
    for t in list(naive)[:20] + [tok.convert_tokens_to_ids("zebra")]:
        assert idf[t].item() == pytest.approx(math.log((n + 1) / (naive.get(t, 0) + 1)) + 1, rel=1e-6)
    # hand example: N=4, df=[0, 2, 4]
    assert idf_weights(np.array([0, 2, 4]), 4).tolist() == pytest.approx([math.log(5) + 1, math.log(5 / 3) + 1, 1.0])
    assert idf_weights(np.array([0, 2]), 2, smoothing=0.5).tolist() == pytest.approx([math.log(5) + 1, 1.0])
    with pytest.raises(ValueError, match="num_texts"):
        idf_weights(np.array([1]))
    with pytest.raises(ValueError, match="within"):
        idf_weights(np.array([5]), 4)


def test_dtype_choice_and_large_vocab(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    assert token_dtype(30522) == np.uint16 and token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(70000)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    big = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    p = tmp_path / "big.txt"
    p.write_text("w1 w65535 w65536 w69999.\nw3 w3 zzz\n")
    cache = TokenCache.build_or_load(str(p), big, 8, tmp_path / "c", progress=False)
    assert cache.meta["dtype"] == "uint32"
    assert [cache[i] for i in range(len(cache))] == [[2, 65536, 65537, 70000, 0], [4, 4, 0]]
    assert cache.document_frequency()[[0, 4, 70000]].tolist() == [2, 1, 1]


def test_cache_bad_inputs(jsonl, tok, tmp_path):
    with pytest.raises(ValueError, match="max_length"):
        TokenCache.build_or_load(str(jsonl), tok, 2, tmp_path)
    with pytest.raises(FileNotFoundError, match="corpus not found"):
        TokenCache.build_or_load(str(tmp_path / "nope.jsonl"), tok, 32, tmp_path)
    p = tmp_path / "punct.txt"
    p.write_text("\u200b\n")  # a zero-width space: text, but no tokens
    with pytest.raises(ValueError, match="no text that the tokenizer turns into tokens"):
        TokenCache.build_or_load(str(p), tok, 32, tmp_path / "c", progress=False)
    assert not list((tmp_path / "c").glob("*/meta.json"))


@pytest.mark.multiproc
def test_concurrent_processes_build_once(jsonl, minilm_path, tmp_path):
    log = tmp_path / "builds.log"
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from transformers import AutoTokenizer
        from pretrain.data.corpus import TokenCache
        real = TokenCache._build
        def logged(*a, **k):
            with open({str(log)!r}, "a") as f:
                f.write("build\\n")
            import time; time.sleep(1.0)
            return real(*a, **k)
        TokenCache._build = staticmethod(logged)
        tok = AutoTokenizer.from_pretrained({minilm_path!r})
        c = TokenCache.build_or_load({str(jsonl)!r}, tok, 32, {str(tmp_path / 'cache')!r}, progress=False)
        print(len(c), sum(len(c[i]) for i in range(len(c))), c.path)
    """)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    procs = [subprocess.Popen([warm_python(), "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "LOCAL_RANK": str(r)}) for r in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert log.read_text().count("build") == 1
    assert len({o[0] for o in outs}) == 1


def test_tokenizer_fingerprint_follows_the_tokenizer_and_ignores_truncation(minilm_path):
    """The fingerprint (remembered per serialised backend) changes with the vocabulary, even for the same object,
    and not with the truncation/padding state; it equals the canonical form's hash computed here from scratch."""
    import hashlib

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm_path)
    state = json.loads(tok.backend_tokenizer.to_str())
    state.pop("truncation", None)
    state.pop("padding", None)
    expected = hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()[:16]
    assert tokenizer_fingerprint(tok) == expected == tokenizer_fingerprint(tok)
    tok.backend_tokenizer.enable_truncation(max_length=7)
    tok.backend_tokenizer.enable_padding(length=9)
    assert tokenizer_fingerprint(tok) == expected
    tok.add_tokens(["zzqxword"])
    assert tokenizer_fingerprint(tok) != expected
