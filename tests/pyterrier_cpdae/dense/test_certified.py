"""Exact search in half precision with a proof of the cut (pyterrier_cpdae/dense/certified.py), on the CPU.

The reference is numpy_search (float32 BLAS, ties by ascending id). Where the data make every float32 inner
product exact (small dyadic numbers), any summation order gives the same scores, so the float16 path must return
exactly the reference's ids and scores, ties included.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pyterrier_cpdae.dense import certified  # noqa: E402
from pyterrier_cpdae.dense.kernels import numpy_search, torch_search  # noqa: E402


def dyadic(rng, shape, scale_bits, top):
    """Integers in [-top, top] divided by 2**scale_bits: exact in float16 when top < 2048."""
    return (rng.integers(-top, top + 1, size=shape) / 2.0 ** scale_bits).astype(np.float32)


@pytest.mark.parametrize("k,chunk", [(1, 97), (10, 256), (100, 1000), (600, 333)])
def test_fp16_path_returns_the_float32_ranking_exactly(k, chunk):
    rng = np.random.default_rng(k)
    # 24 dims, |d_i| <= 8, |q_i| <= 16, multiples of 2**-6 and 2**-4: every product and sum exact in float32
    docs = dyadic(rng, (3000, 24), 6, 512).astype(np.float16)
    queries = dyadic(rng, (30, 24), 4, 256)
    ref = numpy_search([(docs, 0, 1)], queries, k)
    stats = {}
    got = torch_search([(docs, 0, 1)], queries, k, device="cpu", precision="fp16", chunk_size=chunk, stats=stats)
    np.testing.assert_array_equal(got[1], ref[1])
    np.testing.assert_array_equal(got[0], ref[0])
    assert stats["queries"] == 30 and stats["fp32"] <= 3  # proved, not handed to the float32 kernel


def test_ties_at_the_cut_are_resolved_by_id_through_retries_or_float32():
    rng = np.random.default_rng(0)
    # few distinct vectors, many duplicates: whole bands of equal scores straddle every cut
    queries = dyadic(rng, (12, 8), 1, 5)
    for distinct in (40, 3):  # with 3 vectors (~667 copies each) the band at the cut outgrows every retry
        base = dyadic(rng, (distinct, 8), 2, 6)
        docs = base[rng.integers(0, distinct, size=2000)].astype(np.float16)
        stats = {}
        for k in (5, 50, 300):
            ref = numpy_search([(docs, 0, 1)], queries, k)
            got = torch_search([(docs, 0, 1)], queries, k, device="cpu", precision="fp16", chunk_size=256,
                               stats=stats)
            np.testing.assert_array_equal(got[1], ref[1])
            np.testing.assert_array_equal(got[0], ref[0])
        if distinct == 3:  # the proof failed and was not trusted: searched again, then in float32
            assert stats["retried"] > 0 and stats["fp32"] > 0


def test_sharded_parts_and_float32_vectors():
    rng = np.random.default_rng(3)
    docs = dyadic(rng, (4500, 16), 5, 300)  # float32 storage: rounded to float16 for the candidate pass
    docs[::7] += 2.0 ** -17  # not exact in float16: the vectors' rounding error enters the proof
    queries = dyadic(rng, (25, 16), 3, 100)
    parts = [(docs[s::3], s, 3) for s in range(3)]
    ref = numpy_search(parts, queries, 150)
    got = torch_search(parts, queries, 150, device="cpu", precision="fp16", chunk_size=500)
    np.testing.assert_array_equal(got[1], ref[1])
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6)


def test_vectors_too_long_for_float16_are_searched_in_float32():
    rng = np.random.default_rng(4)
    docs = rng.standard_normal((800, 16)).astype(np.float32)
    docs[5] *= 1e5  # norm far beyond float16's range
    queries = rng.standard_normal((6, 16)).astype(np.float32)
    stats = {}
    got = torch_search([(docs, 0, 1)], queries, 20, device="cpu", precision="fp16", chunk_size=128, stats=stats)
    ref = torch_search([(docs, 0, 1)], queries, 20, device="cpu", precision="fp32", chunk_size=128)
    np.testing.assert_array_equal(got[1], ref[1])
    assert stats["fp32"] == 6 and stats["retried"] == 0  # no pointless retry


def test_lower_bound_holds_for_every_document():
    """The claim the proof rests on, checked document by document: a document whose float32 score is s gets a
    half-precision score >= lower_bound(s). Random float32 vectors with tiny (subnormal in float16) entries."""
    rng = np.random.default_rng(5)
    dim = 48
    docs = (rng.standard_normal((5000, dim)) * rng.choice([1.0, 1e-3, 1e-6], size=(5000, 1))).astype(np.float32)
    queries = (rng.standard_normal((20, dim)) * rng.choice([1.0, 1e-5, 30.0], size=(20, 1))).astype(np.float32)
    q = torch.from_numpy(queries)
    top = certified.CertifiedTopK(q, width=100)
    d = torch.from_numpy(docs)
    top.add(d, 0, 1, 0)
    approx = certified.half_scores(d.half(), top.q16).T  # the half-precision scores (scaled units)
    ref = torch.from_numpy(queries @ docs.T)  # float32 reference scores (numpy's BLAS)
    low = certified.lower_bound(ref * top.scale[:, None], top.q16_norm[:, None], top.q_err[:, None],
                                  float(top.max_norm), float(top.max_err), dim)
    assert bool((approx >= low).all())
    # and the bound is not vacuous: the margin is a few float16 steps of the largest possible score |q| max|d|
    gap = (approx - low) / (top.q16_norm[:, None] * float(top.max_norm))
    assert float(gap.max()) < 2e-3


@pytest.mark.parametrize("n", [1000, 1024, 4099])
def test_block_topk_equals_a_full_sort(n):
    rng = np.random.default_rng(n)
    scores = torch.from_numpy(rng.integers(0, 50, size=(7, n)).astype(np.float16))  # many ties
    for width in (1, 5, 13):
        vals, cols = certified.block_topk(scores.T.contiguous(), width, block=32)  # document-major
        ref = torch.sort(scores.float(), dim=1, descending=True).values[:, :width]
        assert torch.equal(torch.sort(vals.float(), dim=1, descending=True).values, ref)
        assert bool((cols < n).all()) and torch.equal(scores.gather(1, cols), vals)
        assert all(len(set(r.tolist())) == width for r in cols)  # distinct columns


def test_precision_is_checked():
    docs = np.zeros((10, 4), dtype=np.float32)
    with pytest.raises(ValueError, match="precision must be one of"):
        torch_search([(docs, 0, 1)], docs[:2], 3, device="cpu", precision="bf16")


def test_retriever_option(tmp_path):
    import pandas as pd

    from pyterrier_cpdae.dense import DenseIndex

    rng = np.random.default_rng(6)
    vecs = dyadic(rng, (300, 8), 3, 60)
    index = DenseIndex(tmp_path / "ix")
    index.indexer().index([{"docno": f"d{i}", "doc_vec": v} for i, v in enumerate(vecs)])
    topics = pd.DataFrame({"qid": ["1", "2"], "query_vec": list(dyadic(rng, (2, 8), 2, 20))})
    with pytest.raises(ValueError, match="backend='torch' only"):
        index.np_retriever().__class__(index, backend="numpy", precision="fp16")
    ref = index.np_retriever(num_results=30)(topics)
    got = index.torch_retriever(num_results=30, device="cpu", precision="fp16", resident=False)(topics)
    assert list(got["docno"]) == list(ref["docno"]) and list(got["score"]) == list(ref["score"])


def test_parts_held_on_the_device_are_rescored_once_at_the_end():
    """Resident parts (torch tensors on the search device): candidates rescored from the parts after the last chunk,
    shards mapped back from their ids (offset, stride)."""
    rng = np.random.default_rng(8)
    docs = dyadic(rng, (2500, 12), 5, 200).astype(np.float16)
    queries = dyadic(rng, (15, 12), 3, 90)
    for parts in ([(docs, 0, 1)], [(docs[s::4], s, 4) for s in range(4)]):
        ref = numpy_search(parts, queries, 120)
        held = [(torch.from_numpy(np.ascontiguousarray(v)), o, st) for v, o, st in parts]
        got = torch_search(held, queries, 120, device="cpu", precision="fp16", chunk_size=300)
        np.testing.assert_array_equal(got[1], ref[1])
        np.testing.assert_array_equal(got[0], ref[0])
