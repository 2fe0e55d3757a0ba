"""DenseIndex(dtype="binary"): sign bits, a Hamming scan and float32 rescoring of the best k * rescore_multiplier,
checked against a naive reference (numpy bit counts of packed signs, float64 rescoring) and against the float32 index
(recall; the float32 ranking once every document is rescored)."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pyterrier_cpdae.dense import DenseIndex


def frame(vecs):
    return pd.DataFrame({"docno": [f"d{i}" for i in range(len(vecs))], "doc_vec": list(vecs)})


def naive(vecs, queries, k, multiplier):
    """Hamming distance of np.packbits(x > 0) by bit counts, the k * multiplier nearest (ties: smaller id), rescored
    by float64 inner products, the top k by (score, smaller id)."""
    bits = np.packbits(vecs > 0, axis=1)
    out = []
    for q in queries:
        qb = np.packbits(q > 0)
        ham = np.unpackbits(bits ^ qb, axis=1).sum(axis=1)
        cand = np.lexsort((np.arange(len(vecs)), ham))[:k * multiplier]
        scores = vecs[cand].astype(np.float64) @ q.astype(np.float64)
        out.append(cand[np.lexsort((cand, -scores))][:k])
    return np.array(out)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((40, 37)).astype(np.float32)  # (37 bits: a last byte only partly used)
    vecs = (centres[rng.integers(0, 40, 3000)] + 0.6 * rng.standard_normal((3000, 37))).astype(np.float32)
    vecs[100:110] = vecs[99]  # duplicates: equal Hamming distances and equal scores, cut by docid
    queries = (centres[:12] + 0.6 * rng.standard_normal((12, 37))).astype(np.float32)
    queries[0] = vecs[99]
    path = tmp_path_factory.mktemp("binary")
    f32 = DenseIndex(path / "f32")
    f32.indexer().index(frame(vecs))
    binary = DenseIndex(path / "bin")
    binary.indexer(dtype="binary").index(frame(vecs))
    return vecs, queries, f32, binary


@pytest.mark.parametrize("multiplier", [1, 4])
def test_equals_naive_reference(data, multiplier):
    vecs, queries, _, binary = data
    for k in (1, 10, 50):
        expected = naive(vecs, queries, k, multiplier)
        for backend in ("numpy", "torch"):
            _, ids = binary.search(queries, k, scan=backend, rescore_multiplier=multiplier)
            np.testing.assert_array_equal(ids, expected, err_msg=f"k={k} {backend}")


def test_recall_against_float32_and_full_rescoring(data):
    vecs, queries, f32, binary = data
    k = 10
    _, exact = f32.search(queries, k, backend="numpy")
    recalls = {}
    for m in (1, 4, 16):
        ids = binary.search(queries, k, rescore_multiplier=m)[1]
        recalls[m] = np.mean([len(set(a) & set(b)) / k for a, b in zip(ids, exact)])
        reference = naive(vecs, queries, k, m)
        assert recalls[m] == pytest.approx(np.mean([len(set(a) & set(b)) / k for a, b in zip(reference, exact)]))
    assert recalls[1] <= recalls[4] <= recalls[16]
    np.testing.assert_array_equal(binary.search(queries, k, rescore_multiplier=len(vecs))[1], exact)


def test_retriever_option_and_refusals(data, tmp_path):
    vecs, queries, f32, binary = data
    topics = pd.DataFrame({"qid": [f"q{i}" for i in range(len(queries))], "query": "x", "query_vec": list(queries)})
    res = binary.binary_retriever(num_results=5, rescore_multiplier=3)(topics)
    expected = naive(vecs, queries, 5, 3)
    assert list(res["docno"]) == [f"d{i}" for i in expected.reshape(-1)]
    assert list(binary.retriever(num_results=5)(topics)["docno"]) == \
        list(binary.binary_retriever(num_results=5, rescore_multiplier=4)(topics)["docno"])
    with pytest.raises(ValueError, match="scan must be 'numpy' or 'torch', got 'gpu'"):
        binary.search(queries, 3, scan="gpu")
    with pytest.raises(ValueError, match="rescore_multiplier must be"):
        binary.binary_retriever(num_results=5, rescore_multiplier=0)
    with pytest.raises(ValueError, match="searches dtype='binary' indexes"):
        f32.binary_retriever(num_results=5)(topics)
    i8 = DenseIndex(tmp_path / "i8")
    i8.indexer(dtype="int8").index(frame(vecs[:50]))
    with pytest.raises(ValueError, match="rescore_multiplier applies to dtype='binary'"):
        i8.search(queries, 3, rescore_multiplier=2)
    assert binary.meta()["format_version"] == 2 and (binary.path / "codes.bin").stat().st_size == len(vecs) * 5
