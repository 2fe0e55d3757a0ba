"""Span contrast (the RetroMAE extension's second stage, "SentMAE co"; coCondenser) as an add-on term of
any objective: the spans, each form's loss (--span-contrast-form eq8|cocondenser) against its equation
written out term by term, Eq. 8's negatives being exactly the other texts' positives, the
--representation the spans are pooled with, off by default without changing anything, and bad options."""
from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.objectives import load_tiny, sharpen
from pretrain.objectives import available_objectives, build_objective
from pretrain.objectives.contrast import span_contrast, split_spans

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


def _eq8_reference(h: torch.Tensor, tau: float) -> float:
    """The RetroMAE extension's Eq. 8: -(1/m) sum_i log exp(<h_i,h_i+>/tau) / sum_j exp(<h_i,h_j+>/tau), rows
    0..m-1 of h the anchors h_i, rows m..2m-1 the positives h_i+, j over the m positives."""
    h = h.double().tolist()
    m = len(h) // 2
    anchors, positives = h[:m], h[m:]
    dotp = lambda a, b: sum(x * y for x, y in zip(a, b))  # noqa: E731
    total = 0.0
    for i in range(m):
        den = sum(math.exp(dotp(anchors[i], positives[j]) / tau) for j in range(m))
        total += -(dotp(anchors[i], positives[i]) / tau - math.log(den))
    return total / m


REFERENCES = {"eq8": _eq8_reference, "cocondenser": _co_reference}


@pytest.mark.parametrize("form", ["eq8", "cocondenser"])
@pytest.mark.parametrize("m,tau", [(2, 1.0), (5, 0.7), (8, 3.0)])
def test_each_form_is_its_equation_on_random_vectors(form, m, tau):
    h = torch.randn(2 * m, 6, generator=torch.Generator().manual_seed(m), dtype=torch.float64) * 1.5
    assert float(span_contrast(h.float(), form, tau)) == pytest.approx(REFERENCES[form](h, tau), rel=1e-5)
    other = REFERENCES["cocondenser" if form == "eq8" else "eq8"](h, tau)
    assert abs(float(span_contrast(h.float(), form, tau)) - other) > 1e-3  # the two forms are different losses


def _grad_of_anchor0(form: str, h: torch.Tensor) -> torch.Tensor:
    h = h.clone().requires_grad_(True)
    span_contrast(h, form, 1.0).backward()
    return h.grad[0]


