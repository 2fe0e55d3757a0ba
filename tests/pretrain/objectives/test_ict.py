"""Inverse Cloze Task (Lee et al. 2019): sentences from token ids, the pseudo-query / evidence pairs
(the 10% kept), the in-batch softmax loss against the paper's equation written out term by term."""
from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.objectives import load_tiny, sharpen
from pretrain.objectives import build_objective
from pretrain.objectives.ict import ict_example, split_token_sentences

SENTS = [["Dense retrieval maps text to vectors.", "It was trained with a cloze task!", "Why does it work?"],
         ["The cat sat on the mat.", "A dog barked."],
         ["Only one sentence here without an end"],
         ["First passage sentence.", "Second one?", "Third one.", "Fourth and last."]]


def test_split_token_sentences():
    end = {1, 2}
    assert split_token_sentences([5, 6, 1, 7, 2, 2, 8], end) == [[5, 6, 1], [7, 2, 2], [8]]
    assert split_token_sentences([5, 6, 7, 8, 9], end) == [[5, 6], [7, 8, 9]]  # one sentence: two halves
    assert split_token_sentences([5], end) == [[5]] and split_token_sentences([], end) == []


def test_queries_are_sentences_and_evidence_is_the_rest(tiny_bert_dir):
    model, tok, cfg = load_tiny(tiny_bert_dir, objective="ict")
    obj = build_objective("ict", model, tok, cfg)
    sent_ids = [[tok(s, add_special_tokens=False)["input_ids"] for s in doc] for doc in SENTS[:2] + SENTS[3:]]
    g = torch.Generator().manual_seed(0)
    kept = total = 0
    seen = set()
    for doc in sent_ids:
        ids = [t for s in doc for t in s]
        for _ in range(300):
            q, ev, k, keep = ict_example(ids, obj.end_ids, 0.1, g)
            assert q == doc[k]  # the query is one of the passage's sentences
            expected = ids if keep else [t for j, s in enumerate(doc) if j != k for t in s]
            assert ev == expected
            kept += keep
            total += 1
            seen.add((len(doc), k))
    assert seen == {(n, k) for n in (3, 2, 4) for k in range(n)}  # every sentence gets drawn
    p = kept / total  # 900 draws of Bernoulli(0.1): sd 0.01
    assert abs(p - 0.1) < 0.035
    for prob, want in ((0.0, False), (1.0, True)):
        assert all(ict_example(ids, obj.end_ids, prob, g)[3] is want for _ in range(20))


def _ict_reference(hq: torch.Tensor, hb: torch.Tensor, tau: float) -> float:
    """-(1/m) sum_i log exp(<h_qi, h_bi>/tau) / sum_j exp(<h_qi, h_bj>/tau)."""
    q, b = hq.double().tolist(), hb.double().tolist()
    s = lambda x, y: sum(u * v for u, v in zip(x, y)) / tau  # noqa: E731
    return sum(-(s(q[i], b[i]) - math.log(sum(math.exp(s(q[i], b[j])) for j in range(len(b)))))
               for i in range(len(q))) / len(q)


@pytest.mark.parametrize("tau", [1.0, 0.3])
def test_ict_loss_matches_the_in_batch_softmax(tiny_bert_dir, tau):
    model, tok, cfg = load_tiny(tiny_bert_dir, objective="ict", temperature=tau, batch_size=4)
    sharpen(model)
    obj = build_objective("ict", model, tok, cfg)
    obj.generator = torch.Generator().manual_seed(1)
    batch = obj.collate([tok(" ".join(doc), add_special_tokens=False)["input_ids"] for doc in SENTS])
    obj.eval()
    out = obj(batch)
    hq = model.bert(input_ids=batch["query_input_ids"], attention_mask=batch["query_attention_mask"]).last_hidden_state[:, 0]
    hb = model.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state[:, 0]
    ref = _ict_reference(hq.detach(), hb.detach(), tau)
    assert float(out["loss"].detach()) == pytest.approx(ref, rel=1e-5)
    out["loss"].backward()
    assert model.bert.embeddings.word_embeddings.weight.grad.abs().sum() > 0


def test_ict_options_are_checked(tiny_bert_dir):
    model, tok, _ = load_tiny(tiny_bert_dir)
    for bad, msg in (({"ict_keep_probability": 1.5}, "--ict_keep_probability"), ({"temperature": -1.0}, "temperature")):
        with pytest.raises(ValueError, match=msg):
            build_objective("ict", model, tok, load_tiny(tiny_bert_dir, objective="ict", **bad)[2])
