"""RetroMAE objective: per-row enhanced-decoding masks, the decoder and its loss vs a naive per-row
reference, shared embeddings and MLM head, bad ratios, training."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.objectives import load_tiny, sharpen, train_losses
from pretrain.objectives import build_objective
from pretrain.objectives.retromae import EnhancedDecoderLayer, retromae_decoder_mask

TEXTS = ["the quick brown fox jumps over the lazy dog", "dense retrieval with a masked auto encoder",
         "information retrieval evaluation campaigns", "pre-training language models for search"]


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


def test_mask_is_drawn_on_the_inputs_device_without_host_sync():
    # meta tensors have no data: any .item(), .tolist(), .cpu() or Python loop over values would fail
    am, sp = _batch_masks([5, 3], 8)
    vis = retromae_decoder_mask(am.to("meta"), sp.to("meta"), 0.5)
    assert vis.device.type == "meta" and vis.shape == (2, 8, 8) and vis.dtype == torch.bool


@pytest.mark.parametrize("ratio", [0.0, 1.0, -0.1, 1.5])
def test_bad_decoder_ratio(ratio, tiny_bert_dir):
    am, sp = _batch_masks([3], 5)
    with pytest.raises(ValueError, match="decoder_mask_ratio"):
        retromae_decoder_mask(am, sp, ratio)
    with pytest.raises(ValueError, match="decoder.mask.ratio"):  # refused when the options are made
        model, tok, cfg = load_tiny(tiny_bert_dir, objective="retromae", decoder_mask_ratio=ratio)
        build_objective("retromae", model, tok, cfg)


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_bad_encoder_ratio(ratio, tiny_bert_dir):
    with pytest.raises(ValueError, match="encoder.mask.ratio"):  # refused when the options are made
        model, tok, cfg = load_tiny(tiny_bert_dir, objective="retromae", encoder_mask_ratio=ratio)
        build_objective("retromae", model, tok, cfg)


def _naive_layer_row(layer, q_row: torch.Tensor, content: torch.Tensor, keys: list[int]) -> torch.Tensor:
    """Output of ``layer`` for one query row attending to the content rows ``keys`` (written out)."""
    H, nh = q_row.shape[0], layer.num_heads
    d = H // nh
    q, k, v = layer.query(q_row), layer.key(content[keys]), layer.value(content[keys])
    ctx = torch.cat([torch.softmax(q[a * d:(a + 1) * d] @ k[:, a * d:(a + 1) * d].T / math.sqrt(d), -1)
                     @ v[:, a * d:(a + 1) * d] for a in range(nh)])
    h = layer.attn_norm(q_row + layer.attn_out(ctx))
    return layer.ffn_norm(h + layer.ffn_out(F.gelu(layer.ffn_in(h))))


def test_decoder_layer_matches_naive_per_row_reference():
    torch.manual_seed(0)
    layer = EnhancedDecoderLayer(16, 4, 24, dropout=0.0).eval()
    am, sp = _batch_masks([6, 3], 8)
    q, c = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    vis = retromae_decoder_mask(am, sp, 0.5, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = layer(q, c, vis)
        for b, n in enumerate([6, 3]):
            for i in range(1, n + 1):
                keys = [j for j in range(8) if vis[b, i, j]]
                torch.testing.assert_close(got[b, i], _naive_layer_row(layer, q[b, i], c[b], keys), rtol=1e-4, atol=1e-5)


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


def test_rec_loss_matches_naive_reference(tiny_bert_dir):
    model, tok, cfg = load_tiny(tiny_bert_dir, objective="retromae")
    obj = build_objective("retromae", model, tok, cfg).eval()
    sharpen(obj)
    examples = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    batch = obj.collate(examples)
    obj.decoder_mask_generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        out = obj(batch)
        vis = retromae_decoder_mask(batch["attention_mask"], batch["special_tokens_mask"], cfg.decoder_mask_ratio,
                                    generator=torch.Generator().manual_seed(7))  # the same draw
        emb = model.bert.embeddings
        terms = []
        for b, ids in enumerate(examples):
            n = len(ids)
            h = model.bert(input_ids=batch["masked_input_ids"][b:b + 1, 0, :n + 2]).last_hidden_state[0, 0]
            e = emb(input_ids=torch.tensor([[tok.cls_token_id] + ids + [tok.sep_token_id]]))[0]
            content = torch.cat([h[None], e[1:]])                       # H2 = [h; e(t1) ... e(SEP)]
            for i in range(1, n + 1):                                   # every text token is reconstructed
                query = h + emb.position_embeddings.weight[i]           # H1[i] = h + p_i
                keys = [j for j in range(n + 2) if vis[b, i, j]]
                logits = model.cls(_naive_layer_row(obj.decoder, query, content, keys))  # the encoder's MLM head
                terms.append(-float(torch.log_softmax(logits, -1)[ids[i - 1]]))
    assert float(out["rec"]) == pytest.approx(sum(terms) / len(terms), rel=1e-4)


def test_embeddings_and_head_are_the_encoders(tiny_bert_dir):
    model, tok, cfg = load_tiny(tiny_bert_dir, objective="retromae")
    obj = build_objective("retromae", model, tok, cfg)
    own = {n for n, _ in obj.named_parameters()} - {"mlm_model." + n for n, _ in model.named_parameters()}
    assert own == {"decoder." + n for n, _ in obj.decoder.named_parameters()}  # a single layer, nothing else
    batch = obj.collate([tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS])
    batch["mlm_labels"].fill_(-100)  # no MLM term: the head's gradient below comes from the reconstruction
    obj(batch)["loss"].backward()
    assert float(model.cls.predictions.transform.dense.weight.grad.abs().sum()) > 0


def test_encoder_view_is_masked_at_encoder_ratio(tiny_bert_dir):
    model, tok, cfg = load_tiny(tiny_bert_dir, objective="retromae")
    obj = build_objective("retromae", model, tok, cfg)
    assert not hasattr(cfg, "mlm_probability")  # retromae's options have no BERT masking ratio
    batch = obj.collate([list(range(2000, 2100))] * 64)
    share = float((batch["mlm_labels"] != -100).float().sum() / (64 * 100))
    assert abs(share - cfg.encoder_mask_ratio) < 0.02, share


def test_loss_and_training(tiny_bert_dir):
    model, tok, cfg = load_tiny(tiny_bert_dir, objective="retromae")
    obj = build_objective("retromae", model, tok, cfg)
    examples = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    batch = obj.collate(examples)
    # encoder view masked at encoder_mask_ratio=0.3 (MLM labels only on content tokens)
    content = batch["attention_mask"].bool() & ~batch["special_tokens_mask"].bool()
    assert not (batch["mlm_labels"][:, 0] != -100)[~content].any()
    out = obj(batch)
    assert set(out.flat()) == {"loss", "mlm", "rec"} and torch.allclose(out["loss"], out["mlm"] + out["rec"])
    losses = train_losses(obj, examples)
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses


def test_refuses_tokenizer_without_mask_token(tiny_bert_dir):
    model, tok, cfg = load_tiny(tiny_bert_dir, objective="retromae")
    tok.mask_token = None
    with pytest.raises(ValueError, match="mask token"):
        build_objective("retromae", model, tok, cfg)
