"""Tests of DenseIndex: indexing (resume, shards, bad input), exact/FAISS retrieval and the scorer.

References: exact search is checked against a naive full numpy sort; merged/resumed indexes against an
uninterrupted single build, byte for byte.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyterrier as pt
import pytest

from pyterrier_cpdae.dense import DenseIndex, IncompleteIndexError

from tests.helpers import REPO, index_worker
from tests.helpers.dense import DIM, assert_matches_naive, make_docs, make_topics, naive_topk  # noqa: F401
from tests.helpers.index_worker import synthetic_docs

# ---------------------------------------------------------------------------------------------- retrieval
@pytest.mark.parametrize("factory", [
    lambda ix, k: ix.np_retriever(num_results=k, block_size=256),  # many blocks: exercises the threshold merge
    lambda ix, k: ix.np_retriever(num_results=k),
    lambda ix, k: ix.torch_retriever(num_results=k, device="cpu", chunk_size=500),
    lambda ix, k: ix.faiss_flat_retriever(num_results=k),
    lambda ix, k: ix.retriever(num_results=k),
], ids=["numpy-small-blocks", "numpy", "torch-cpu", "faiss-flat", "auto"])
@pytest.mark.parametrize("k", [1, 10, 300, 5000])
def test_exact_retrievers_match_naive(built, factory, k):
    index, vecs = built
    topics = make_topics(7)
    res = factory(index, k)(topics)
    assert len(res) == 7 * min(k, len(vecs))
    assert_matches_naive(res, topics, vecs, k)


def test_search_api_matches_naive(built):
    index, vecs = built
    q = np.stack(make_topics(5)["query_vec"])
    for backend in ("numpy", "torch"):
        scores, ids = index.search(q, 20, backend=backend)
        ref_s, ref_i = naive_topk(vecs, q, 20)
        assert scores.dtype == np.float32 and ids.dtype == np.int64 and ids.shape == (5, 20)
        np.testing.assert_array_equal(ids, ref_i)
        np.testing.assert_allclose(scores, ref_s, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="shape"):
        index.search(np.zeros((2, DIM + 1), dtype=np.float32), 5)


def test_hnsw_recall(built):
    index, vecs = built
    topics = make_topics(50)
    res = index.faiss_hnsw_retriever(num_results=10, neighbours=16, ef_search=64)(topics)
    _, ref_ids = naive_topk(vecs, np.stack(topics["query_vec"]), 10)
    recall = np.mean([len(set(res[res.qid == qid].docid) & set(ref_ids[j])) / 10
                      for j, qid in enumerate(topics.qid)])
    assert recall >= 0.95
    assert list(res.groupby("qid")["rank"].min()) == [0] * 50
    assert (Path(index.path) / "faiss" / "hnsw_neighbours16_ef_construction40.faiss").exists()


def test_ivf(built):
    index, vecs = built
    topics = make_topics(20)
    n_list = 16
    # probing every list is exhaustive: identical to exact search
    res = index.faiss_ivf_retriever(num_results=10, n_list=n_list, n_probe=n_list)(topics)
    assert_matches_naive(res, topics, vecs, 10)
    # IVF-PQ is lossy but must still find most true neighbours among its top 50
    pq = index.faiss_ivf_retriever(num_results=50, n_list=n_list, n_probe=n_list, pq_m=8)(topics)
    _, ref_ids = naive_topk(vecs, np.stack(topics["query_vec"]), 10)
    recall = np.mean([len(set(pq[pq.qid == qid].docid) & set(ref_ids[j])) / 10 for j, qid in enumerate(topics.qid)])
    assert recall >= 0.6
    with pytest.raises(ValueError, match="pq_m=5 must divide"):
        index.faiss_ivf_retriever(n_list=n_list, pq_m=5)(topics)


def test_faiss_cache_rebuilt_when_stale(tmp_path):
    docs, vecs = make_docs(500)
    index = DenseIndex(tmp_path / "ix")
    index.indexer().index(docs)
    topics = make_topics(3)
    index.faiss_flat_retriever(num_results=5)(topics)
    cached = tmp_path / "ix" / "faiss" / "flat.faiss"
    assert cached.exists()
    docs2, vecs2 = make_docs(500, seed=5)
    index.indexer(mode="overwrite").index(docs2)
    index.faiss_flat_retriever(num_results=5)(topics)  # old cache deleted by overwrite, rebuilt
    # make the cache stale by hand: an index rebuilt with different vectors but the same cache file
    other = DenseIndex(tmp_path / "other")
    other.indexer().index(docs)
    other.faiss_flat_retriever(num_results=5)(topics)
    os.replace(tmp_path / "other" / "faiss" / "flat.faiss", cached)
    os.replace(tmp_path / "other" / "faiss" / "flat.json", tmp_path / "ix" / "faiss" / "flat.json")
    res = index.faiss_flat_retriever(num_results=5)(topics)
    assert_matches_naive(res, topics, vecs2, 5)  # the stale cache (vectors of `docs`) was detected and rebuilt


def test_empty_input_and_transformer_protocol(built):
    index, _ = built
    empty = make_topics(0)
    for r in (index.np_retriever(), index.torch_retriever(device="cpu"), index.faiss_flat_retriever()):
        out = r(empty)
        assert len(out) == 0
        assert {"qid", "query", "query_vec", "docno", "docid", "score", "rank"} <= set(out.columns)
    a, b = index.np_retriever(num_results=100), index.np_retriever(num_results=100)
    assert a == b and hash(a) == hash(b) and a != index.np_retriever(num_results=10)
    assert "num_results=100" in repr(a)
    assert a.fuse_rank_cutoff(10) == index.np_retriever(num_results=10)
    assert a.fuse_rank_cutoff(500) is None
    res = (a % 3)(make_topics(2))
    assert len(res) == 6
    one = index.np_retriever(num_results=1)(make_topics(1))  # a single result row
    assert len(one) == 1 and one["rank"].tolist() == [0] and isinstance(one["docno"].iloc[0], str)
    with pytest.raises(Exception, match="query_vec"):
        index.np_retriever()(pd.DataFrame({"qid": ["1"], "query": ["x"]}))
    with pytest.raises(ValueError, match="dimension"):
        index.np_retriever()(pd.DataFrame({"qid": ["1"], "query_vec": [np.zeros(DIM + 2, np.float32)]}))


def test_float16_index(tmp_path):
    docs, vecs = make_docs(1000)
    index = DenseIndex(tmp_path / "f16")
    index.indexer(dtype="float16").index(docs)
    assert index.dtype == "float16" and index.vectors().dtype == np.float16
    assert (tmp_path / "f16" / "vectors.bin").stat().st_size == 1000 * DIM * 2
    rounded = vecs.astype(np.float16).astype(np.float32)
    topics = make_topics(5)
    for r in (index.np_retriever(num_results=20, block_size=128), index.torch_retriever(num_results=20, device="cpu")):
        assert_matches_naive(r(topics), topics, rounded, 20)
    with pytest.raises(ValueError, match="overflow"):
        DenseIndex(tmp_path / "of").indexer(dtype="float16").index([{"docno": "a", "doc_vec": np.full(DIM, 1e6)}])


def test_scorer(built):
    index, vecs = built
    topics = make_topics(2)
    inp = pd.DataFrame({"qid": ["q0", "q0", "q1"], "docno": ["d5", "d17", "d2999"],
                        "query_vec": [topics.query_vec[0], topics.query_vec[0], topics.query_vec[1]]})
    out = index.scorer()(inp)
    expected = {("q0", "d5"): vecs[5] @ topics.query_vec[0], ("q0", "d17"): vecs[17] @ topics.query_vec[0],
                ("q1", "d2999"): vecs[2999] @ topics.query_vec[1]}
    for row in out.itertuples():
        assert row.score == pytest.approx(expected[(row.qid, row.docno)], rel=1e-5)
        assert row.docid == int(row.docno[1:])
    q0 = out[out.qid == "q0"]
    assert list(q0["rank"]) == [0, 1] and q0.score.iloc[0] >= q0.score.iloc[1]
    # unknown docnos are named -- never silently mapped to the last (or any other) vector
    bad = inp.assign(docno=["d5", "nope", "d30000"])
    with pytest.raises(KeyError, match="nope.*d30000"):
        index.scorer()(bad)


def test_scorer_leading_zero_docnos_are_unknown(tmp_path):
    # integer-like docnos get npids' integer codecs; "007" must not be found as "7"
    docs = [{"docno": str(i), "doc_vec": np.full(DIM, i, np.float32)} for i in range(300)]
    index = DenseIndex(tmp_path / "ints")
    index.indexer().index(docs)
    inp = pd.DataFrame({"qid": ["q"], "docno": ["007"], "query_vec": [np.ones(DIM, np.float32)]})
    with pytest.raises(KeyError, match="007"):
        index.scorer()(inp)
    assert index.scorer()(inp.assign(docno=["7"])).score.iloc[0] == pytest.approx(7 * DIM)


def test_artifact_load(built):
    index, _ = built
    loaded = pt.Artifact.load(str(index.path))
    assert isinstance(loaded, DenseIndex) and len(loaded) == 3000 and loaded.dim == DIM
    meta = json.loads((Path(index.path) / "pt_meta.json").read_text())
    assert meta["type"] == "dense_index" and meta["format"] == "cpdae" and meta["package_hint"] == "pyterrier-cpdae"
    assert (meta["dim"], meta["count"], meta["dtype"]) == (DIM, 3000, "float32")


# ---------------------------------------------------------------------------------------------- indexing
def test_compose_with_transformer_and_dataframes(tmp_path):
    docs, vecs = make_docs(250)
    texts = [{"docno": d["docno"], "text": f"text {i}"} for i, d in enumerate(docs)]
    enc = pt.apply.doc_vec(lambda row: vecs[int(row["docno"][1:])] * 2)
    index = DenseIndex(tmp_path / "composed")
    (enc >> index.indexer()).index(texts)
    np.testing.assert_array_equal(np.asarray(index.vectors()), vecs * 2)
    assert list(index.docnos.fwd) == [d["docno"] for d in docs]
    # DataFrames: a single frame, and an iterable of frames
    frame = pd.DataFrame(docs)
    DenseIndex(tmp_path / "df").indexer().index(frame)
    DenseIndex(tmp_path / "dfs").indexer().index([frame.iloc[:100], frame.iloc[100:]])
    for name in ("df", "dfs"):
        np.testing.assert_array_equal(np.asarray(DenseIndex(tmp_path / name).vectors()), vecs)


def test_docno_types(tmp_path):
    index = DenseIndex(tmp_path / "ints")
    index.indexer().index([{"docno": np.int64(i), "doc_vec": np.ones(DIM)} for i in range(3)])
    assert list(index.docnos.fwd) == ["0", "1", "2"]
    with pytest.raises(ValueError, match="docno must be a str.*float"):
        DenseIndex(tmp_path / "floats").indexer().index([{"docno": 1.0, "doc_vec": np.ones(DIM)}])
    assert not DenseIndex(tmp_path / "floats").built()


@pytest.mark.parametrize("records, message", [
    ([{"docno": "a"}], r"missing column\(s\) \['doc_vec'\]"),
    ([{"doc_vec": np.ones(DIM)}], r"missing column\(s\) \['docno'\]"),
    (pd.DataFrame({"docno": ["a"]}), r"missing column\(s\) \['doc_vec'\]"),
    ([{"docno": "a", "doc_vec": np.ones(DIM)}, {"docno": "b", "doc_vec": np.ones(DIM + 1)}],
     r"docno 'b' has dimension 17, expected 16"),
    ([{"docno": "a", "doc_vec": np.ones((2, DIM))}], "1-d vector"),
    ([{"docno": "a", "doc_vec": np.full(DIM, np.nan)}], r"NaN or infinite.*\['a'\]"),
    ([{"docno": "", "doc_vec": np.ones(DIM)}], "empty docno"),
    ([{"docno": "a\nb", "doc_vec": np.ones(DIM)}], "line break"),
])
def test_bad_input(tmp_path, records, message):
    index = DenseIndex(tmp_path / "bad")
    with pytest.raises(ValueError, match=message):
        index.indexer().index(records)
    assert not index.built()


def test_wrong_dimension_across_batches(tmp_path):
    docs, _ = make_docs(40)
    docs[35]["doc_vec"] = np.ones(DIM + 3)
    with pytest.raises(ValueError, match="docno 'd35' has dimension 19, expected 16"):
        DenseIndex(tmp_path / "x").indexer(batch_size=8).index(docs)


def test_duplicate_docnos_across_batches(tmp_path):
    docs, _ = make_docs(600)
    docs[550]["docno"] = "d3"  # a duplicate in a later batch
    index = DenseIndex(tmp_path / "dup")
    with pytest.raises(ValueError, match=r"duplicate docnos: \['d3'\]"):
        index.indexer(batch_size=64).index(docs)
    assert not index.built()
    with pytest.raises(IncompleteIndexError):
        index.np_retriever()(make_topics(1))


def test_create_over_existing_and_overwrite(tmp_path):
    docs, vecs = make_docs(50)
    index = DenseIndex(tmp_path / "ix")
    index.indexer().index(docs)
    with pytest.raises(FileExistsError, match="mode='overwrite'"):
        index.indexer().index(docs)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError):
        DenseIndex(tmp_path / "notes").indexer().index(docs)
    docs2, vecs2 = make_docs(30, seed=3)
    (tmp_path / "ix" / ".pt_meta.k3j2.tmp.json").write_text("{")  # left by a crash during an atomic write
    index.indexer(mode="overwrite").index(docs2)
    assert len(index) == 30
    assert sorted(p.name for p in (tmp_path / "ix").iterdir()) == ["docnos.npids", "pt_meta.json", "vectors.bin"]
    np.testing.assert_array_equal(np.asarray(index.vectors()), vecs2)


def test_corrupt_index_directories(tmp_path):
    docs, _ = make_docs(100)
    topics = make_topics(1)

    def fresh(name):
        ix = DenseIndex(tmp_path / name)
        ix.indexer().index(docs)
        return ix

    ix = fresh("trunc")
    with open(tmp_path / "trunc" / "vectors.bin", "r+b") as f:
        f.truncate(100 * DIM * 4 - 10)
    with pytest.raises(ValueError, match="vectors.bin has 6390 bytes.*truncated"):
        ix.np_retriever()(topics)

    ix = fresh("nodocnos")
    (tmp_path / "nodocnos" / "docnos.npids").unlink()
    with pytest.raises(FileNotFoundError, match="docnos.npids is missing"):
        ix.np_retriever()(topics)

    ix = fresh("novecs")
    (tmp_path / "novecs" / "vectors.bin").unlink()
    with pytest.raises(FileNotFoundError, match="vectors.bin is missing"):
        ix.np_retriever()(topics)

    ix = fresh("badmeta")
    (tmp_path / "badmeta" / "pt_meta.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt .*pt_meta.json"):
        ix.np_retriever()(topics)
    assert not ix.built()

    ix = fresh("othertype")
    (tmp_path / "othertype" / "pt_meta.json").write_text(json.dumps({"type": "sparse_index", "format": "x"}))
    with pytest.raises(ValueError, match=r"is not a DenseIndex: pt_meta.json describes \(.sparse_index., .x.\)"):
        ix.np_retriever()(topics)

    with pytest.raises(IncompleteIndexError, match="does not exist"):
        DenseIndex(tmp_path / "missing").np_retriever()(topics)


class _Crash(Exception):
    pass


def crashing(docs, at):
    for i, d in enumerate(docs):
        if i == at:
            raise _Crash()
        yield d


def test_resume_after_exception_is_identical(tmp_path):
    docs, _ = make_docs(1000)
    ref = DenseIndex(tmp_path / "ref")
    ref.indexer().index(docs)

    index = DenseIndex(tmp_path / "ix")
    with pytest.raises(_Crash):
        index.indexer(batch_size=32, checkpoint_every=100).index(crashing(docs, 730))
    assert not index.built()
    with pytest.raises(IncompleteIndexError, match="mode='resume'"):
        index.np_retriever()(make_topics(1))
    progress = json.loads((tmp_path / "ix" / "_build.json").read_text())
    assert 600 <= progress["count"] <= 730
    # a torn, non-durable tail beyond the progress record must be dropped consistently
    with open(tmp_path / "ix" / "vectors.bin", "ab") as f:
        f.write(b"\x01" * 37)
    with open(tmp_path / "ix" / "_docnos.txt", "ab") as f:
        f.write(b"garbage-without-newline")
    with pytest.raises(FileExistsError, match="mode='resume'"):
        index.indexer().index(docs)
    # resuming with a different input is refused
    other, _ = make_docs(1000, prefix="x")
    with pytest.raises(ValueError, match="record 0 of the input has docno 'x0'"):
        index.indexer(mode="resume").index(other)
    with pytest.raises(ValueError, match="only 5 documents"):
        index.indexer(mode="resume").index(docs[:5])
    index.indexer(mode="resume", batch_size=50).index(docs)
    assert index.built()
    for name in ("vectors.bin", "docnos.npids"):
        assert (tmp_path / "ix" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()
    assert sorted(p.name for p in (tmp_path / "ix").iterdir()) == ["docnos.npids", "pt_meta.json", "vectors.bin"]


@pytest.mark.multiproc
def test_sigkill_then_resume_is_byte_identical(tmp_path):
    n, worker = 3000, index_worker.__file__
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ref = DenseIndex(tmp_path / "ref")
    ref.indexer(batch_size=16).index(synthetic_docs(n, DIM))

    path = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, worker, str(path), "create", str(n), str(DIM), "0.002", "64"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    progress = path / "_build.json"
    deadline = time.time() + 120
    count = 0
    while time.time() < deadline and proc.poll() is None:
        if progress.exists():
            try:
                count = json.loads(progress.read_text())["count"]
            except (ValueError, KeyError):
                count = 0
            if count >= 400:
                break
        time.sleep(0.05)
    assert proc.poll() is None, f"worker finished or died before it could be killed: {proc.communicate()}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    index = DenseIndex(path)
    assert not index.built()
    durable = json.loads(progress.read_text())["count"]
    assert 400 <= durable < n
    with pytest.raises(IncompleteIndexError, match="resume"):
        index.np_retriever()(make_topics(1))

    out = subprocess.run([sys.executable, worker, str(path), "resume", str(n), str(DIM), "0", "64"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert index.built() and len(index) == n
    for name in ("vectors.bin", "docnos.npids"):
        assert (path / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()


# ---------------------------------------------------------------------------------------------- shards
def test_shards_view_and_merge_equal_single_index(tmp_path, monkeypatch):
    docs, vecs = make_docs(1001)
    single = DenseIndex(tmp_path / "single")
    single.indexer().index(docs)

    sharded = DenseIndex(tmp_path / "sharded")
    sharded.indexer(shard=0, num_shards=3).index(docs)
    assert not sharded.built()
    with pytest.raises(IncompleteIndexError, match="1: incomplete|shards"):
        sharded.np_retriever()(make_topics(1))
    # a torchrun-style process: rank/world size from the environment
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    sharded.indexer().index(docs)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    # a presharded stream (so an encoder in front of the indexer only sees this shard's documents)
    sharded.indexer(shard=1, num_shards=3, presharded=True).index(DenseIndex.shard_iter(docs, 1, 3))
    assert sharded.built() and sharded.num_shards == 3 and len(sharded) == 1001
    assert [len(DenseIndex(tmp_path / "sharded" / "shards" / str(s))) for s in range(3)] == [334, 334, 333]

    topics = make_topics(4)
    view = sharded.np_retriever(num_results=25)(topics)
    assert_matches_naive(view, topics, vecs, 25)
    assert_matches_naive(sharded.torch_retriever(num_results=25, device="cpu")(topics), topics, vecs, 25)
    scored = sharded.scorer()(view[["qid", "docno", "query_vec"]])
    np.testing.assert_allclose(scored.sort_values(["qid", "rank"]).score.to_numpy(), view.score.to_numpy(), rtol=1e-6)
    with pytest.raises(ValueError, match="merge_shards"):
        sharded.faiss_flat_retriever()(topics)

    merged = sharded.merge_shards()
    assert merged.num_shards == 1 and not (tmp_path / "sharded" / "shards").exists()
    for name in ("vectors.bin", "docnos.npids"):
        assert (tmp_path / "sharded" / name).read_bytes() == (tmp_path / "single" / name).read_bytes()


@pytest.mark.multiproc
def test_shards_in_subprocesses(tmp_path):
    """Two processes index their shard concurrently (like torchrun ranks)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from tests.helpers.index_worker import synthetic_docs; "
            "from pyterrier_cpdae.dense import DenseIndex; "
            "DenseIndex(sys.argv[2]).indexer().index(synthetic_docs(500, 16))")
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "PYTHONPATH": str(REPO)}
        procs.append(subprocess.Popen([sys.executable, "-c", code, str(REPO), str(tmp_path / "ix")],
                                      env=env, stderr=subprocess.PIPE, text=True))
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()
    ref = DenseIndex(tmp_path / "ref")
    ref.indexer().index(synthetic_docs(500, 16))
    index = DenseIndex(tmp_path / "ix")
    assert index.num_shards == 2
    index.merge_shards()
    for name in ("vectors.bin", "docnos.npids"):
        assert (tmp_path / "ix" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()


def test_merge_concatenates(tmp_path):
    docs, vecs = make_docs(300)
    a, b = DenseIndex(tmp_path / "a"), DenseIndex(tmp_path / "b")
    a.indexer().index(docs[:120])
    b.indexer().index(docs[120:])
    merged = DenseIndex.merge([a, str(tmp_path / "b")], tmp_path / "m")
    np.testing.assert_array_equal(np.asarray(merged.vectors()), vecs)
    assert list(merged.docnos.fwd) == [d["docno"] for d in docs]
    with pytest.raises(FileExistsError):
        DenseIndex.merge([a, b], tmp_path / "m")
    with pytest.raises(ValueError, match=r"duplicate docnos: \['d\d+'") as err:
        DenseIndex.merge([a, a], tmp_path / "dup")
    named = err.value.args[0].split("[")[1].split("]")[0].replace("'", "").split(", ")
    assert len(named) == 10 and all(0 <= int(d[1:]) < 120 for d in named)
    assert not DenseIndex(tmp_path / "dup").built()


# ---------------------------------------------------------------------------------------------- ties, GPU paths
def test_equal_scores_are_ordered_by_docid_in_every_backend(tmp_path):
    """Duplicate documents (equal scores) come out in the same order -- ascending docid -- from every backend.

    Vectors and queries are small multiples of powers of two, so every dot product is exact in float32 whatever
    the summation order; the last component (unique per group, < 1/64 of a score step) makes scores of
    different groups distinct, so a top-k that ends on a group boundary is fully determined.
    """
    rng = np.random.default_rng(7)
    groups = 60
    base = rng.integers(-2, 3, size=(groups, DIM)).astype(np.float32)
    base[:, -1] = np.arange(groups) / 1024
    order = rng.permutation(np.repeat(np.arange(groups), 3))  # three copies of each group, scattered
    vecs = base[order]
    index = DenseIndex(tmp_path / "ties")
    index.indexer().index([{"docno": f"d{i}", "doc_vec": v} for i, v in enumerate(vecs)])
    q = (rng.integers(-4, 5, size=(6, DIM)) / 16).astype(np.float32)
    q[:, -1] = 1.0
    topics = pd.DataFrame({"qid": [f"q{i}" for i in range(6)], "query_vec": list(q)})
    exact = (q.astype(np.float64) @ vecs.astype(np.float64).T)
    for k in (9, 30, 180):
        expected = [list(np.lexsort((np.arange(len(vecs)), -row))[:k]) for row in exact]
        for retriever in (index.np_retriever(num_results=k, block_size=16), index.np_retriever(num_results=k),
                          index.torch_retriever(num_results=k, device="cpu", chunk_size=16),
                          index.faiss_flat_retriever(num_results=k)):
            res = retriever(topics)
            got = [res[res.qid == f"q{j}"].sort_values("rank").docid.tolist() for j in range(6)]
            assert got == expected, retriever


class _FakeEvent:
    """Stands in for torch.cuda.Event on a machine without CUDA; logs record/synchronize/wait calls."""

    log: list = []
    count = 0

    def __init__(self):
        self.id = _FakeEvent.count
        _FakeEvent.count += 1

    def record(self, stream=None):
        _FakeEvent.log.append(("record", self.id, getattr(stream, "name", None)))

    def synchronize(self):
        _FakeEvent.log.append(("synchronize", self.id, None))


class _FakeStream:
    """Stands in for a CUDA stream: logs which events it is made to wait for."""

    def __init__(self, name):
        self.name = name

    def wait_event(self, event):
        _FakeEvent.log.append(("wait", event.id, self.name))


def test_torch_pinned_double_buffering_logic_on_cpu(tmp_path, monkeypatch):
    """The CUDA staging path (two pinned buffers, a copy stream, events between the streams) runs on CPU with
    pinning, streams and events mocked.

    Checks the results against a naive search (float32 and float16 shards, a short last chunk) and the protocol:
    only two staging buffers per dtype however many chunks stream through; each chunk's copy is recorded on the
    copy stream and waited for by the scoring stream before it is scored; a host buffer is refilled only after
    the host waited for its previous copy (two chunks earlier); a device buffer is overwritten only after the copy
    stream waited for the scoring of its previous chunk.
    """
    import contextlib

    import torch

    docs, vecs = make_docs(1001)
    sharded = DenseIndex(tmp_path / "sharded")
    for s in range(2):
        sharded.indexer(shard=s, num_shards=2, dtype="float16").index(docs)
    single = DenseIndex(tmp_path / "single")
    single.indexer().index(docs)
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self.dtype) or self)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: _FakeStream("copy"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _FakeStream("scoring"))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    q = np.stack(make_topics(5)["query_vec"])
    for index, ref_vecs, n_chunks in ((single, vecs, 9), (sharded, vecs.astype(np.float16).astype(np.float32), 10)):
        _FakeEvent.log, _FakeEvent.count, pinned[:] = [], 0, []
        scores, ids = index.search(q, 40, backend="torch", device="cpu", chunk_size=120, pin_memory=True,
                                   precision="fp32")
        ref_s, ref_i = naive_topk(ref_vecs, q, 40)
        np.testing.assert_array_equal(ids, ref_i)
        np.testing.assert_allclose(scores, ref_s, rtol=1e-4, atol=1e-4)
        assert len(pinned) == 2  # two buffers of chunk_size rows, reused for every chunk
        log = _FakeEvent.log
        copies = [e for op, e, st in log if op == "record" and st == "copy"]
        scored = [e for op, e, st in log if op == "record" and st == "scoring"]
        assert len(copies) == len(scored) == n_chunks
        # the scoring stream waits for each chunk's copy, in order
        assert [e for op, e, st in log if op == "wait" and st == "scoring"] == copies
        # a host buffer is refilled only after its copy two chunks earlier finished (the host waits) ...
        assert [e for op, e, st in log if op == "synchronize"] == copies[:n_chunks - 2]
        for i, e in enumerate(copies[:n_chunks - 2]):
            assert log.index(("synchronize", e, None)) < log.index(("record", copies[i + 2], "copy"))
        # ... and a device buffer only after the scoring of its chunk two earlier (the copy stream waits)
        assert [e for op, e, st in log if op == "wait" and st == "copy"] == scored[:n_chunks - 2]


