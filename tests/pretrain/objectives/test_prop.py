"""PROP (Ma et al., WSDM 2021): the Dirichlet-smoothed document LM, word-set sampling (Poisson sizes,
the more likely set is the positive), the input layout, and the loss L_ROP + L_MLM against the paper's
equations written out term by term."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from tests.helpers.objectives import load_tiny, sharpen
from pretrain.objectives import build_objective
from pretrain.objectives.prop import document_language_model, sample_word_sets

TEXTS = ["the quick brown fox jumps over the lazy dog and the fox runs", "dense retrieval with a masked auto encoder",
         "information retrieval evaluation campaigns measure retrieval", "pre-training language models for search"]


def _stats(vocab: int):
    g = torch.Generator().manual_seed(0)
    pc = torch.rand(vocab, generator=g) ** 4
    return {"collection_prob": pc / pc.sum(), "mu": 7.5, "token_frequency": pc / pc.sum()}


def test_document_language_model_is_dirichlet_smoothing():
    pc = torch.tensor([0.5, 0.25, 0.125, 0.125])
    ids, mu = [1, 1, 3], 2.0
    lm = document_language_model(ids, pc, mu)
    # hand-computed: (tf + mu * P(w|C)) / (|d| + mu), |d| = 3
    assert lm.tolist() == pytest.approx([(0 + 1.0) / 5, (2 + 0.5) / 5, (0 + 0.25) / 5, (1 + 0.25) / 5])
    assert float(lm.sum()) == pytest.approx(1.0)


def test_word_sets_follow_the_document_lm_and_poisson_sizes():
    pc = torch.tensor([0.1, 0.2, 0.3, 0.4])
    ids, mu, lam = [0, 0, 2], 3.0, 3.0
    weights = torch.tensor([1.0, 0.0, 1.0, 0.5])  # word 1 not a word; word 3 subsampled by half
    g = torch.Generator().manual_seed(0)
    counts, sizes = Counter(), []
    for _ in range(3000):
        pos, neg, lp, ln = sample_word_sets(ids, pc, mu, weights, lam, g)
        lm = [(ids.count(w) + mu * float(pc[w])) / (len(ids) + mu) for w in range(4)]
        assert lp == pytest.approx(sum(math.log(lm[w]) for w in pos)) and ln == pytest.approx(sum(math.log(lm[w]) for w in neg))
        assert lp >= ln  # the positive is the set with the higher query likelihood
        counts.update(pos + neg)
        sizes += [len(pos), len(neg)]
    assert 1 not in counts and min(sizes) >= 1
    # words ~ P(w|d) * weight, renormalised
    lm = [(ids.count(w) + mu * float(pc[w])) / (len(ids) + mu) for w in range(4)]
    q = [lm[w] * float(weights[w]) for w in range(4)]
    total = sum(counts.values())
    for w in (0, 2, 3):
        assert counts[w] / total == pytest.approx(q[w] / sum(q), abs=0.015)
    # zero-truncated Poisson(3): mean lam / (1 - e^-lam)
    assert sum(sizes) / len(sizes) == pytest.approx(lam / (1 - math.exp(-lam)), abs=0.08)


def test_inputs_are_set_then_document_and_only_the_document_is_masked(tiny_bert_dir):
    model, tok, cfg = load_tiny(tiny_bert_dir, objective="prop", batch_size=4, mlm_probability=0.5)
    obj = build_objective("prop", model, tok, cfg, **_stats(model.config.vocab_size))
    obj.mask_generator = torch.Generator().manual_seed(0)
    examples = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    b = obj.collate(examples)
    assert b["input_ids"].shape[:2] == (4, 2)
    for i, e in enumerate(examples):
        for v in range(2):
            row = b["input_ids"][i, v][b["attention_mask"][i, v].bool()].tolist()
            tt = b["token_type_ids"][i, v][b["attention_mask"][i, v].bool()].tolist()
            n_set = len(row) - len(e) - 3
            assert n_set >= 1 and row[0] == tok.cls_token_id and row[n_set + 1] == tok.sep_token_id
            assert row[n_set + 2:-1] == e and row[-1] == tok.sep_token_id
            assert tt == [0] * (n_set + 2) + [1] * (len(e) + 1)
            masked = (b["mlm_labels"][i, v] != -100).nonzero().flatten().tolist()
            assert masked and all(n_set + 2 <= p < len(row) - 1 for p in masked)  # document tokens only
            words = tok.convert_ids_to_tokens(row[1:n_set + 1])
            assert all(w.isalnum() and not w.startswith("##") for w in words)


def _reference_loss(model, head, batch, margin):
    """L = mean_d max(0, margin - p+ + p-) with (p+, p-) = softmax(s+, s-), s = w.h_CLS + b; plus
    L_MLM = mean over masked document tokens of -log softmax(MLM logits)[label]."""
    m, _, L = batch["masked_input_ids"].shape
    flat = lambda k: batch[k].reshape(-1, L)  # noqa: E731
    out = model.bert(input_ids=flat("masked_input_ids"), attention_mask=flat("attention_mask"),
                     token_type_ids=flat("token_type_ids")).last_hidden_state.detach().double()
    w, b0 = head.weight.detach().double()[0], float(head.bias.detach()[0])
    rop = 0.0
    for i in range(m):
        s_pos = float(out[2 * i, 0] @ w) + b0
        s_neg = float(out[2 * i + 1, 0] @ w) + b0
        p_pos = math.exp(s_pos) / (math.exp(s_pos) + math.exp(s_neg))
        rop += max(0.0, margin - p_pos + (1 - p_pos))
    rop /= m
    labels = flat("mlm_labels")
    nll, count = 0.0, 0
    for r in range(labels.shape[0]):
        for p in range(L):
            y = int(labels[r, p])
            if y == -100:
                continue
            with torch.no_grad():
                logits = model.cls(out[r, p].float()[None])[0].double()
            nll += float(torch.logsumexp(logits, 0) - logits[y])
            count += 1
    return rop, nll / count


@pytest.mark.parametrize("margin", [1.0, 0.2])
def test_prop_loss_matches_the_papers_equations(tiny_bert_dir, margin):
    model, tok, cfg = load_tiny(tiny_bert_dir, objective="prop", batch_size=4, prop_margin=margin)
    sharpen(model)
    obj = build_objective("prop", model, tok, cfg, **_stats(model.config.vocab_size))
    with torch.no_grad():
        obj.score_head.weight.normal_(0, 1.0)
    obj.mask_generator = torch.Generator().manual_seed(1)
    batch = obj.collate([tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS])
    obj.eval()
    out = obj(batch)
    rop, mlm = _reference_loss(model, obj.score_head, batch, margin)
    assert float(out["rop"]) == pytest.approx(rop, rel=1e-5)
    assert float(out["mlm"]) == pytest.approx(mlm, rel=1e-5)
    assert float(out["loss"].detach()) == pytest.approx(rop + mlm, rel=1e-5)
    out["loss"].backward()
    assert obj.score_head.weight.grad.abs().sum() > 0


def test_prop_needs_corpus_statistics(tiny_bert_dir):
    model, tok, cfg = load_tiny(tiny_bert_dir, objective="prop")
    with pytest.raises(ValueError, match="needs corpus statistics"):
        build_objective("prop", model, tok, cfg)
    bad = _stats(model.config.vocab_size)
    bad["collection_prob"] = bad["collection_prob"][:10]
    with pytest.raises(ValueError, match="collection_prob must have shape"):
        build_objective("prop", model, tok, cfg, **bad)


def test_corpus_statistics_from_the_token_cache():
    import numpy as np

    from pretrain.objectives.prop import prop_corpus_statistics

    class Cache:  # the TokenCache interface prepare() reads: blocks [1, 1, 2] and [2, 3]
        tokens = np.array([1, 1, 2, 2, 3], dtype=np.uint16)

        def document_frequency(self):
            return np.array([0, 1, 2, 1, 0])

        def lengths(self):
            return np.array([3, 2])

    s = prop_corpus_statistics(Cache())
    assert s["collection_prob"].tolist() == pytest.approx([0, 0.25, 0.5, 0.25, 0])  # df / sum df
    assert s["mu"] == 2.5  # average text length
    assert s["token_frequency"].tolist() == pytest.approx([0, 0.4, 0.4, 0.2, 0])


# ---------------------------------------------------------------- one size per pair
def _zipf_setting(vocab: int = 2000, doc_len: int = 120, seed: int = 0):
    """A Zipfian collection LM ``P(w|C) ∝ 1/rank``, a document of ``doc_len`` tokens drawn from it,
    ``μ`` = the document length, and the subsampling keep probabilities ``min(1, √(t/f) + t/f)``."""
    g = torch.Generator().manual_seed(seed)
    pc = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    pc /= pc.sum()
    doc = torch.multinomial(pc, doc_len, replacement=True, generator=g).tolist()
    t = 1e-4
    keep = ((t / pc).sqrt() + t / pc).clamp(max=1.0)
    return doc, pc, float(doc_len), keep


@pytest.mark.parametrize("lam", [1.0, 3.0, 6.0])
def test_both_word_sets_of_a_pair_have_one_poisson_size(lam):
    doc, pc, mu, keep = _zipf_setting()
    g = torch.Generator().manual_seed(1)
    sizes = []
    for _ in range(2000):
        pos, neg, _, _ = sample_word_sets(doc, pc, mu, keep, lam, g)
        assert len(pos) == len(neg) >= 1  # the authors' generator: one length per pair, both sets filled to it
        sizes.append(len(pos))
    # the pair's size is zero-truncated Poisson(lam): mean lam / (1 - e^-lam), P(n=1) = lam e^-lam / (1 - e^-lam)
    z = 1 - math.exp(-lam)
    assert sum(sizes) / len(sizes) == pytest.approx(lam / z, abs=4 * math.sqrt(lam / z) / math.sqrt(len(sizes)) + 0.02)
    p1 = lam * math.exp(-lam) / z
    assert sizes.count(1) / len(sizes) == pytest.approx(p1, abs=4 * math.sqrt(p1 * (1 - p1) / len(sizes)))


def length_only_accuracy(pairs: list[tuple[int, int, bool]]) -> float:
    """Held-out accuracy of the best length-only classifier: ``(len_a, len_b) -> "a is S⁺"`` by majority vote
    on the first half of the pairs (unseen length pairs: "the shorter set is S⁺", ties "a"), scored on
    the second half."""
    half = len(pairs) // 2
    votes: dict[tuple[int, int], list[int]] = {}
    for la, lb, a_pos in pairs[:half]:
        v = votes.setdefault((la, lb), [0, 0])
        v[int(a_pos)] += 1

    def predict(la, lb):
        v = votes.get((la, lb))
        return v[1] >= v[0] if v else la <= lb
    test = pairs[half:]
    return sum(predict(la, lb) == a_pos for la, lb, a_pos in test) / len(test)


def _presented_pairs(sampler, n_pairs: int, seed: int = 2) -> list[tuple[int, int, bool]]:
    """``(len_a, len_b, a is S⁺)`` of ``n_pairs`` sampled pairs, each shown in a random order."""
    doc, pc, mu, keep = _zipf_setting()
    g, order = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(n_pairs):
        pos, neg, _, _ = sampler(doc, pc, mu, keep, 3.0, g)
        if bool(torch.rand(1, generator=order) < 0.5):
            out.append((len(pos), len(neg), True))
        else:
            out.append((len(neg), len(pos), False))
    return out


def _independent_sizes_sampler(ids, collection_prob, mu, weights, poisson_lambda, generator):
    """The earlier sampler (one Poisson size per SET), written from its description: the
    reference showing that the test below detects a length shortcut."""
    p = document_language_model(ids, collection_prob, mu)
    q = p * weights.double()
    sets = []
    for _ in range(2):
        n = 0
        while n == 0:
            n = int(torch.poisson(torch.tensor([poisson_lambda]), generator=generator))
        words = torch.multinomial(q, n, replacement=True, generator=generator).tolist()
        sets.append((float(p[words].log().sum()), words))
    (lp, a), (ln, b) = sorted(sets, reverse=True)
    return a, b, lp, ln


N_PAIRS = 4000


def _chance_band(n: int) -> float:
    return 3.89 * math.sqrt(0.25 / n)  # two-sided 99.99% normal band of Binomial(n, 1/2) / n


def test_the_label_is_not_predictable_from_the_set_lengths():
    acc = length_only_accuracy(_presented_pairs(sample_word_sets, N_PAIRS))
    assert abs(acc - 0.5) <= _chance_band(N_PAIRS // 2), acc


def test_the_length_test_detects_independent_set_sizes():
    """With a size per set (the old sampler) the same classifier is far above chance (measured ~80%)."""
    acc = length_only_accuracy(_presented_pairs(_independent_sizes_sampler, N_PAIRS))
    assert acc > 0.5 + 5 * _chance_band(N_PAIRS // 2), acc
