"""The papers' literal readings as options, each against a reference written
from the paper's equation with plain loops / the model's parts, not the library's loss helpers:

* ``--cl-reduction sum``: CPDAE Eq. 5, a sum over the m anchors;
* ``--rec-weighting idf`` with the contrastive loss;
* ``--bow-projection embeddings``: Eq. 11's "LM head, i.e. its embedding matrix", z = E h;
* ``--seed-window exact``: SEED's receptive field exactly k tokens (Eq. 9);
* ``--mlm-weight`` / ``--rec-weight`` (SEED, RetroMAE), ``--retromae-decoder-layers``;
* ``--adam-beta1/2``, ``--adam-epsilon``.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.objectives import load_tiny, sharpen, token_ids
from pretrain.objectives import build_objective

TEXTS = ["dense retrieval with a contrastive autoencoder", "the decoder predicts the bag of words of a passage",
         "masked language model pre-training of an encoder", "a query and its relevant document share words"]


def _examples(tok):
    return token_ids(tok, TEXTS)


def _build(tiny_bert_dir, name, extra=None, **cfg):
    model, tok, config = load_tiny(tiny_bert_dir, objective=name, batch_size=len(TEXTS), **cfg)
    obj = build_objective(name, model, tok, config, **(extra or {}))
    obj.mask_generator = torch.Generator().manual_seed(4)
    sharpen(obj)
    return obj.eval(), tok


# ----------------------------------------------------------------------------- naive pieces
def _views_cls(obj, batch):
    """[CLS] vectors of the 2m views, view-major, from the HF model's own forward."""
    ids = torch.cat([batch["masked_input_ids"][:, 0], batch["masked_input_ids"][:, 1]])
    am = batch["attention_mask"].repeat(2, 1)
    return obj.mlm_model(input_ids=ids, attention_mask=am, output_hidden_states=True).hidden_states[-1][:, 0]


def _js(p, q):
    def h(x):
        x = x[x > 0]
        return -float((x * torch.log(x)).sum())
    return h((p + q) / 2) - (h(p) + h(q)) / 2


def _eq5(sim, m, tau, anchors):
    """-Σ_{i in anchors} log( exp(s(i, twin)/τ) / Σ_{j≠i} exp(s(i, j)/τ) ), written out."""
    total = 0.0
    for i in anchors:
        twin = (i + m) % (2 * m)
        denom = sum(math.exp(sim[i][j] / tau) for j in range(2 * m) if j != i)
        total += -math.log(math.exp(sim[i][twin] / tau) / denom)
    return total


# ----------------------------------------------------------------------------- CPDAE Eq. 5
@pytest.mark.parametrize("name", ["cpdae", "cpdae_r"])
def test_cl_reduction_sum_is_eq5_over_the_m_anchors(tiny_bert_dir, name):
    tau = 0.5
    obj, tok = _build(tiny_bert_dir, name, temperature=tau, cl_reduction="sum", cl_weight=0.3)
    batch = obj.collate(_examples(tok))
    with torch.no_grad():
        out = obj(batch)
        cls = _views_cls(obj, batch).double()
        if name == "cpdae":
            s = torch.sigmoid(obj.decoder(cls.float()).double())
            p = s / s.sum(-1, keepdim=True)
            sim = [[-_js(p[i], p[j]) for j in range(8)] for i in range(8)]
        else:
            sim = [[float(cls[i] @ cls[j]) for j in range(8)] for i in range(8)]
    m = len(TEXTS)
    expected = _eq5(sim, m, tau, anchors=range(m))  # the first view of each text is the anchor
    assert out["cl"].item() == pytest.approx(expected, rel=1e-4)
    assert out["loss"].item() == pytest.approx((out["rec"] + out["mlm"] + 0.3 * out["cl"]).item(), rel=1e-5)
    # the default stays the mean over all 2m views as anchors
    obj_mean, _ = _build(tiny_bert_dir, name, temperature=tau, cl_weight=0.3)
    with torch.no_grad():
        mean = obj_mean(batch)["cl"].item()
    assert mean == pytest.approx(_eq5(sim, m, tau, anchors=range(2 * m)) / (2 * m), rel=1e-4)
    assert obj_mean.config.cl_reduction == "mean"