def test_auto_backend_is_torch_exactly_when_cuda_is_available(built, monkeypatch):
    import torch

    index, _ = built
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert index.retriever(num_results=7) == index.torch_retriever(num_results=7)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert index.retriever(num_results=7) == index.np_retriever(num_results=7)


def test_faiss_gpu_used_only_when_faiss_sees_a_gpu(tmp_path, monkeypatch):
    import faiss

    docs, vecs = make_docs(400)
    index = DenseIndex(tmp_path / "ix")
    index.indexer().index(docs)
    topics = make_topics(3)
    moved = []

    def to_gpus(idx):
        moved.append(type(idx).__name__)
        return idx  # stands in for the GPU copy; searching it is the CPU search

    monkeypatch.setattr(faiss, "index_cpu_to_all_gpus", to_gpus, raising=False)
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 0, raising=False)  # faiss-cpu, or no visible GPU
    assert_matches_naive(index.faiss_flat_retriever(num_results=5)(topics), topics, vecs, 5)
    assert moved == []
    with pytest.raises(ValueError, match="needs faiss-gpu"):
        index.faiss_flat_retriever(use_gpu=True)(topics)
    monkeypatch.delattr(faiss, "get_num_gpus")  # a FAISS build without GPU support at all
    index.faiss_flat_retriever(num_results=5)(topics)
    assert moved == []

    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 1, raising=False)  # faiss-gpu with a GPU
    assert_matches_naive(index.faiss_flat_retriever(num_results=5)(topics), topics, vecs, 5)
    index.faiss_ivf_retriever(num_results=5, n_list=4)(topics)
    index.faiss_hnsw_retriever(num_results=5)(topics)  # FAISS has no GPU HNSW: stays on the CPU
    index.faiss_flat_retriever(num_results=5, use_gpu=False)(topics)
    assert moved == ["IndexFlatIP", "IndexIVFFlat"]
    with pytest.raises(ValueError, match="no GPU HNSW"):
        index.faiss_hnsw_retriever(use_gpu=True)(topics)


