"""SEED-Encoder objective: window mask vs a hand-built one, decoder locality, targets, training."""
from __future__ import annotations

import json
import os

import pytest
import torch

from pretrain.config import PretrainConfig
from pretrain.objectives import build_objective
from pretrain.objectives.seed import SEEDDecoder, seed_attention_mask

TEXTS = ["the quick brown fox jumps over the lazy dog", "dense retrieval with a weak decoder",
         "information retrieval evaluation campaigns", "pre-training language models for search"]


def _load(tiny_bert_dir: str, **cfg):
    from transformers import AutoModelForMaskedLM, AutoTokenizer
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_pretrained(tiny_bert_dir)
    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    return model, tok, PretrainConfig(model=tiny_bert_dir, **cfg)


def _train(obj, tok, steps: int = 30, lr: float = 3e-3) -> list[float]:
    examples = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    opt = torch.optim.AdamW(obj.parameters(), lr=lr)
    obj.train()
    losses = []
    for step in range(steps):
        out = obj(obj.collate(examples))
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        obj.on_step(step + 1, steps)
        losses.append(float(out["loss"]))
    return losses


def test_window_mask_equals_hand_built():
    # rows = query positions, cols = keys; span 2: [CLS] + itself + the one before
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 0, 1, 1, 0, 0],
        [1, 0, 0, 1, 1, 0],
        [1, 0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(seed_attention_mask(6, 2), expected)


@pytest.mark.parametrize("span", [1, 3, 5])
def test_window_mask_equals_naive(span):
    L = 9
    naive = torch.zeros(L, L, dtype=torch.bool)
    for j in range(L):
        naive[j, 0] = True
        for i in range(L):
            if j - span < i <= j:
                naive[j, i] = True
    assert torch.equal(seed_attention_mask(L, span), naive)


def test_window_mask_rejects_bad_span():
    with pytest.raises(ValueError, match="span"):
        seed_attention_mask(5, 0)


def test_decoder_only_sees_its_window():
    torch.manual_seed(0)
    dec = SEEDDecoder(16, num_layers=3, num_heads=2, intermediate_size=32, span=2, dropout=0.0).eval()
    x = torch.randn(1, 8, 16)
    am = torch.ones(1, 8, dtype=torch.long)
    base = dec(x, am)
    # changing position 3 may only affect rows whose receptive field (3 layers x span 2) reaches it: rows >= 3
    y = x.clone()
    y[0, 3] += 5.0
    out = dec(y, am)
    changed = (out - base).abs().amax(-1)[0] > 1e-5
    assert changed.tolist() == [False, False, False, True, True, True, True, False]  # row 7 is 4 steps away
    # changing [CLS] changes every row
    z = x.clone()
    z[0, 0] += 5.0
    assert bool(((dec(z, am) - base).abs().amax(-1) > 1e-5).all())


def test_targets_are_next_tokens(tiny_bert_dir):
    model, tok, cfg = _load(tiny_bert_dir)
    obj = build_objective("seed", model, tok, cfg)
    batch = obj.collate([[2000, 2001, 2002], [2003]])
    t = obj.decoder_targets(batch["input_ids"], batch["special_tokens_mask"], batch["attention_mask"])
    # [CLS] a b c [SEP]  -> position j predicts token j+1; [SEP]/pad not predicted
    assert t.tolist() == [[2000, 2001, 2002, -100, -100], [2003, -100, -100, -100, -100]]


def test_loss_components_and_training(tiny_bert_dir, tmp_path):
    model, tok, cfg = _load(tiny_bert_dir)
    obj = build_objective("seed", model, tok, cfg)
    assert len(obj.decoder.layers) == cfg.seed_decoder_layers == 3
    out = obj(obj.collate([tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]))
    assert set(out) == {"loss", "mlm", "rec"}
    assert torch.allclose(out["loss"], out["mlm"] + out["rec"])
    losses = _train(obj, tok)
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses
    obj.save_pretrained(str(tmp_path / "out"))
    with open(tmp_path / "out" / "decoder" / "decoder_config.json") as f:
        assert json.load(f)["attention_span"] == 2
    assert os.path.exists(tmp_path / "out" / "decoder" / "decoder.safetensors")


def test_refuses_tokenizer_without_mask_token(tiny_bert_dir):
    model, tok, cfg = _load(tiny_bert_dir)
    tok.mask_token = None
    with pytest.raises(ValueError, match="mask token"):
        build_objective("seed", model, tok, cfg)
