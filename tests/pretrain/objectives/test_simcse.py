"""Unsupervised SimCSE (Gao et al., 2021): the loss against Eq. 1 written out term by term, dropout as
the only noise, bad options, and a 2-step run through ``python -m pretrain``."""
from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.objectives import load_tiny, sharpen
from pretrain.objectives import build_objective

TEXTS = ["the quick brown fox jumps over the lazy dog", "dense retrieval with a masked auto encoder",
         "information retrieval evaluation campaigns", "pre-training language models for search",
         "unsupervised sentence embeddings from dropout noise"]


def _simcse_reference(h1: torch.Tensor, h2: torch.Tensor, tau: float) -> float:
    """Eq. 1: l_i = -log exp(sim(h_i, h_i+)/tau) / sum_j exp(sim(h_i, h_j+)/tau), cosine sim, mean over i."""
    h1, h2 = h1.double().tolist(), h2.double().tolist()

    def cos(a, b):
        return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a)) / math.sqrt(sum(y * y for y in b))

    total = 0.0
    for i in range(len(h1)):
        num = math.exp(cos(h1[i], h2[i]) / tau)
        den = sum(math.exp(cos(h1[i], h2[j]) / tau) for j in range(len(h2)))
        total += -math.log(num / den)
    return total / len(h1)


@pytest.mark.parametrize("tau", [0.05, 0.5])
def test_simcse_loss_matches_equation_1(tiny_bert_dir, tau):
    model, tok, cfg = load_tiny(tiny_bert_dir, objective="simcse", temperature=tau, batch_size=len(TEXTS))
    sharpen(model)
    obj = build_objective("simcse", model, tok, cfg)
    obj.train()
    batch = obj.collate([tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS])
    assert (batch["input_ids"][:, 0] == tok.cls_token_id).all()
    torch.manual_seed(7)
    out = obj(batch)
    # the same two passes (same dropout draws): the batch holding every text twice, as in the paper's code
    torch.manual_seed(7)
    ids, am = batch["input_ids"], batch["attention_mask"]
    h = model.bert(input_ids=torch.cat([ids, ids]), attention_mask=torch.cat([am, am])).last_hidden_state[:, 0]
    m = len(TEXTS)
    h1, h2 = h[:m].detach(), h[m:].detach()
    assert not torch.allclose(h1, h2)  # dropout made the two encodings of every text differ
    ref = _simcse_reference(h1, h2, tau)
    assert float(out["loss"].detach()) == pytest.approx(ref, rel=1e-5, abs=1e-6)
    assert float(out["cl"]) == pytest.approx(ref, rel=1e-5, abs=1e-6)
    out["loss"].backward()
    assert model.bert.embeddings.word_embeddings.weight.grad.abs().sum() > 0


def test_simcse_without_dropout_would_be_trivial_and_is_refused(tiny_bert_dir):
    from transformers import AutoModelForMaskedLM
    model, tok, cfg = load_tiny(tiny_bert_dir, objective="simcse")
    nodrop = AutoModelForMaskedLM.from_pretrained(tiny_bert_dir, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    with pytest.raises(ValueError, match="dropout as its only noise"):
        build_objective("simcse", nodrop, tok, cfg)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        build_objective("simcse", model, tok, load_tiny(tiny_bert_dir, objective="simcse", temperature=0.0)[2])
    obj = build_objective("simcse", model, tok, cfg)
    with pytest.raises(ValueError, match="at least 2 texts"):
        obj.collate([[2000, 2001]])
