"""Random float vectors and the naive top-k they are checked against: the dense index's tests and the GPU tests."""
from __future__ import annotations

import numpy as np
import pandas as pd

DIM = 16


def make_docs(n: int, dim: int = DIM, seed: int = 0, prefix: str = "d"):
    vecs = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return [{"docno": f"{prefix}{i}", "doc_vec": vecs[i]} for i in range(n)], vecs


def vector_frame(vecs, prefix: str = "d") -> pd.DataFrame:
    """The rows of ``vecs`` as an indexer's input: ``docno`` ``<prefix><row>``, ``doc_vec``."""
    return pd.DataFrame({"docno": [f"{prefix}{i}" for i in range(len(vecs))], "doc_vec": list(vecs)})


def make_topics(n: int, dim: int = DIM, seed: int = 1) -> pd.DataFrame:
    q = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return pd.DataFrame({"qid": [f"q{i}" for i in range(n)], "query": [f"query {i}" for i in range(n)],
                         "query_vec": list(q)})


def naive_topk(docs: np.ndarray, queries: np.ndarray, k: int):
    scores = queries.astype(np.float64) @ docs.astype(np.float64).T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, order, axis=1), order


def assert_matches_naive(res: pd.DataFrame, topics: pd.DataFrame, vecs: np.ndarray, k: int):
    q = np.stack(topics["query_vec"])
    ref_scores, ref_ids = naive_topk(vecs, q, k)
    assert list(res.columns[:len(topics.columns)]) == list(topics.columns)
    for j, qid in enumerate(topics["qid"]):
        r = res[res["qid"] == qid]
        assert list(r["rank"]) == list(range(min(k, len(vecs))))
        assert (np.diff(r["score"].to_numpy()) <= 0).all()
        np.testing.assert_allclose(r["score"].to_numpy(), ref_scores[j], rtol=1e-4, atol=1e-4)
        assert list(r["docid"]) == list(ref_ids[j])  # random floats: no ties
        assert list(r["docno"]) == [f"d{i}" for i in ref_ids[j]]
        assert (r["query"] == topics["query"][j]).all()
