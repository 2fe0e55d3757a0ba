"""The bound on CPDAE's contrastive term (docs/objectives.md, "How far L_CL can fall"), checked numerically with
the code's own L_CL (``CPDAEObjective.contrastive_loss``: word distributions -> −JS similarities -> InfoNCE).

With similarity s = −JS ∈ [−ln 2, 0] and τ = 1, an anchor's 2m − 1 candidates (its twin and 2m − 2 negatives) give

    L = ln(1 + Σ_neg e^{s_neg − s_pos}) ∈ [ln(1 + (2m−2)/2), ln(1 + 2(2m−2))] = [ln m, ln(4m − 3)],

so the positive's probability e^{−L} never exceeds 1/m; identical distributions give the chance value ln(2m − 1),
from which L can fall by at most ln((2m − 1)/m) < ln 2 ≈ 0.69 nats.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from pretrain.model.losses import info_nce, pairwise_js, word_distribution
from pretrain.objectives.cpdae import CPDAEObjective

V = 48          # vocabulary size of the toy distributions
NEG = -1e4      # a logit whose sigmoid is exactly 0 in float32: disjoint supports


def l_cl(logits, temperature=1.0, reduction="mean", distribution="sigmoid"):
    """The code's L_CL on decoder logits of 2m views (rows i and i + m are twins)."""
    me = SimpleNamespace(config=SimpleNamespace(cl_distribution=distribution, js_chunk_size=3,
                                                temperature=temperature, cl_reduction=reduction))
    return CPDAEObjective.contrastive_loss(me, None, logits)


def per_anchor(logits, temperature=1.0):
    """Each view's InfoNCE loss from the same building blocks (−JS similarities, twin positive, self excluded)."""
    p = word_distribution(logits, "sigmoid")
    n = p.shape[0]
    pos = (torch.arange(n) + n // 2) % n
    return info_nce(-pairwise_js(p), pos, temperature=temperature, reduction="none")


def support_logits(supports):
    """Logits that put (equal) mass on each row's support only."""
    z = torch.full((len(supports), V), NEG)
    for i, s in enumerate(supports):
        z[i, list(s)] = 5.0
    return z


@pytest.mark.parametrize("m", [2, 4, 16, 64])
def test_identical_views_give_the_chance_value(m):
    z = torch.randn(1, V).repeat(2 * m, 1)
    assert float(l_cl(z)) == pytest.approx(math.log(2 * m - 1), abs=1e-5)


@pytest.mark.parametrize("m", [2, 4, 16])
def test_the_lower_bound_ln_m_is_reached_by_twins_identical_and_texts_disjoint(m):
    words = [set(range(3 * i, 3 * i + 3)) for i in range(m)]
    z = support_logits(words + words)              # view i and i + m: the same words; other texts: disjoint
    assert float(l_cl(z)) == pytest.approx(math.log(m), abs=1e-5)
    assert float(l_cl(z, reduction="sum")) == pytest.approx(m * math.log(m), abs=1e-4)
    # the most the term can fall from the chance value ln(2m − 1): ln((2m − 1)/m) < ln 2
    assert math.log(2 * m - 1) - float(l_cl(z)) == pytest.approx(math.log((2 * m - 1) / m), abs=1e-5)
    assert math.log((2 * m - 1) / m) < math.log(2)


@pytest.mark.parametrize("m", [2, 4, 16])
def test_the_adversarial_side_lies_above_chance_but_below_ln_4m_minus_3(m):
    a, b = set(range(0, 4)), set(range(4, 8))
    z = support_logits([a] * m + [b] * m)          # twins disjoint, every first view alike, every second view alike
    assert float(l_cl(z)) == pytest.approx(math.log(3 * m - 2), abs=1e-5)
    # one anchor at the worst: its twin disjoint, all its negatives identical to it
    z = support_logits([a] + [a] * (m - 1) + [b] + [a] * (m - 1))
    assert float(per_anchor(z)[0]) == pytest.approx(math.log(4 * m - 3), abs=1e-5)


@pytest.mark.parametrize("m", [2, 4, 16, 64])
@pytest.mark.parametrize("scale", [0.1, 3.0, 30.0])
def test_random_distributions_stay_inside_the_bound(m, scale):
    g = torch.Generator().manual_seed(m * 100 + int(scale * 10))
    for _ in range(3):
        z = torch.randn(2 * m, V, generator=g) * scale
        losses = per_anchor(z)
        assert bool((losses >= math.log(m) - 1e-5).all()) and bool((losses <= math.log(4 * m - 3) + 1e-5).all())
        assert bool((torch.exp(-losses) <= 1 / m + 1e-6).all())        # the positive's probability
        assert float(l_cl(z)) == pytest.approx(float(losses.mean()), abs=1e-5)


def test_minimising_l_cl_directly_cannot_pass_ln_m():
    """Gradient descent on the logits themselves (the most freedom any encoder could give) stops at ln m."""
    m = 4
    torch.manual_seed(0)
    z = torch.randn(2 * m, V, requires_grad=True)
    opt = torch.optim.Adam([z], lr=0.3)
    for _ in range(300):
        opt.zero_grad()
        loss = l_cl(z)
        loss.backward()
        opt.step()
    final = float(l_cl(z.detach()))
    assert math.log(m) - 1e-5 <= final < math.log(m) + 0.05
    assert math.log(2 * m - 1) - final < math.log(2)


@pytest.mark.parametrize("m", [4, 16])
def test_eq7_without_the_half_is_temperature_one_half(m):
    """Eq. 7 writes JS without its ½ (twice our JS): the same logits as −JS/τ with τ = 0.5, so the floor
    drops to ln(1 + (2m−2)/4) = ln((m+1)/2) and the positive's probability to at most 2/(m+1)."""
    z = torch.randn(2 * m, V) * 2
    p = word_distribution(z, "sigmoid")
    pos = (torch.arange(2 * m) + m) % (2 * m)
    doubled = info_nce(-2 * pairwise_js(p), pos)
    assert float(l_cl(z, temperature=0.5)) == pytest.approx(float(doubled), abs=1e-5)
    words = [set(range(3 * i, 3 * i + 3)) for i in range(m)]
    best = support_logits(words + words)
    assert float(l_cl(best, temperature=0.5)) == pytest.approx(math.log((m + 1) / 2), abs=1e-5)
    # a small τ removes the floor (τ = 0.05: e^{−ln2/τ} ≈ 1e-6 per negative)
    assert float(l_cl(best, temperature=0.05)) < 1e-3
