"""Bag-of-Words prediction: loss vs a hand-computed value, the objective's BoW term, schedule, training."""
from __future__ import annotations

import math

import pytest
import torch

from pretrain.objectives import objective_config
from pretrain.objectives import build_objective
from pretrain.objectives.bow import bow_loss, bow_weight_at

TEXTS = ["the quick brown fox jumps over the lazy dog", "drop your decoder and predict the bag of words",
         "information retrieval evaluation campaigns", "pre-training language models for search"]


def _load(tiny_bert_dir: str, **cfg):
    from transformers import AutoModelForMaskedLM, AutoTokenizer
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_pretrained(tiny_bert_dir)
    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    return model, tok, objective_config("bow", model=tiny_bert_dir, **cfg)


def test_bow_loss_hand_computed():
    logits = torch.tensor([[1.0, 2.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    bow = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    z = math.log(math.e ** 1 + math.e ** 2 + 1 + math.e ** -1)
    text1 = -((1 - z) + (0 - z)) / 2          # tokens {0, 2}
    text2 = -(0 - math.log(4))                 # token {3}, uniform logits
    assert float(bow_loss(logits, bow)) == pytest.approx((text1 + text2) / 2, rel=1e-6)


def test_bow_loss_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="same shape"):
        bow_loss(torch.zeros(2, 5), torch.zeros(2, 4))


def test_bow_loss_skips_empty_bags():
    logits = torch.tensor([[1.0, 2.0, 0.0], [5.0, 0.0, 0.0]])
    bow = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    expected = -(2 - math.log(math.e + math.e ** 2 + 1))
    assert float(bow_loss(logits, bow)) == pytest.approx(expected, rel=1e-6)


def test_objective_bow_term_matches_naive(tiny_bert_dir):
    model, tok, cfg = _load(tiny_bert_dir)
    obj = build_objective("bow", model, tok, cfg).eval()
    examples = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    batch = obj.collate(examples)
    out = obj(batch)
    # naive: one text at a time, python sets of the input ids (special tokens excluded)
    with torch.no_grad():
        cls = model.bert(input_ids=batch["masked_input_ids"][:, 0],
                         attention_mask=batch["attention_mask"]).last_hidden_state[:, 0]
        logp = torch.log_softmax(model.cls(cls), -1)
    per_text = []
    for b, ids in enumerate(examples):
        s = set(ids)
        per_text.append(-sum(float(logp[b, t]) for t in s) / len(s))
    assert float(out["bow"]) == pytest.approx(sum(per_text) / len(per_text), rel=1e-4)
    assert float(out["loss"].detach()) == pytest.approx(float(out["mlm"]) + cfg.bow_weight * float(out["bow"]), rel=1e-5)


def test_linear_decay_counts_optimizer_steps(tiny_bert_dir):
    model, tok, cfg = _load(tiny_bert_dir, bow_weight=2.0, bow_weight_schedule="linear_decay")
    obj = build_objective("bow", model, tok, cfg)
    assert obj.bow_weight == 2.0
    obj.on_step(25, 100)
    assert obj.bow_weight == pytest.approx(1.5)
    obj.on_step(100, 100)
    assert obj.bow_weight == 0.0
    const = build_objective("bow", *_load(tiny_bert_dir, bow_weight=0.5))
    const.on_step(99, 100)
    assert const.bow_weight == 0.5
    with pytest.raises(ValueError, match="bow_weight_schedule"):
        bow_weight_at(1.0, "cosine", 1, 10)


def test_trainer_drives_the_schedule_per_optimizer_step(tiny_bert_dir, tmp_path):
    """With 2 micro-batches per optimizer step, both micro-batches of step s use w * (1 - (s-1)/T)."""
    from pretrain.arguments import PretrainingArguments
    from pretrain.training.trainer import PretrainTrainer

    model, tok, cfg = _load(tiny_bert_dir, bow_weight=2.0, bow_weight_schedule="linear_decay", batch_size=4,
                            grad_accum=2)
    obj = build_objective("bow", model, tok, cfg)
    seen: list[float] = []
    forward = obj.forward

    def recording_forward(*args, **kwargs):
        seen.append(obj.bow_weight)
        return forward(*args, **kwargs)

    obj.forward = recording_forward
    data = [{"input_ids": tok(t, add_special_tokens=False)["input_ids"], "idx": i}
            for i, t in enumerate(TEXTS * 2)]
    args = PretrainingArguments(output_dir=str(tmp_path / "run"), max_steps=3, global_batch_size=4,
                                gradient_accumulation_steps=2, warmup_steps=0, report_to="none", use_cpu=True,
                                save_steps=1000, logging_steps=1, disable_tqdm=True)
    PretrainTrainer(model=obj, args=args, train_dataset=data, data_collator=obj.data_collator()).train()
    assert seen == pytest.approx([2.0, 2.0, 4 / 3, 4 / 3, 2 / 3, 2 / 3])
    assert obj.bow_weight == 0.0


def test_bad_schedule(tiny_bert_dir):
    # refused when the config is made (options are checked before anything runs)
    with pytest.raises(ValueError, match="--bow_weight_schedule must be one of constant, linear_decay, got 'cosine'"):
        _load(tiny_bert_dir, bow_weight_schedule="cosine")


def test_training_reduces_loss_and_raises_bow_rank(tiny_bert_dir):
    model, tok, cfg = _load(tiny_bert_dir)
    obj = build_objective("bow", model, tok, cfg)
    examples = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    opt = torch.optim.AdamW(obj.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        out = obj(obj.collate(examples))
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        obj.on_step(step + 1, 30)
        losses.append((float(out["loss"].detach()), float(out["bow"])))
    first = sum(l for l, _ in losses[:5]) / 5
    last = sum(l for l, _ in losses[-5:]) / 5
    assert last < 0.7 * first, losses
    assert sum(b for _, b in losses[-5:]) < 0.7 * sum(b for _, b in losses[:5])


def test_refuses_tokenizer_without_mask_token(tiny_bert_dir):
    model, tok, cfg = _load(tiny_bert_dir)
    tok.mask_token = None
    with pytest.raises(ValueError, match="mask token"):
        build_objective("bow", model, tok, cfg)