def test_eq8_negatives_are_exactly_the_other_texts_positives():
    """Eq. 8: anchor 0's term depends on h_0 and the positives {h_j+} only. Its gradient w.r.t. h_0 (= the
    gradient of the loss, since no other term holds h_0) is unchanged when the other anchors h_j change, and
    changes when the other positives h_j+ change. In coCondenser's form the other anchors are negatives too."""
    m = 4
    h = torch.randn(2 * m, 5, generator=torch.Generator().manual_seed(0))
    g = _grad_of_anchor0("eq8", h)
    new_anchors = h.clone()
    new_anchors[1:m] = torch.randn(m - 1, 5, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(_grad_of_anchor0("eq8", new_anchors), g, atol=1e-6)
    new_positives = h.clone()
    new_positives[m + 1:] = torch.randn(m - 1, 5, generator=torch.Generator().manual_seed(2))
    assert not torch.allclose(_grad_of_anchor0("eq8", new_positives), g, atol=1e-3)
    # anchor 0's own positive is not a negative of the others only: changing it changes anchor 0's gradient
    own = h.clone()
    own[m] = torch.randn(5, generator=torch.Generator().manual_seed(3))
    assert not torch.allclose(_grad_of_anchor0("eq8", own), g, atol=1e-3)
    # coCondenser: the other anchors are negatives of anchor 0
    assert not torch.allclose(_grad_of_anchor0("cocondenser", new_anchors), _grad_of_anchor0("cocondenser", h), atol=1e-3)
    # Eq. 8 loss with m texts: every anchor sees m columns (its positive + m - 1 negatives): equal vectors give log m
    same = torch.ones(2 * m, 5)
    assert float(span_contrast(same, "eq8", 1.0)) == pytest.approx(math.log(m), rel=1e-6)
    assert float(span_contrast(same, "cocondenser", 1.0)) == pytest.approx(math.log(2 * m - 1), rel=1e-6)


def _encode_spans(model, batch, representation):
    """The span vectors h, written out: rows 0..m-1 span 0 (anchors), rows m..2m-1 span 1; [CLS] or the mean of
    the last layer over the real (attended) tokens of each span."""
    spans = torch.cat([batch["span_input_ids"][:, 0], batch["span_input_ids"][:, 1]])
    am = torch.cat([batch["span_attention_mask"][:, 0], batch["span_attention_mask"][:, 1]])
    hidden = model.base_model(input_ids=spans, attention_mask=am).last_hidden_state.detach().double()
    if representation == "cls":
        return hidden[:, 0]
    return torch.stack([hidden[r, am[r].bool()].mean(0) for r in range(hidden.shape[0])])


@pytest.mark.parametrize("objective,tau,form,representation", [
    ("retromae", 1.0, "eq8", "cls"), ("retromae", 1.0, "cocondenser", "cls"), ("mlm", 0.5, "eq8", "cls"),
    ("mlm", 0.5, "cocondenser", "cls"), ("simcse", 2.0, "cocondenser", "cls"), ("retromae", 1.0, "eq8", "mean"),
    ("cpdae", 2.0, "cocondenser", "mean")])
def test_span_contrast_adds_its_forms_loss(tiny_bert_dir, objective, tau, form, representation):
    w = 0.3
    rep = {"representation": representation} if representation != "cls" else {}
    model, tok, cfg = load_tiny(tiny_bert_dir, objective=objective, batch_size=len(TEXTS), span_contrast_weight=w,
                                span_contrast_temperature=tau, span_contrast_form=form, **rep)
    sharpen(model)
    obj = build_objective(objective, model, tok, cfg)
    assert obj.loss_names[-1] == "span"
    examples = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    batch = obj.collate(examples)
    m = len(TEXTS)
    assert batch["span_input_ids"].shape[:2] == (m, 2)
    for i, e in enumerate(examples):  # the two spans of text i are text i, cut once (in either order for eq8)
        first, second = (_strip(batch["span_input_ids"][i, v], tok) for v in (0, 1))
        assert (first + second == e or (form == "eq8" and second + first == e)) and first and second
    obj.eval()  # no dropout: the reference encodes the same spans
    torch.manual_seed(11)
    out = obj(batch)
    torch.manual_seed(11)  # (retromae draws its decoder masks in forward)
    base = type(obj).losses(obj, batch)  # the objective's own terms
    h = _encode_spans(model, batch, representation)
    ref = REFERENCES[form](h, tau)
    assert float(out["span"]) == pytest.approx(ref, rel=1e-5)
    assert float(out["loss"].detach()) == pytest.approx(float(base["loss"].detach()) + w * ref, rel=1e-5)
    if representation == "mean":  # the [CLS] vectors give another loss: the option is not ignored
        assert abs(REFERENCES[form](_encode_spans(model, batch, "cls"), tau) - ref) > 1e-3


def test_eq8_draws_either_span_as_the_anchor(tiny_bert_dir):
    """Eq. 8 is one-sided, so which span is the anchor matters: a fair coin per text (coCondenser's
    symmetric form keeps the text order)."""
    for form in ("eq8", "cocondenser"):
        model, tok, cfg = load_tiny(tiny_bert_dir, objective="mlm", batch_size=2, span_contrast_weight=1.0,
                                    span_contrast_form=form)
        obj = build_objective("mlm", model, tok, cfg)
        obj.mask_generator = torch.Generator().manual_seed(0)
        e = tok(TEXTS[0], add_special_tokens=False)["input_ids"]
        batch = obj.collate([e] * 200)
        firsts = sum(_strip(batch["span_input_ids"][i, 0], tok) == e[:len(_strip(batch["span_input_ids"][i, 0], tok))]
                     for i in range(200))  # the anchor span is the text's beginning
        if form == "eq8":
            assert 60 < firsts < 140
        else:
            assert firsts == 200


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
        assert {"span_contrast_weight", "span_contrast_temperature", "span_contrast_form"} <= fields, name
        assert cls.Options().span_contrast_form == "eq8", name  # the RetroMAE extension's Eq. 8 is the default
    model, tok, _ = load_tiny(tiny_bert_dir)
    for bad, msg in (({"span_contrast_weight": -1.0}, "must be >= 0"),
                     ({"span_contrast_weight": 1.0, "span_contrast_temperature": 0.0}, "temperature must be > 0"),
                     ({"span_contrast_weight": 1.0, "span_contrast_form": "simclr"}, "--span_contrast_form must be one of"),
                     ({"span_contrast_weight": 1.0, "batch_size": 1}, "at least 2 texts")):
        with pytest.raises(ValueError, match=msg):  # by the config (declared choices) or the objective
            cfg = load_tiny(tiny_bert_dir, objective="mlm", **bad)[2]
            build_objective("mlm", model, tok, cfg)
