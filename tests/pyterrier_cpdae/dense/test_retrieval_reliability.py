"""Reliability of the retrieval side: one test per promise of docs/reliability.md about the
encoder and the retrievers — a rebuilt index is noticed, a read-only index is searchable, and bad input (``k``,
texts, vectors, paths) gets an error that names the problem.

References: retrieval results are compared with a naive full numpy sort (``naive_topk``).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pyterrier_cpdae import DenseIndex
from pyterrier_cpdae.dense import faiss_retr as _faiss_retr

from tests.helpers.dense import DIM, assert_matches_naive, make_docs, make_topics  # noqa: F401


# ------------------------------------------------------------------------------------------- k and num_results
@pytest.mark.parametrize("k", [-1, 0, 2.5, "10", None, True])
def test_search_refuses_a_bad_k(built, k):
    """``index.search(q, -1)`` said numpy's "negative dimensions are not allowed"."""
    index, _ = built
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
def test_every_retriever_factory_refuses_a_bad_num_results(built, factory, num_results):
    index, _ = built
    with pytest.raises(ValueError, match=r"num_results must be an integer >= 1, got"):
        factory(index, num_results=num_results)


@pytest.mark.parametrize("factory, option", [
    (lambda ix: ix.np_retriever(block_size=0), "block_size"),
    (lambda ix: ix.np_retriever(query_batch_size=-5), "query_batch_size"),
    (lambda ix: ix.torch_retriever(chunk_size=0), "chunk_size"),
    (lambda ix: ix.faiss_hnsw_retriever(ef_search=0), "ef_search"),
    (lambda ix: ix.faiss_hnsw_retriever(neighbours=1.5), "neighbours"),
    (lambda ix: ix.faiss_ivf_retriever(n_probe=0), "n_probe"),
    (lambda ix: ix.faiss_ivf_retriever(n_list=-3), "n_list"),
    (lambda ix: ix.faiss_flat_retriever(query_batch_size=0), "query_batch_size"),
])
def test_retrievers_refuse_bad_integer_options_when_created(built, factory, option):
    index, _ = built
    with pytest.raises(ValueError, match=rf"{option} must be an integer >= 1"):
        factory(index)


def test_search_kernel_options_are_checked(built):
    index, _ = built
    q = np.zeros((1, DIM), dtype=np.float32)
    with pytest.raises(ValueError, match="block_size must be an integer >= 1, got 0"):
        index.search(q, 5, backend="numpy", block_size=0)
    with pytest.raises(ValueError, match="chunk_size must be an integer >= 1, got 0"):
        index.search(q, 5, backend="torch", chunk_size=0)


def test_rank_cutoff_keeps_its_meaning(built):
    """``retriever % k`` is fused for 1 <= k < num_results and still matches the naive top k."""
    index, vecs = built
    topics = make_topics(3)
    for r in (index.np_retriever(num_results=20), index.faiss_flat_retriever(num_results=20)):
        assert_matches_naive((r % 7)(topics), topics, vecs, 7)


# ------------------------------------------------------------------------------------- FAISS: rebuilt index
@pytest.mark.parametrize("factory", [
    lambda ix: ix.faiss_flat_retriever(num_results=10),
    lambda ix: ix.faiss_ivf_retriever(num_results=10, n_list=4, n_probe=4),  # all lists probed: exact
], ids=["flat", "ivf"])
def test_faiss_retriever_notices_an_overwritten_index(tmp_path, factory):
    """The retriever kept its in-memory FAISS structure after ``mode="overwrite"``: the old rows'
    scores came back under the new index's docnos."""
    docs, vecs = make_docs(300)
    index = DenseIndex(tmp_path / "ix")
    index.indexer().index(docs)
    retriever = factory(index)
    topics = make_topics(4)
    assert_matches_naive(retriever(topics), topics, vecs, 10)
    docs2, vecs2 = make_docs(300, seed=7)
    index.indexer(mode="overwrite").index(docs2)
    assert_matches_naive(retriever(topics), topics, vecs2, 10)
    # a rebuild by another DenseIndex object (e.g. another process) of the same directory is noticed too
    docs3, vecs3 = make_docs(200, seed=8)
    DenseIndex(tmp_path / "ix").indexer(mode="overwrite").index(docs3)
    assert_matches_naive(retriever(topics), topics, vecs3, 10)