def test_identity_and_rank_cutoff_of_every_retriever(built):
    index, vecs = built
    topics = make_topics(3)
    factories = {
        "np": lambda k: index.np_retriever(num_results=k),
        "torch": lambda k: index.torch_retriever(num_results=k, device="cpu"),
        "flat": lambda k: index.faiss_flat_retriever(num_results=k),
        "hnsw": lambda k: index.faiss_hnsw_retriever(num_results=k, ef_search=64),
        "ivf": lambda k: index.faiss_ivf_retriever(num_results=k, n_list=8, n_probe=8),
        "scorer": lambda k: index.scorer(num_results=k),
    }
    made = {name: f(20) for name, f in factories.items()}
    for name, r in made.items():
        same = factories[name](20)
        assert r == same and hash(r) == hash(same), name
        assert r != factories[name](19), name
        assert all(r != other for n, other in made.items() if n != name), name
        assert repr(r) == repr(same) and str(index.path) in repr(r) and "20" in repr(r), name
        assert (r % 5).compile() == factories[name](5), name  # pt fuses the cutoff into the retriever
        assert r.fuse_rank_cutoff(20) is None and r.fuse_rank_cutoff(50) is None, name
    assert "'hnsw'" in repr(made["hnsw"]) and "ef_search=64" in repr(made["hnsw"])
    assert "n_probe=8" in repr(made["ivf"]) and "backend='torch'" in repr(made["torch"])
    for name in ("np", "torch", "flat"):
        full = made[name](topics)
        cut = factories[name](5)(topics)
        pd.testing.assert_frame_equal(cut, full[full["rank"] < 5].reset_index(drop=True))
    pairs = made["np"](topics)[["qid", "docno", "query_vec"]]
    scored = made["scorer"](pairs)
    assert len(scored) == len(pairs) and (index.scorer(num_results=5) % 3)(pairs)["rank"].max() == 2
    assert DenseIndex(index.path).scorer() == index.scorer()