# ----------------------------------------------------------------------------- IDF-weighted REC + CL
def test_idf_weighted_rec_with_the_contrastive_loss(tiny_bert_dir):
    vocab = 30522
    idf = torch.rand(vocab, generator=torch.Generator().manual_seed(1)) * 8
    obj, tok = _build(tiny_bert_dir, "cpdae", extra={"idf": idf}, rec_weighting="idf", temperature=0.5)
    batch = obj.collate(_examples(tok))
    with torch.no_grad():
        out = obj(batch)
        logits = obj.decoder(_views_cls(obj, batch)).double()
    m = len(TEXTS)
    special = set(tok.all_special_ids)
    rows = []
    for i in range(2 * m):
        n = int(batch["attention_mask"][i % m].sum())
        words = {t for t in batch["input_ids"][i % m][1:n - 1].tolist() if t not in special}
        z = logits[i]
        y = torch.zeros(vocab, dtype=torch.float64)
        y[list(words)] = 1.0
        # BCE(σ(z), y) = -[y log σ(z) + (1-y) log(1-σ(z))], weighted by idf(v), summed over v (Eq. 4 + IDF)
        bce = -(y * F.logsigmoid(z) + (1 - y) * F.logsigmoid(-z))
        rows.append(float((idf.double() * bce).sum()))
    assert out["rec"].item() == pytest.approx(sum(rows) / len(rows), rel=1e-4)
    assert "cl" in out and out["loss"].item() == pytest.approx((out["rec"] + out["mlm"] + 0.1 * out["cl"]).item(),
                                                               rel=1e-5)
    with pytest.raises(ValueError, match="needs idf weights"):
        _build(tiny_bert_dir, "cpdae", rec_weighting="idf")
    # cpdae_idfrec is IDF by definition: its only choice, refused when the config is made
    with pytest.raises(ValueError, match="--rec_weighting must be one of idf, got 'none'"):
        _build(tiny_bert_dir, "cpdae_idfrec", extra={"idf": idf}, rec_weighting="none")


def test_prepare_gives_idf_when_asked(tiny_bert_dir, tmp_path):
    from transformers import AutoTokenizer

    from pretrain.objectives import objective_config
    from pretrain.data.corpus import TokenCache, idf_weights
    from pretrain.objectives import objective_class

    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    cache = TokenCache.build_or_load(str(corpus), AutoTokenizer.from_pretrained(tiny_bert_dir), 32, str(tmp_path / "c"))
    cls = objective_class("cpdae")
    got = cls.prepare(cache, objective_config("cpdae", rec_weighting="idf", decoder_bias_init="zero"))
    assert set(got) == {"idf"} and torch.equal(got["idf"], idf_weights(cache))
    assert set(cls.prepare(cache, objective_config("cpdae"))) == {"bias_prior"}


# ----------------------------------------------------------------------------- BoW Eq. 11
def test_bow_through_the_embedding_matrix_alone(tiny_bert_dir):
    obj, tok = _build(tiny_bert_dir, "bow", bow_projection="embeddings")
    batch = obj.collate(_examples(tok))
    with torch.no_grad():
        out = obj(batch)
        h = obj.mlm_model(input_ids=batch["masked_input_ids"][:, 0], attention_mask=batch["attention_mask"],
                          output_hidden_states=True).hidden_states[-1][:, 0].double()
        E = obj.mlm_model.get_input_embeddings().weight.double()
        head = obj.mlm_model(input_ids=batch["masked_input_ids"][:, 0], attention_mask=batch["attention_mask"]).logits[:, 0]
    special = set(tok.all_special_ids)
    per_text, per_text_head = [], []
    for b in range(len(TEXTS)):
        n = int(batch["attention_mask"][b].sum())
        words = sorted({t for t in batch["input_ids"][b][1:n - 1].tolist() if t not in special})
        z = E @ h[b]  # Eq. 11: logits through E alone, no transform, no bias
        logp = z - torch.logsumexp(z, 0)
        per_text.append(-sum(float(logp[t]) for t in words) / len(words))
        lp = head[b].double() - torch.logsumexp(head[b].double(), 0)
        per_text_head.append(-sum(float(lp[t]) for t in words) / len(words))
    assert out["bow"].item() == pytest.approx(sum(per_text) / len(per_text), rel=1e-5)
    # the default (full MLM head) is a different function
    assert abs(sum(per_text_head) / len(per_text_head) - out["bow"].item()) > 1e-3
    default, _ = _build(tiny_bert_dir, "bow")
    with torch.no_grad():
        assert default(batch)["bow"].item() == pytest.approx(sum(per_text_head) / len(per_text_head), rel=1e-5)


