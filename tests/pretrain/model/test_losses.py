"""Tests of pretrain.model.losses against naive / hand-computed references."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pretrain.model.losses import (entropy, info_nce, mlm_loss, pairwise_js, pairwise_js_naive, rec_loss,
                                   word_distribution)


def _naive_bce(z: float, y: float) -> float:
    s = 1.0 / (1.0 + math.exp(-z))
    return -(y * math.log(s) + (1 - y) * math.log(1 - s))


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_rec_loss_matches_per_element_bce(reduction, weighted):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, generator=g) * 3
    targets = (torch.rand(3, 7, generator=g) < 0.3).float()
    w = torch.rand(7, generator=g) * 5 if weighted else None
    rows = []
    for i in range(3):
        per = [_naive_bce(logits[i, v].item(), targets[i, v].item()) * (w[v].item() if weighted else 1.0)
               for v in range(7)]
        rows.append(sum(per) if reduction == "sum" else sum(per) / 7)
    expected = sum(rows) / 3
    got = rec_loss(logits, targets, weights=w, reduction=reduction)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(expected, rel=1e-5)
    # half-precision logits are computed in float32
    assert rec_loss(logits.bfloat16(), targets, weights=w, reduction=reduction).dtype == torch.float32
    with pytest.raises(ValueError, match="reduction"):
        rec_loss(logits, targets, reduction="max")


def test_mlm_loss_matches_full_logits_and_gathers_first():
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    head = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 50))
    hidden = torch.randn(3, 6, 8, generator=g, requires_grad=True)
    labels = torch.full((3, 6), -100)
    labels[0, 1], labels[1, 3], labels[1, 4], labels[2, 5] = 4, 7, 49, 0
    seen = []
    h = head.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    got = mlm_loss(hidden, labels, head)
    h.remove()
    assert seen == [(4, 8)], "the head must only see the masked positions"
    full = head(hidden)  # (B, L, V): the naive reference
    expected = F.cross_entropy(full.reshape(-1, 50), labels.reshape(-1), ignore_index=-100)
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)
    g1 = torch.autograd.grad(got, hidden)[0]
    g2 = torch.autograd.grad(expected, hidden)[0]
    assert torch.allclose(g1, g2, atol=1e-7)
    # custom normaliser
    assert mlm_loss(hidden, labels, head, num_items=2.0).item() == pytest.approx(expected.item() * 2, rel=1e-6)
    # no masked token: zero, still differentiable
    zero = mlm_loss(hidden, torch.full((3, 6), -100), head)
    assert zero.item() == 0.0 and zero.requires_grad


def test_info_nce_hand_computed_4x4():
    sim = torch.tensor([[0.0, 1.0, 2.0, 0.5],
                        [1.0, 0.0, -1.0, 3.0],
                        [2.0, -1.0, 0.0, 0.0],
                        [0.5, 3.0, 0.0, 0.0]])
    pos = torch.tensor([2, 3, 0, 1])  # views (0,2) and (1,3) are twins
    # row i: -log(exp(s_i,pos) / sum_{j != i} exp(s_ij))
    e = math.exp
    rows = [-math.log(e(2.0) / (e(1.0) + e(2.0) + e(0.5))),
            -math.log(e(3.0) / (e(1.0) + e(-1.0) + e(3.0))),
            -math.log(e(2.0) / (e(2.0) + e(-1.0) + e(0.0))),
            -math.log(e(3.0) / (e(0.5) + e(3.0) + e(0.0)))]
    assert info_nce(sim, pos).item() == pytest.approx(sum(rows) / 4, rel=1e-6)
    # temperature divides the similarities
    rows_t = [-math.log(e(4.0) / (e(2.0) + e(4.0) + e(1.0)))]
    got = info_nce(sim[:1], pos[:1], self_index=torch.tensor([0]), temperature=0.5)
    assert got.item() == pytest.approx(rows_t[0], rel=1e-6)
    with pytest.raises(ValueError, match="self_index"):
        info_nce(sim[:2], pos[:2])
    with pytest.raises(ValueError, match="itself"):
        info_nce(sim, torch.tensor([0, 3, 0, 1]))


def _dists(n, v, dtype=torch.float32, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return word_distribution(torch.randn(n, v, generator=g, dtype=dtype) * scale, "sigmoid")


def test_word_distribution_and_entropy():
    p = _dists(4, 10)
    assert torch.allclose(p.sum(-1), torch.ones(4))
    q = word_distribution(torch.randn(4, 10), "softmax")
    assert torch.allclose(q.sum(-1), torch.ones(4))
    assert entropy(torch.tensor([[1.0, 0.0], [0.5, 0.5]])).tolist() == pytest.approx([0.0, math.log(2)])
    with pytest.raises(ValueError):
        word_distribution(torch.randn(2, 3), "relu")


def test_pairwise_js_matches_scipy():
    from scipy.spatial import distance as spatial
    p = _dists(5, 13, dtype=torch.float64)
    js = pairwise_js(p)
    for i in range(5):
        for j in range(5):
            ref = spatial.jensenshannon(p[i].numpy(), p[j].numpy()) ** 2  # natural log by default
            assert js[i, j].item() == pytest.approx(ref, abs=1e-12)
    assert float(js.max()) <= math.log(2)
    # zeros are handled (0 log 0 = 0)
    z = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.5, 0.5]], dtype=torch.float64)
    assert pairwise_js(z)[0, 1].item() == pytest.approx(math.log(2))


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("rect", [False, True])
def test_pairwise_js_matches_naive_values_and_grads(chunk, rect):
    p = _dists(10, 300, seed=1).requires_grad_()
    q = _dists(7, 300, seed=2).requires_grad_() if rect else None
    inputs = (p,) if q is None else (p, q)
    eff = pairwise_js(p, q, chunk_size=chunk)
    ref = pairwise_js_naive(p, q)
    assert eff.shape == ref.shape == (10, 7 if rect else 10)
    assert torch.allclose(eff, ref, atol=1e-6)
    w = torch.randn(eff.shape, generator=torch.Generator().manual_seed(5))
    g_eff = torch.autograd.grad((eff * w).sum(), inputs)
    g_ref = torch.autograd.grad((ref * w).sum(), inputs)
    for a, b in zip(g_eff, g_ref):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_pairwise_js_gradcheck_float64():
    p = _dists(5, 9, dtype=torch.float64, seed=3).requires_grad_()
    q = _dists(4, 9, dtype=torch.float64, seed=4).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: pairwise_js(x, chunk_size=2), (p,))
    assert torch.autograd.gradcheck(lambda x, y: pairwise_js(x, y, chunk_size=3), (p, q))
    # and through the sigmoid normalisation, as used by CPDAE
    z = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: pairwise_js(word_distribution(x), chunk_size=3), (z,))


def test_pairwise_js_low_precision_and_errors():
    p = _dists(4, 20)
    assert pairwise_js(p.bfloat16()).dtype == torch.float32
    with pytest.raises(ValueError, match="chunk_size"):
        pairwise_js(p, chunk_size=0)
    with pytest.raises(ValueError, match="vocabulary"):
        pairwise_js(p, _dists(3, 21))