def test_query_vec_errors_name_the_qid(built):
    index, _ = built
    bad = pd.DataFrame({"qid": ["q0", "q7"], "docno": ["d1", "d2"],
                        "query_vec": [np.zeros(DIM, np.float32), np.zeros(DIM - 1, np.float32)]})
    with pytest.raises(ValueError, match=r"query_vec of qid 'q7' has dimension 15, expected 16"):
        index.scorer()(bad)
    with pytest.raises(ValueError, match=r"query_vec of qid 'q7' has dimension 15"):
        index.np_retriever()(bad.drop(columns="docno"))
    with pytest.raises(Exception, match="docno"):  # pyterrier's InputValidationError names the missing column
        index.scorer()(bad.drop(columns="docno"))
    with pytest.raises(ValueError, match=r"NaN or infinite values for qid\(s\) \['q0'\]"):
        index.faiss_flat_retriever()(pd.DataFrame({"qid": ["q0"], "query_vec": [np.full(DIM, np.nan, np.float32)]}))


# ---------------------------------------------------------------------------------------------- real data
VASWANI_SLICE = 600  # documents (of 11,429): ~10 CPU-seconds of encoding (1,500 took 24; HNSW's recall@10 at its
# default parameters is 1.0 on both, and the scores of some top-10 neighbours differ by ~3e-6 on both)