def test_faiss_structure_in_memory_is_kept_until_the_index_is_rebuilt(tmp_path, monkeypatch):
    docs, vecs = make_docs(300)
    index = DenseIndex(tmp_path / "ix")
    index.indexer().index(docs)
    retriever = index.faiss_flat_retriever(num_results=5)
    builds = []
    build = retriever._build
    monkeypatch.setattr(retriever, "_build", lambda faiss: builds.append(1) or build(faiss))
    topics = make_topics(2)
    retriever(topics)
    retriever(topics)
    assert len(builds) == 1
    import os
    for name in ("pt_meta.json", "vectors.bin"):  # files touched (a copy, a backup tool), not rebuilt: kept
        os.utime(index.path / name, ns=(1, 1))
    assert_matches_naive(retriever(topics), topics, vecs, 5)
    assert len(builds) == 1
    index.indexer(mode="overwrite").index(docs)  # a rebuild has a new build id: never trusted to be the same
    assert_matches_naive(retriever(topics), topics, vecs, 5)
    assert len(builds) == 2


# ------------------------------------------------------------------------------------ FAISS: read-only index
def _fail_with_erofs(*args, **kwargs):
    raise OSError(30, "Read-only file system")


@pytest.mark.parametrize("step", ["mkdir", "write_index", "write_json"])
def test_faiss_search_works_when_the_cache_cannot_be_written(tmp_path, monkeypatch, step):
    """``OSError: Read-only file system`` writing the cache blocked the search.  (Tests run as root,
    which ignores chmod, so the failing write is simulated here; the next test uses a real read-only mount.)"""
    import faiss

    docs, vecs = make_docs(300)
    index = DenseIndex(tmp_path / "ix")
    index.indexer().index(docs)
    if step == "mkdir":
        monkeypatch.setattr(Path, "mkdir", _fail_with_erofs)
    elif step == "write_index":
        def write_index(idx, path):  # what faiss raises when fopen fails
            raise RuntimeError(f"Error in FileIOWriter: could not open {path} for writing: Read-only file system")
        monkeypatch.setattr(faiss, "write_index", write_index)
    else:
        monkeypatch.setattr(_faiss_retr.io, "write_json_atomic", _fail_with_erofs)
    monkeypatch.setattr(_faiss_retr, "_UNCACHEABLE", set())
    topics = make_topics(3)
    with pytest.warns(RuntimeWarning, match=r"could not cache the FAISS index in .*ix/faiss.*Read-only file system"):
        assert_matches_naive(index.faiss_flat_retriever(num_results=8)(topics), topics, vecs, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per directory, not per retriever
        assert_matches_naive(index.faiss_flat_retriever(num_results=8)(topics), topics, vecs, 8)
    assert not list((tmp_path / "ix").rglob("*.tmp"))  # no partial cache file left behind


_RO_SCRIPT = """
import json, sys, warnings
import numpy as np, pandas as pd
from pyterrier_cpdae import DenseIndex
q = np.asarray(json.loads(sys.argv[2]), dtype=np.float32)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    res = DenseIndex(sys.argv[1]).faiss_hnsw_retriever(num_results=5)(pd.DataFrame({"qid": ["q0"], "query_vec": [q]}))
print(json.dumps({"docnos": res["docno"].tolist(), "warnings": [str(w.message) for w in caught]}))
"""


def test_faiss_search_on_a_read_only_mount(tmp_path):
    """The same promise on a real read-only bind mount (in a private mount namespace; skipped where the OS
    does not allow one)."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not available")
    docs, vecs = make_docs(300)
    path = tmp_path / "ix"
    DenseIndex(path).indexer().index(docs)
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind {path} {path} && "
                            f"mount -o remount,bind,ro {path} && ! touch {path}/probe 2>/dev/null"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a read-only bind mount here: {probe.stderr.decode().strip()}")
    q = make_topics(1)["query_vec"][0]
    cmd = (f"mount --bind {path} {path} && mount -o remount,bind,ro {path} && "
           f'{sys.executable} -c "$0" {path} \'{json.dumps(q.tolist())}\'')
    out = subprocess.run(["unshare", "-m", "sh", "-c", cmd, _RO_SCRIPT], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    expected = np.argsort(-(vecs @ q))[:5]
    assert result["docnos"] == [f"d{i}" for i in expected]  # HNSW on 300 vectors with efSearch 128: exact
    assert any("Read-only file system" in w for w in result["warnings"])
    assert not (path / "faiss").exists()


# ------------------------------------------------------------------------------------------ corrupt vectors
@pytest.fixture
def corrupt_index(tmp_path):
    """An index whose stored vector of ``d5`` was overwritten with NaN after the build (a damaged file: the
    indexer itself refuses non-finite vectors)."""
    docs, _ = make_docs(300)
    index = DenseIndex(tmp_path / "ix")
    index.indexer().index(docs)
    stored = np.memmap(tmp_path / "ix" / "vectors.bin", dtype="<f4", mode="r+", shape=(300, DIM))
    stored[5] = np.nan
    stored.flush()
    del stored
    return index


@pytest.mark.parametrize("factory", [
    lambda ix: ix.np_retriever(num_results=10), lambda ix: ix.torch_retriever(num_results=10, device="cpu"),
    lambda ix: ix.faiss_flat_retriever(num_results=10), lambda ix: ix.faiss_hnsw_retriever(num_results=10),
], ids=["numpy", "torch", "faiss-flat", "faiss-hnsw"])
def test_every_retriever_refuses_a_corrupt_nan_vector(corrupt_index, factory):
    """Index side: NaN scores were ranked arbitrarily (exact) or the row silently never returned
    (FAISS); every retriever now names the docno and the damaged file."""
    with pytest.raises(ValueError, match=r"d5.* are not finite, so .*ix/vectors.bin is corrupt — rebuild"):
        factory(corrupt_index)(make_topics(2))


def test_dense_scorer_refuses_a_corrupt_nan_vector(corrupt_index):
    """The scorer failed in ``add_ranks`` with pandas' IntCastingNaNError."""
    frame = make_topics(2).assign(docno="d5")
    with pytest.raises(ValueError, match=r"\('q0', 'd5'\).* are not finite, so .*vectors.bin is corrupt"):
        corrupt_index.scorer()(frame)


def test_search_refuses_nan_query_vectors(built):
    index, _ = built
    q = np.zeros((3, DIM), dtype=np.float32)
    q[1, 4] = np.nan
    with pytest.raises(ValueError, match=r"query vector\(s\) at row\(s\) \[1\] contain NaN"):
        index.search(q, 5)


# ------------------------------------------------------------------------------------------------- encoder
@pytest.fixture(scope="module")
def enc(tiny_bert_dir):
    from pyterrier_cpdae import CPDAE

    return CPDAE.from_pretrained(tiny_bert_dir)


def test_encode_a_single_string_is_one_text(enc):
    """``encode_queries("hello")`` encoded each character ((5, dim)); a single string is now one
    text and gives one (dim,) vector, as sentence-transformers' ``encode`` does."""
    for encode in (enc.encode_queries, enc.encode_docs):
        one = encode("hello world")
        assert one.shape == (enc.dim,)
        np.testing.assert_allclose(one, encode(["hello world"])[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("texts, message", [
    (b"hello", r"got a single bytes b'hello'; wrap it in a list"),
    (None, r"expected a list of 'query' strings, got NoneType"),
    (7, r"expected a list of 'query' strings, got int 7"),
])
def test_encode_refuses_what_is_not_a_list_of_strings(enc, texts, message):
    with pytest.raises(TypeError, match=message):
        enc.encode_queries(texts)


def test_text_scorer_names_the_qid_of_a_nan_query_vec(enc):
    """A NaN ``query_vec`` failed in ``add_ranks`` with pandas' IntCastingNaNError."""
    bad = np.zeros(enc.dim, dtype=np.float32)
    bad[3] = np.nan
    frame = pd.DataFrame({"qid": ["q1", "q2"], "query_vec": [np.ones(enc.dim), bad], "docno": ["a", "b"],
                          "text": ["x", "y"]})
    with pytest.raises(ValueError, match=r"query_vec contains NaN or infinite values for qid\(s\) \['q2'\]"):
        enc.text_scorer()(frame)
    frame = pd.DataFrame({"qid": ["q1", "q1"], "query": ["x", "x"], "docno": ["a", "b"],
                          "doc_vec": [np.full(enc.dim, np.inf), np.ones(enc.dim)]})
    with pytest.raises(ValueError, match=r"doc_vec contains NaN or infinite values for docno\(s\) \['a'\]"):
        enc.text_scorer()(frame)


def test_text_scorer_names_the_row_whose_encoded_vector_is_nan(enc, monkeypatch):
    """A model that outputs NaN (e.g. an fp16 overflow) is named by docno instead of failing in add_ranks."""
    encode = enc._encode

    def nan_for_y(texts, max_length, unique):
        out = encode(texts, max_length, unique)
        out[[i for i, t in enumerate(texts) if t == "y"]] = np.nan
        return out

    monkeypatch.setattr(enc, "_encode", nan_for_y)
    frame = pd.DataFrame({"qid": ["q1", "q1"], "query": ["x", "x"], "docno": ["a", "b"], "text": ["x", "y"]})
    with pytest.raises(ValueError, match=r"doc_vec encoded from 'text' contains NaN .* docno\(s\) \['b'\]"):
        enc.text_scorer()(frame)


def test_lone_surrogate_is_named_by_its_row(enc):
    """Texts: ``"\\ud800"`` gave the tokenizer's bare "TextEncodeInput must be ..." TypeError."""
    surrogate = r"'text' at row 1 \(docno='d2'\) is not valid Unicode: it holds the lone surrogate '\\ud800' at character 4"
    frame = pd.DataFrame({"docno": ["d1", "d2"], "text": ["fine", "bad \ud800 text"]}, dtype=object)
    with pytest.raises(ValueError, match=surrogate):
        enc.doc_encoder()(frame)
    records = [{"docno": f"d{i}", "text": "fine"} for i in range(enc.batch_size * enc.sort_window)]
    records.append({"docno": "late", "text": "bad \udfff"})  # in the second window: the row counts from the start
    with pytest.raises(ValueError, match=rf"'text' at row {len(records) - 1} \(docno='late'\) .* lone surrogate"):
        list(enc.doc_encoder().transform_iter(records))
    with pytest.raises(ValueError, match=r"'query' at row 0 \(qid='q1'\) is not valid Unicode"):
        enc.query_encoder()(pd.DataFrame({"qid": ["q1"], "query": ["\ud800"]}, dtype=object))
    with pytest.raises(ValueError, match=r"'query' at row 2 is not valid Unicode"):
        enc.encode_queries(["a", "é", "x\ud83d"])  # half of an emoji's surrogate pair
    assert enc.encode_docs(["é 😀 ü"]).shape == (1, enc.dim)  # valid non-ASCII text is fine


def test_from_pretrained_names_the_missing_config(tiny_bert_dir, tmp_path):
    """A directory without config.json gave transformers' "Unrecognized model" ValueError."""
    from pyterrier_cpdae import CPDAE

    no_config = tmp_path / "no-config"
    shutil.copytree(tiny_bert_dir, no_config)
    (no_config / "config.json").unlink()
    with pytest.raises(OSError, match=r"no-config/config.json does not exist: .* not a Hugging Face model dir"):
        CPDAE.from_pretrained(no_config)


def test_from_pretrained_refuses_a_directory_without_tokenizer_files(tiny_bert_dir, tmp_path):
    """transformers 5 silently builds an empty tokenizer (every word [UNK]) for such a directory: every text
    would get the same vector."""
    from pyterrier_cpdae import CPDAE

    no_tok = tmp_path / "no-tokenizer"
    no_tok.mkdir()
    for f in Path(tiny_bert_dir).iterdir():
        if f.name in ("config.json", "model.safetensors"):
            shutil.copy(f, no_tok)
    with pytest.raises(OSError, match=r"no-tokenizer holds no tokenizer files \(none of .*vocab.txt"):
        CPDAE.from_pretrained(no_tok)


def test_truncated_weights_file_is_named(tiny_bert_dir, tmp_path):
    """A truncated model.safetensors gave safetensors' "invalid header length" without the file."""
    from pyterrier_cpdae import CPDAE

    broken = tmp_path / "truncated"
    shutil.copytree(tiny_bert_dir, broken)
    with open(broken / "model.safetensors", "r+b") as f:
        f.truncate(100)
    enc = CPDAE.from_pretrained(broken)  # config and tokenizer load; the weights on first use
    with pytest.raises(OSError, match=r"cannot read the weights file .*truncated/model.safetensors .*truncated or "
                                      r"corrupt"):
        enc.encode_docs(["x"])


def test_an_unreadable_faiss_cache_is_rebuilt_in_memory(tmp_path, monkeypatch):
    """A cache file that cannot be opened (here a directory where the fingerprint file should be: root ignores
    permissions) is treated as missing: rebuilt, and searched from memory when it cannot be replaced either."""
    docs, vecs = make_docs(300)
    index = DenseIndex(tmp_path / "ix")
    index.indexer().index(docs)
    (tmp_path / "ix" / "faiss" / "flat.json").mkdir(parents=True)
    (tmp_path / "ix" / "faiss" / "flat.faiss").write_bytes(b"not a faiss index")
    monkeypatch.setattr(_faiss_retr, "_UNCACHEABLE", set())
    topics = make_topics(3)
    with pytest.warns(RuntimeWarning, match="could not cache the FAISS index"):
        assert_matches_naive(index.faiss_flat_retriever(num_results=8)(topics), topics, vecs, 8)
