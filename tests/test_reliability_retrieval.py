"""Reliability of the retrieval side (issue 9): one test per promise of the README's encoder and retriever
error-behaviour paragraphs — a rebuilt index is noticed, a read-only index is searchable, and bad input (``k``,
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
from pyterrier_cpdae import retrievers

sys.path.insert(0, str(Path(__file__).parent))
from test_dense_index import DIM, assert_matches_naive, built, make_docs, make_topics  # noqa: E402,F401


# ------------------------------------------------------------------------------------------- k and num_results
@pytest.mark.parametrize("k", [-1, 0, 2.5, "10", None, True])
def test_search_refuses_a_bad_k(built, k):
    """issue 9 #23: ``index.search(q, -1)`` said numpy's "negative dimensions are not allowed"."""
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
    (lambda ix: ix.torch_retriever(chunk_size=0), "block_size"),
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
    """issue 9 #2: the retriever kept its in-memory FAISS structure after ``mode="overwrite"``: the old rows'
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


def test_faiss_structure_in_memory_is_kept_while_the_vectors_are_unchanged(tmp_path, monkeypatch):
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
    index.indexer(mode="overwrite").index(docs)  # the same vectors again: the files change, the fingerprint not
    assert_matches_naive(retriever(topics), topics, vecs, 5)
    assert len(builds) == 1


# ------------------------------------------------------------------------------------ FAISS: read-only index
def _fail_with_erofs(*args, **kwargs):
    raise OSError(30, "Read-only file system")


@pytest.mark.parametrize("step", ["mkdir", "write_index", "write_json"])
def test_faiss_search_works_when_the_cache_cannot_be_written(tmp_path, monkeypatch, step):
    """issue 9 #3: ``OSError: Read-only file system`` writing the cache blocked the search.  (Tests run as root,
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
        monkeypatch.setattr(retrievers.io, "write_json_atomic", _fail_with_erofs)
    monkeypatch.setattr(retrievers, "_UNCACHEABLE", set())
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