@pytest.mark.slow
def test_vaswani_minilm_backends_agree_and_hnsw_recall(vaswani_dir, minilm_path, tmp_path):
    """On real data: MiniLM (mean pooling, normalised) over the first 600 Vaswani documents
    and all 93 queries.  numpy, torch (in chunks) and FAISS flat give identical top-10 rankings, and HNSW (its
    default parameters) keeps recall@10 >= 0.95 against exact search.  The full-collection run is recorded in
    experiments/results/vaswani_dense_backends.md (experiments/studies/vaswani_dense_backends.py)."""
    from itertools import islice

    from pyterrier_cpdae import CPDAE, load_dataset

    dataset = load_dataset(f"trec:{vaswani_dir}")
    docs = list(islice(dataset.get_corpus_iter(), VASWANI_SLICE))
    enc = CPDAE.from_pretrained(minilm_path, pooling="mean", normalize=True, batch_size=64)
    index = DenseIndex(tmp_path / "vaswani.cpdae")
    (enc >> index.indexer()).index(docs)
    topics = enc.query_encoder()(dataset.get_topics())
    assert len(index) == VASWANI_SLICE and len(topics) == 93

    # Vaswani repeats some documents verbatim (none among the first 600; two among the first 1,500); their
    # (bitwise-identical) vectors tie exactly, and which copies fill the last places of a top-10 is arbitrary, so
    # rankings are compared with each copy replaced by its group
    _, first, inverse = np.unique(np.asarray(index.vectors()), axis=0, return_index=True, return_inverse=True)
    group = first[inverse.ravel()]

    def rankings(res):
        return (res.assign(group=group[res["docid"]]).sort_values(["qid", "rank"]).groupby("qid")["group"]
                .apply(list).to_dict())

    exact = index.np_retriever(num_results=10)(topics)
    reference = rankings(exact)
    assert len(reference) == 93 and all(len(r) == 10 for r in reference.values())
    for retriever in (index.torch_retriever(num_results=10, device="cpu", chunk_size=300),
                      index.faiss_flat_retriever(num_results=10), index.np_retriever(num_results=10, block_size=128)):
        res = retriever(topics)
        assert rankings(res) == reference, retriever
        merged = exact.merge(res, on=["qid", "docno"], suffixes=("", "_other"))
        np.testing.assert_allclose(merged["score"], merged["score_other"], atol=1e-5)
    hnsw = rankings(index.faiss_hnsw_retriever(num_results=10)(topics))
    recall = np.mean([len(set(hnsw[q]) & set(reference[q])) / 10 for q in reference])
    assert recall >= 0.95


