"""SEED-Encoder objective: window mask vs a hand-built one, the decoder and its loss vs a naive
per-position reference, tied output layer, bad input, training."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.objectives import load_tiny, sharpen, token_ids, train_losses
from pretrain.objectives import build_objective
from pretrain.objectives.seed import SEEDDecoder, seed_attention_mask

TEXTS = ["the quick brown fox jumps over the lazy dog", "dense retrieval with a weak decoder",
         "information retrieval evaluation campaigns", "pre-training language models for search"]


def _examples(tok, texts=TEXTS) -> list[list[int]]:
    return token_ids(tok, texts)


def _naive_decoder(dec: SEEDDecoder, x: torch.Tensor, span: int) -> torch.Tensor:
    """One unpadded text ``x`` (L, H) through ``dec``'s weights, one query position at a time.

    Position ``j`` attends to the key set {0} ∪ {j-span+1, ..., j} (clipped at 0), written out
    as a Python set, independently of :func:`seed_attention_mask`.
    """
    h = x
    for layer in dec.layers:
        att = layer.self_attn
        H, nh = h.shape[1], att.num_heads
        d = H // nh
        W, b = att.in_proj_weight, att.in_proj_bias
        q, k, v = h @ W[:H].T + b[:H], h @ W[H:2 * H].T + b[H:2 * H], h @ W[2 * H:].T + b[2 * H:]
        rows = []
        for j in range(h.shape[0]):
            keys = sorted({0} | {i for i in range(j - span + 1, j + 1) if i >= 0})
            heads = []
            for a in range(nh):
                s = slice(a * d, (a + 1) * d)
                p = torch.softmax(q[j, s] @ k[keys, s].T / math.sqrt(d), -1)
                heads.append(p @ v[keys, s])
            rows.append(torch.cat(heads))
        attn = att.out_proj(torch.stack(rows))
        h1 = layer.norm1(h + attn)
        h = layer.norm2(h1 + layer.linear2(F.gelu(layer.linear1(h1))))
    return dec.output_norm(h)


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
    dec = SEEDDecoder(16, 50, num_layers=3, num_heads=2, intermediate_size=32, span=2, dropout=0.0).eval()
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


@pytest.mark.parametrize("span", [1, 2, 3])
def test_decoder_matches_naive_per_position_reference(span):
    torch.manual_seed(1)
    dec = SEEDDecoder(16, 50, num_layers=2, num_heads=4, intermediate_size=24, span=span, dropout=0.0).eval()
    lengths = [7, 4]  # a padded batch: the second text has 3 pads
    x = torch.randn(2, 7, 16)
    am = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    with torch.no_grad():
        got = dec(x, am)
        for b, n in enumerate(lengths):
            torch.testing.assert_close(got[b, :n], _naive_decoder(dec, x[b, :n], span), rtol=1e-4, atol=1e-5)


def test_targets_are_next_tokens(tiny_bert_dir):
    model, tok, cfg = load_tiny(tiny_bert_dir, objective="seed")
    obj = build_objective("seed", model, tok, cfg)
    batch = obj.collate([[2000, 2001, 2002], [2003]])
    t = obj.decoder_targets(batch["input_ids"], batch["special_tokens_mask"], batch["attention_mask"])
    # [CLS] a b c [SEP]  -> position j predicts token j+1; [SEP]/pad not predicted
    assert t.tolist() == [[2000, 2001, 2002, -100, -100], [2003, -100, -100, -100, -100]]


def test_rec_loss_matches_naive_reference(tiny_bert_dir):
    model, tok, cfg = load_tiny(tiny_bert_dir, objective="seed")
    obj = build_objective("seed", model, tok, cfg).eval()
    sharpen(obj)
    examples = _examples(tok)
    batch = obj.collate(examples)
    with torch.no_grad():
        out = obj(batch)
        terms = []
        W = model.bert.embeddings.word_embeddings.weight
        for b, ids in enumerate(examples):
            n = len(ids)
            # this text alone, unpadded: [CLS] vector of its masked view, embeddings of the original tokens
            h_cls = model.bert(input_ids=batch["masked_input_ids"][b:b + 1, 0, :n + 2]).last_hidden_state[0, 0]
            orig = torch.tensor([[tok.cls_token_id] + ids + [tok.sep_token_id]])
            e = model.bert.embeddings(input_ids=orig)[0]
            states = _naive_decoder(obj.decoder, torch.cat([h_cls[None], e[1:]]), cfg.seed_attention_span)
            for j in range(n):  # position j ([CLS] or token j) predicts token j+1
                logp = torch.log_softmax(states[j] @ W.T + obj.decoder.output_bias, -1)
                terms.append(-float(logp[ids[j]]))
    assert float(out["rec"]) == pytest.approx(sum(terms) / len(terms), rel=1e-4)


def test_output_layer_is_the_word_embedding_matrix(tiny_bert_dir):
    model, tok, cfg = load_tiny(tiny_bert_dir, objective="seed")
    obj = build_objective("seed", model, tok, cfg)
    own = {n for n, _ in obj.named_parameters()} - {"mlm_model." + n for n, _ in model.named_parameters()}
    assert own == {"decoder." + n for n, _ in obj.decoder.named_parameters()}
    assert not any(p.shape[0] == model.config.vocab_size and p.dim() == 2 for p in obj.decoder.parameters())
    examples = _examples(tok)
    batch = obj.collate(examples)
    batch["mlm_labels"].fill_(-100)  # no MLM term: every gradient below comes from the reconstruction
    obj(batch)["loss"].backward()
    seen = set(batch["input_ids"].flatten().tolist()) | set(batch["masked_input_ids"].flatten().tolist())
    absent = next(t for t in range(2000, 3000) if t not in seen)
    # a token that is in neither input gets a gradient only through the tied output projection
    assert float(model.bert.embeddings.word_embeddings.weight.grad[absent].abs().sum()) > 0
    assert float(model.cls.predictions.transform.dense.weight.grad.abs().sum()) == 0  # MLM head unused


def test_loss_components_and_training(tiny_bert_dir, tmp_path):
    model, tok, cfg = load_tiny(tiny_bert_dir, objective="seed")
    obj = build_objective("seed", model, tok, cfg)
    assert len(obj.decoder.layers) == cfg.seed_decoder_layers == 3
    examples = _examples(tok)
    out = obj(obj.collate(examples))
    assert set(out.flat()) == {"loss", "mlm", "rec"}
    assert torch.allclose(out["loss"], out["mlm"] + out["rec"])
    obj.train()
    losses = train_losses(obj, examples)
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses
    obj.save_pretrained(str(tmp_path / "out"))
    with open(tmp_path / "out" / "decoder" / "decoder_config.json") as f:
        assert json.load(f)["attention_span"] == 2
    assert os.path.exists(tmp_path / "out" / "decoder" / "model.safetensors")  # an ObjectiveHead (Hugging Face)


def test_refuses_tokenizer_without_mask_token(tiny_bert_dir):
    model, tok, cfg = load_tiny(tiny_bert_dir, objective="seed")
    tok.mask_token = None
    with pytest.raises(ValueError, match="mask token"):
        build_objective("seed", model, tok, cfg)


@pytest.mark.parametrize("option", [{"seed_attention_span": 0}, {"seed_decoder_layers": 0}])
def test_refuses_bad_decoder_options(tiny_bert_dir, option):
    with pytest.raises(ValueError, match=next(iter(option)).replace("_", ".")):  # refused when the options are made
        model, tok, cfg = load_tiny(tiny_bert_dir, objective="seed", **option)
        build_objective("seed", model, tok, cfg)
