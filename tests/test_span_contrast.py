"""Span contrast (coCondenser-style; the RetroMAE extension's second stage, "SentMAE co") as an add-on
term of any objective: the spans, the loss against coCondenser's equation written out term by term,
off by default without changing anything, and bad options."""
from __future__ import annotations

import math

import pytest
import torch

from _objective_helpers import load_tiny, sharpen
from pretrain.objectives import available_objectives, build_objective
from pretrain.objectives.contrast import split_spans

TEXTS = ["the quick brown fox jumps over the lazy dog", "dense retrieval with a masked auto encoder",
         "information retrieval evaluation campaigns", "pre-training language models for search"]


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 40])
def test_split_spans_cuts_a_text_into_two_disjoint_parts(n):
    ids = list(range(100, 100 + n))
    g = torch.Generator().manual_seed(0)
    cuts = set()
    for _ in range(400):
        a, b = split_spans(ids, g)
        if n < 2:
            assert a == b == ids
            continue
        assert a + b == ids and len(a) >= math.ceil(n / 4) and len(b) >= math.ceil(n / 4)
        cuts.add(len(a))
    if n == 40:
        assert cuts == set(range(10, 31))  # every cut point of [ceil(n/4), n - ceil(n/4)] is drawn


def _strip(row, tok):
    return [t for t in row.tolist() if t not in (tok.cls_token_id, tok.sep_token_id, tok.pad_token_id)]


def _co_reference(h: torch.Tensor, tau: float) -> float:
    """coCondenser: -(1/2m) sum_i log exp(<h_i,h_i+>/tau) / sum_{k != i} exp(<h_i,h_k>/tau) over the 2m spans."""
    h = h.double().tolist()
    n, m = len(h), len(h) // 2
    dotp = lambda a, b: sum(x * y for x, y in zip(a, b))  # noqa: E731
    total = 0.0
    for i in range(n):
        pos = (i + m) % n
        den = sum(math.exp(dotp(h[i], h[k]) / tau) for k in range(n) if k != i)
        total += -(dotp(h[i], h[pos]) / tau - math.log(den))
    return total / n


@pytest.mark.parametrize("objective,tau", [("retromae", 1.0), ("mlm", 0.5), ("simcse", 2.0)])
def test_span_contrast_adds_the_cocondenser_loss(tiny_bert_dir, objective, tau):
    w = 0.3
    model, tok, cfg = load_tiny(tiny_bert_dir, objective=objective, batch_size=len(TEXTS),
                                span_contrast_weight=w, span_contrast_temperature=tau)
    sharpen(model)
    obj = build_objective(objective, model, tok, cfg)
    assert obj.loss_names[-1] == "span"
    examples = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    batch = obj.collate(examples)
    m = len(TEXTS)
    assert batch["span_input_ids"].shape[:2] == (m, 2)
    for i, e in enumerate(examples):  # span 1 + span 2 of text i is text i
        first, second = (_strip(batch["span_input_ids"][i, v], tok) for v in (0, 1))
        assert first + second == e and first and second
    obj.eval()  # no dropout: the reference encodes the same spans
    torch.manual_seed(11)
    out = obj(batch)
    torch.manual_seed(11)  # (retromae draws its decoder masks in forward)
    base = type(obj).forward(obj, batch)  # the objective's own terms
    spans = torch.cat([batch["span_input_ids"][:, 0], batch["span_input_ids"][:, 1]])
    am = torch.cat([batch["span_attention_mask"][:, 0], batch["span_attention_mask"][:, 1]])
    h = model.base_model(input_ids=spans, attention_mask=am).last_hidden_state[:, 0].detach()
    ref = _co_reference(h, tau)
    assert float(out["span"]) == pytest.approx(ref, rel=1e-5)
    assert float(out["loss"].detach()) == pytest.approx(float(base["loss"].detach()) + w * ref, rel=1e-5)


def test_span_contrast_is_off_by_default_and_changes_nothing(tiny_bert_dir):
    outs = []
    for extra in ({}, {"span_contrast_weight": 0.0}):
        model, tok, cfg = load_tiny(tiny_bert_dir, objective="cpdae", batch_size=4, **extra)
        obj = build_objective("cpdae", model, tok, cfg)
        assert "forward" not in vars(obj) and "collate" not in vars(obj)
        torch.manual_seed(3)
        batch = obj.collate([tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS])
        assert "span_input_ids" not in batch
        outs.append((batch["masked_input_ids"], torch.rand(1)))  # no random numbers drawn for spans
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_every_objective_has_the_span_contrast_options_and_they_are_checked(tiny_bert_dir):
    import dataclasses
    for name, cls in available_objectives().items():
        fields = {f.name for f in dataclasses.fields(cls.Options)}
        assert {"span_contrast_weight", "span_contrast_temperature"} <= fields, name
    model, tok, _ = load_tiny(tiny_bert_dir)
    for bad, msg in (({"span_contrast_weight": -1.0}, "must be >= 0"),
                     ({"span_contrast_weight": 1.0, "span_contrast_temperature": 0.0}, "temperature must be > 0"),
                     ({"span_contrast_weight": 1.0, "batch_size": 1}, "at least 2 texts")):
        cfg = load_tiny(tiny_bert_dir, objective="mlm", **bad)[2]
        with pytest.raises(ValueError, match=msg):
            build_objective("mlm", model, tok, cfg)