def test_pinned_option_is_checked_and_its_copy_follows_rebuilds(tmp_path, monkeypatch):
    """``torch_retriever(pinned=True)``: refused with numpy, beside ``resident=True`` and when not a bool; where
    torch cannot lock host memory (no CUDA) the search says so naming the option. The copy (ordinary memory
    standing in for page-locked memory on this CPU) is made once, ranks as the naive reference, and is made again
    with the new vectors after a rebuild."""
    import torch

    from pyterrier_cpdae.dense import store as store_mod
    from pyterrier_cpdae.dense.exact_retr import ExactRetriever

    docs, vecs = make_docs(400)
    index = DenseIndex(tmp_path / "ix")
    index.indexer().index(docs)
    topics = make_topics(5)
    with pytest.raises(ValueError, match="backend='torch' only"):
        ExactRetriever(index, backend="numpy", pinned=True)
    with pytest.raises(ValueError, match="pass one of them"):
        index.torch_retriever(pinned=True, resident=True)
    with pytest.raises(ValueError, match="pinned must be None, True or False"):
        index.torch_retriever(pinned="yes")
    assert index.torch_retriever(pinned=True) != index.torch_retriever()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pinned=True: torch cannot lock host memory"):
            index.torch_retriever(num_results=5, device="cpu", pinned=True)(topics)
    made = []

    def empty(shape, dtype, device, pinned):
        made.append(shape)
        return torch.empty(shape, dtype=dtype)

    monkeypatch.setattr(store_mod, "_empty", empty)
    retr = index.torch_retriever(num_results=7, device="cpu", pinned=True)
    assert_matches_naive(retr(topics), topics, vecs, 7)
    assert_matches_naive(retr(topics), topics, vecs, 7)
    assert made == [(400, DIM)]  # once
    docs2, vecs2 = make_docs(300, seed=5)
    index.indexer(mode="overwrite").index(docs2)
    assert_matches_naive(retr(topics), topics, vecs2, 7)
    assert made == [(400, DIM), (300, DIM)]