# ----------------------------------------------------------------------------- SEED Eq. 9
def _receptive_fields(dec, L, H):
    """For every output position j: the input positions it depends on (non-zero gradient)."""
    x = torch.randn(1, L, H, dtype=torch.float32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    out = dec(x, torch.ones(1, L, dtype=torch.long))
    probe = torch.randn(H, generator=torch.Generator().manual_seed(1))  # (a plain sum is constant after LayerNorm)
    fields = []
    for j in range(L):
        (g,) = torch.autograd.grad(out[0, j] @ probe, x, retain_graph=True)
        fields.append({i for i in range(L) if float(g[0, i].abs().sum()) > 0})
    return fields


@pytest.mark.parametrize("k", [2, 3])
def test_seed_window_exact_has_receptive_field_k(k):
    from pretrain.objectives.seed import SEEDDecoder

    L, H, layers = 10, 16, 3
    torch.manual_seed(0)
    exact = SEEDDecoder(H, 50, num_layers=layers, num_heads=2, intermediate_size=32, span=k, dropout=0.0,
                        window="exact").eval()
    per_layer = SEEDDecoder(H, 50, num_layers=layers, num_heads=2, intermediate_size=32, span=k, dropout=0.0).eval()
    for j, field in enumerate(_receptive_fields(exact, L, H)):
        assert field == {0} | {i for i in range(j - k + 1, j + 1) if i >= 0}, (j, field)  # exactly k tokens + [CLS]
    for j, field in enumerate(_receptive_fields(per_layer, L, H)):
        width = layers * (k - 1) + 1  # the window compounds over the layers (3 layers, k=2: 4 tokens)
        assert field == {0} | {i for i in range(j - width + 1, j + 1) if i >= 0}, (j, field)


# ----------------------------------------------------------------------------- loss weights, decoder layers
@pytest.mark.parametrize("name", ["seed", "retromae"])
def test_loss_weights(tiny_bert_dir, name):
    obj, tok = _build(tiny_bert_dir, name, mlm_weight=0.25, rec_weight=2.0)
    obj.decoder_mask_generator = torch.Generator().manual_seed(0)
    out = obj(obj.collate(_examples(tok)))
    assert out["loss"].item() == pytest.approx(0.25 * out["mlm"].item() + 2.0 * out["rec"].item(), rel=1e-6)
    assert out["mlm"].item() != pytest.approx(out["rec"].item(), rel=1e-3)  # the weights are distinguishable


def test_retromae_stacked_decoder_layers(tiny_bert_dir, tmp_path):
    import json

    from pretrain.objectives.retromae import retromae_decoder_mask

    obj, tok = _build(tiny_bert_dir, "retromae", retromae_decoder_layers=2)
    assert len(obj.extra_decoder_layers) == 1
    batch = obj.collate(_examples(tok))
    obj.decoder_mask_generator = torch.Generator().manual_seed(9)
    with torch.no_grad():
        out = obj(batch)
        # reference: h = [CLS] of the masked view; query stream h + p_i; content [h; e(t_1..)]; two layers in turn
        ids, am = batch["input_ids"], batch["attention_mask"]
        h = obj.mlm_model(input_ids=batch["masked_input_ids"][:, 0], attention_mask=am,
                          output_hidden_states=True).hidden_states[-1][:, :1]
        emb = obj.mlm_model.bert.embeddings
        content = torch.cat([h, emb(input_ids=ids)[:, 1:]], 1)
        q = h + emb.position_embeddings.weight[:ids.shape[1]].unsqueeze(0)
        visible = retromae_decoder_mask(am, batch["special_tokens_mask"], 0.5,
                                        generator=torch.Generator().manual_seed(9))
        x = obj.extra_decoder_layers[0](obj.decoder(q, content, visible), content, visible)
        logits = obj.mlm_model.cls(x).double()
    special = set(tok.all_special_ids)
    total, count = 0.0, 0
    for b in range(ids.shape[0]):
        for i in range(ids.shape[1]):
            t = int(ids[b, i])
            if am[b, i] and t not in special:
                total += float(torch.logsumexp(logits[b, i], 0) - logits[b, i, t])
                count += 1
    assert out["rec"].item() == pytest.approx(total / count, rel=1e-5)
    obj.save_pretrained(str(tmp_path / "m"))
    cfg = json.loads((tmp_path / "m" / "decoder" / "decoder_config.json").read_text())
    assert cfg["num_layers"] == 2
    with pytest.raises(ValueError, match="retromae.decoder.layers"):  # now refused when the options are made
        _build(tiny_bert_dir, "retromae", retromae_decoder_layers=0)


# ----------------------------------------------------------------------------- Adam β/ε
