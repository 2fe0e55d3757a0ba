"""RetroMAE objective: per-row enhanced-decoding masks, decoder locality, bad ratios, training."""
from __future__ import annotations

import pytest
import torch

from pretrain.config import PretrainConfig
from pretrain.objectives import build_objective
from pretrain.objectives.retromae import EnhancedDecoderLayer, retromae_decoder_mask

TEXTS = ["the quick brown fox jumps over the lazy dog", "dense retrieval with a masked auto encoder",
         "information retrieval evaluation campaigns", "pre-training language models for search"]


def _load(tiny_bert_dir: str, **cfg):
    from transformers import AutoModelForMaskedLM, AutoTokenizer
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_pretrained(tiny_bert_dir)
    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    return model, tok, PretrainConfig(model=tiny_bert_dir, **cfg)


def _batch_masks(lengths, L):
    """attention / special masks of texts [CLS] t1..tn [SEP] pad..."""
    am = torch.zeros(len(lengths), L, dtype=torch.long)
    sp = torch.zeros(len(lengths), L, dtype=torch.long)
    for b, n in enumerate(lengths):
        am[b, :n + 2] = 1
        sp[b, 0] = sp[b, n + 1] = 1
    return am, sp


@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.75])
def test_mask_properties(ratio):
    lengths, L = [10, 7, 1, 0], 12
    am, sp = _batch_masks(lengths, L)
    g = torch.Generator().manual_seed(1)
    vis = retromae_decoder_mask(am, sp, ratio, generator=g)
    assert vis.shape == (4, L, L) and vis.dtype == torch.bool
    for b, n in enumerate(lengths):
        content = list(range(1, n + 1))
        expected_hidden_others = int(ratio * (n - 1) + 0.5) if n else 0  # round half up of ratio * (n - 1)
        assert vis[b, :, 0].all()                                  # [CLS] always visible
        assert vis[b, content, n + 1].all()                        # [SEP] visible to prediction rows
        assert not vis[b, :, n + 2:].any()                         # padding hidden
        for i in content:
            assert not vis[b, i, i]                                # never its own position
            others = [j for j in content if j != i]
            hidden = sum(1 for j in others if not vis[b, i, j])
            assert hidden == expected_hidden_others, (b, i, hidden)


def test_mask_rows_differ_and_hide_uniformly():
    am, sp = _batch_masks([40] * 64, 42)
    vis = retromae_decoder_mask(am, sp, 0.5, generator=torch.Generator().manual_seed(0))
    rows = vis[:, 1:41, 1:41]
    # rows within a text are drawn independently
    assert len({tuple(r.flatten().tolist()) for r in rows[0]}) == 40
    # every off-diagonal content position is hidden with probability ~ 20/39
    off = ~torch.eye(40, dtype=torch.bool)
    rate = 1 - rows[:, off].float().mean()
    assert abs(float(rate) - 20 / 39) < 0.02


@pytest.mark.parametrize("ratio", [0.0, 1.0, -0.1, 1.5])
def test_bad_decoder_ratio(ratio, tiny_bert_dir):
    am, sp = _batch_masks([3], 5)
    with pytest.raises(ValueError, match="decoder_mask_ratio"):
        retromae_decoder_mask(am, sp, ratio)
    model, tok, cfg = _load(tiny_bert_dir, decoder_mask_ratio=ratio)
    with pytest.raises(ValueError, match="decoder_mask_ratio"):
        build_objective("retromae", model, tok, cfg)


def test_decoder_row_ignores_hidden_content():
    torch.manual_seed(0)
    layer = EnhancedDecoderLayer(16, 2, 32, dropout=0.0).eval()
    q, c = torch.randn(1, 6, 16), torch.randn(1, 6, 16)
    am, sp = _batch_masks([4], 6)
    vis = retromae_decoder_mask(am, sp, 0.5, generator=torch.Generator().manual_seed(3))
    base = layer(q, c, vis)
    for j in range(1, 5):
        c2 = c.clone()
        c2[0, j] += 3.0
        changed = (layer(q, c2, vis) - base).abs().amax(-1)[0] > 1e-5
        assert torch.equal(changed, vis[0, :, j]), j  # row i changes iff it may see column j


def test_loss_and_training(tiny_bert_dir):
    model, tok, cfg = _load(tiny_bert_dir)
    obj = build_objective("retromae", model, tok, cfg)
    examples = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    batch = obj.collate(examples)
    # encoder view masked at encoder_mask_ratio=0.3 (MLM labels only on content tokens)
    content = batch["attention_mask"].bool() & ~batch["special_tokens_mask"].bool()
    assert not (batch["mlm_labels"] != -100)[~content].any()
    out = obj(batch)
    assert set(out) == {"loss", "mlm", "rec"} and torch.allclose(out["loss"], out["mlm"] + out["rec"])
    opt = torch.optim.AdamW(obj.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        out = obj(obj.collate(examples))
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        losses.append(float(out["loss"]))
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses


def test_refuses_tokenizer_without_mask_token(tiny_bert_dir):
    model, tok, cfg = _load(tiny_bert_dir)
    tok.mask_token = None
    with pytest.raises(ValueError, match="mask token"):
        build_objective("retromae", model, tok, cfg)