def test_streamed_search_pins_its_copy_by_itself_only_when_host_memory_allows(tmp_path, monkeypatch):
    """``pinned=None``, the default: ``pin_on_host`` says yes on CUDA when the vectors take at most a quarter of the
    host memory available, never on the CPU or when the available memory is unknown, always once the copy is made.
    The search follows it: the copy (ordinary memory standing in for page-locked memory on this CPU) is made once
    and ranks as the naive reference; ``pinned=False`` makes none; a host that refuses to lock the memory gets one
    warning, the pageable path and the same ranking, and is not asked again for that build."""
    import torch

    from pyterrier_cpdae.dense import store as store_mod

    docs, vecs = make_docs(400)
    index = DenseIndex(tmp_path / "ix")
    index.indexer().index(docs)
    topics = make_topics(5)
    store, cuda = index.store, torch.device("cuda")
    size = store.vector_bytes()
    assert size == 400 * DIM * 4
    for available, want in ((4 * size, True), (4 * size - 1, False), (None, False)):
        monkeypatch.setattr(store_mod, "host_memory_available", lambda: available)
        assert store_mod.pin_on_host(store, cuda) is want, available
        assert store_mod.pin_on_host(store, "cpu") is False
    monkeypatch.undo()
    real = store_mod.host_memory_available()
    assert real is None or real > 0

    made = []

    def empty(shape, dtype, device, pinned):
        made.append(shape)
        return torch.empty(shape, dtype=dtype)

    monkeypatch.setattr(store_mod, "_empty", empty)
    monkeypatch.setattr(store_mod, "pin_on_host", lambda s, device: True)  # what it says on a roomy CUDA host
    assert_matches_naive(index.torch_retriever(num_results=7, device="cpu", pinned=False)(topics), topics, vecs, 7)
    assert made == [] and not store.holds_pinned_copy()
    retr = index.torch_retriever(num_results=7, device="cpu")
    assert_matches_naive(retr(topics), topics, vecs, 7)
    assert_matches_naive(retr(topics), topics, vecs, 7)
    assert made == [(400, DIM)] and store.holds_pinned_copy()

    tries = []

    def refused(shape, dtype, device, pinned):
        tries.append(shape)
        raise RuntimeError("cannot lock 25600 bytes")

    monkeypatch.setattr(store_mod, "_empty", refused)
    index.indexer(mode="overwrite").index(docs)  # a new build: the copy is made again
    with pytest.warns(RuntimeWarning, match="no page-locked host copy.*cannot lock 25600 bytes"):
        assert_matches_naive(retr(topics), topics, vecs, 7)
    assert_matches_naive(retr(topics), topics, vecs, 7)
    assert tries == [(400, DIM)] and not store.holds_pinned_copy()
