"""Nothing is served stale: a retriever that outlives a rebuild of its index answers from the
new vectors, because every build commits a new ``build_id`` that is checked before each search.

Reference: a full numpy sort of the vectors that are in the index at the time of the search.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pandas as pd
import pytest

from pyterrier_cpdae import DenseIndex
from tests.helpers.dense import vector_frame as _docs

DIM = 64


def _check(res: pd.DataFrame, queries: np.ndarray, vecs: np.ndarray, k: int) -> None:
    scores = queries.astype(np.float64) @ vecs.astype(np.float64).T
    for j in range(len(queries)):
        r = res[res["qid"] == f"q{j}"]
        top = np.argsort(-scores[j], kind="stable")[:k]
        assert list(r["docno"]) == [f"d{i}" for i in top]
        np.testing.assert_allclose(r["score"].to_numpy(), scores[j][top], rtol=1e-4, atol=1e-4)


def _topics(queries: np.ndarray) -> pd.DataFrame:
    return pd.DataFrame({"qid": [f"q{j}" for j in range(len(queries))], "query_vec": list(queries)})


@pytest.mark.parametrize("factory", [lambda ix: ix.faiss_flat_retriever(num_results=5),
                                     lambda ix: ix.faiss_hnsw_retriever(num_results=5, ef_search=512),
                                     lambda ix: ix.np_retriever(num_results=5),
                                     lambda ix: ix.torch_retriever(num_results=5, device="cpu", resident=True)],
                         ids=["flat", "hnsw", "np", "torch-resident"])
def test_a_live_retriever_answers_from_the_rebuilt_vectors(tmp_path, factory):
    """The FAISS fingerprint sampled the first and last MiB of vectors.bin: a rebuild that changed only the middle
    rows kept being answered from the old vectors."""
    rng = np.random.default_rng(0)
    n = 12288  # 3 MiB of float32 rows of 64 dimensions
    old = rng.standard_normal((n, DIM)).astype(np.float32)
    new = old.copy()
    middle = np.arange(5000, 7000)  # rows wholly inside bytes [1 MiB, 2 MiB): neither head nor tail
    new[middle] = rng.standard_normal((len(middle), DIM)).astype(np.float32) * 3
    assert new[:4096].tobytes() == old[:4096].tobytes() and new[-4096:].tobytes() == old[-4096:].tobytes()
    queries = new[middle[[0, 500, 1999]]] * 2  # each one's own new row is its clear top result
    index = DenseIndex(tmp_path / "ix")
    index.indexer().index(_docs(old))
    retriever = factory(index)
    _check(retriever(_topics(queries)), queries, old, 5)
    DenseIndex(tmp_path / "ix").indexer(mode="overwrite").index(_docs(new))  # as another process would
    res = retriever(_topics(queries))
    _check(res, queries, new, 5)
    assert list(res.groupby("qid")["docno"].first()) == [f"d{i}" for i in middle[[0, 500, 1999]]]


def test_exact_retriever_notices_a_rebuild_that_kept_pt_meta_inode_and_mtime(tmp_path):
    """A file system that reuses the inode of pt_meta.json and has coarse timestamps made a rebuild look like the
    old build to the store's (inode, mtime, size) stamp: the old memory map kept answering."""
    rng = np.random.default_rng(1)
    old = rng.standard_normal((300, DIM)).astype(np.float32)
    new = rng.standard_normal((300, DIM)).astype(np.float32)
    index = DenseIndex(tmp_path / "ix")
    index.indexer().index(_docs(old))
    retriever = index.np_retriever(num_results=5)
    queries = rng.standard_normal((3, DIM)).astype(np.float32)
    _check(retriever(_topics(queries)), queries, old, 5)
    # the rebuild: vectors.bin replaced (a new file), pt_meta.json rewritten in place with the same size and mtime
    tmp = index.path / "vectors.new"
    tmp.write_bytes(new.tobytes())
    os.replace(tmp, index.path / "vectors.bin")
    meta_path = index.path / "pt_meta.json"
    st = meta_path.stat()
    text = meta_path.read_text()
    build_id = json.loads(text)["build_id"]
    with open(meta_path, "r+") as f:
        f.write(text.replace(build_id, "f" * len(build_id)))
    os.utime(meta_path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (meta_path.stat().st_ino, meta_path.stat().st_mtime_ns, meta_path.stat().st_size) == \
        (st.st_ino, st.st_mtime_ns, st.st_size)
    _check(retriever(_topics(queries)), queries, new, 5)


def test_every_build_commits_a_new_build_id(tmp_path):
    docs = _docs(np.random.default_rng(2).standard_normal((30, DIM)).astype(np.float32))
    ids = []
    index = DenseIndex(tmp_path / "ix")
    index.indexer().index(docs)
    ids.append(index.meta()["build_id"])
    index.indexer(mode="overwrite").index(docs)  # the same input again
    ids.append(index.meta()["build_id"])
    sharded = DenseIndex(tmp_path / "sh")
    for s in range(2):
        sharded.indexer(shard=s, num_shards=2).index(docs)
    ids.append(sharded.meta()["build_id"])
    sharded.indexer(shard=1, num_shards=2, mode="overwrite").index(docs)  # one shard rebuilt: a new view
    ids.append(sharded.meta()["build_id"])
    sharded.merge_shards()
    ids.append(sharded.meta()["build_id"])
    assert len(set(ids)) == len(ids) and all(isinstance(i, str) and len(i) >= 32 for i in ids)


def test_resident_by_default_only_on_a_cuda_device_with_room(tmp_path, monkeypatch):
    """``resident=None``: on CUDA when the vectors take at most half of the free memory; never on the CPU."""
    import torch

    from pyterrier_cpdae.dense import store as st

    index = DenseIndex(tmp_path / "ix")
    index.indexer().index(_docs(np.ones((100, DIM), np.float32)))
    size = index.store.vector_bytes()
    assert size == 100 * DIM * 4
    assert not st.fits_on_device(index.store, "cpu")
    for free, want in ((2 * size, True), (2 * size - 1, False)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, free=free: (free, 10 * free))
        assert st.fits_on_device(index.store, "cuda") is want
