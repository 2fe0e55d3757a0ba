"""Tests of the CPDAE objectives (cpdae, cpdae_r, cpdae_nocl, cpdae_idfrec), the MLM baseline,
the decoder module and load_mlm_model, against independent naive re-computations."""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from pretrain.objectives import objective_config
from pretrain.model.modeling import CPDAEDecoder, load_mlm_model
from pretrain.objectives import build_objective

from tests.helpers.objectives import make, token_ids

TEXTS = ["the quick brown fox jumps over the lazy dog",
         "information retrieval with dense vectors and sparse indexes",
         "a cat sat on the mat in the kitchen \u2603",  # the snowman is [UNK]: a special token, never a REC label
         "pretraining autoencoders for retrieval of scientific documents"]


@pytest.fixture(scope="module")
def examples(tok):
    return token_ids(tok, TEXTS)


# --------------------------------------------------------------------------- naive references
def naive_bow(ids: list[int], vocab: int) -> torch.Tensor:
    t = torch.zeros(vocab)
    for i in set(ids):
        t[i] = 1.0
    return t


def naive_js(p: torch.Tensor, q: torch.Tensor) -> float:
    m = (p + q) / 2

    def h(x):  # entropy, 0 log 0 = 0
        x = x[x > 0]
        return -float((x * torch.log(x)).sum())
    return h(m) - (h(p) + h(q)) / 2


def naive_info_nce(sim: list[list[float]], m: int) -> float:
    n = 2 * m
    total = 0.0
    for i in range(n):
        pos = (i + m) % n
        denom = sum(math.exp(sim[i][j]) for j in range(n) if j != i)
        total += -math.log(math.exp(sim[i][pos]) / denom)
    return total / n


# --------------------------------------------------------------------------- batches
def test_collate_builds_two_independent_views(tiny_bert_dir, tok, examples):
    obj = make("cpdae", tiny_bert_dir, tok)
    b = obj.collate(examples)
    m, L = len(examples), max(map(len, examples)) + 2
    assert b["input_ids"].shape == (m, L) and b["masked_input_ids"].shape == (m, 2, L)
    assert b["mlm_labels"].shape == (m, 2, L)
    assert not torch.equal(b["mlm_labels"][:, 0], b["mlm_labels"][:, 1])
    for v in range(2):
        sel = b["mlm_labels"][:, v] != -100
        assert torch.equal(b["mlm_labels"][:, v][sel], b["input_ids"][sel])
        assert not bool(sel[b["special_tokens_mask"]].any())
    views = obj.views(b["masked_input_ids"])
    assert torch.equal(views[1], b["masked_input_ids"][1, 0]) and torch.equal(views[m + 1], b["masked_input_ids"][1, 1])


def test_contrastive_objectives_refuse_single_text(tiny_bert_dir, tok, examples):
    for name in ("cpdae", "cpdae_r"):
        obj = make(name, tiny_bert_dir, tok)
        assert obj.contrastive
        with pytest.raises(ValueError, match="at least 2 texts per batch"):
            obj.collate(examples[:1])
        with pytest.raises(ValueError, match="at least 2 texts per batch"):
            make(name, tiny_bert_dir, tok, batch_size=1)
    # non-contrastive objectives accept a single text
    make("cpdae_nocl", tiny_bert_dir, tok, batch_size=1).collate(examples[:1])


# --------------------------------------------------------------------------- losses
def _naive_components(obj, batch, idf=None, reduction="sum"):
    """Recompute L_MLM, L_REC and the JS matrix from the model's parts without the library losses."""
    m = batch["input_ids"].shape[0]
    ids = torch.cat([batch["masked_input_ids"][:, 0], batch["masked_input_ids"][:, 1]])
    labels = torch.cat([batch["mlm_labels"][:, 0], batch["mlm_labels"][:, 1]])
    am = batch["attention_mask"].repeat(2, 1)
    out = obj.mlm_model(input_ids=ids, attention_mask=am, output_hidden_states=True)
    full_logits = out.logits  # (2m, L, |V|): the naive full MLM computation
    l_mlm = F.cross_entropy(full_logits.reshape(-1, full_logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    cls = out.hidden_states[-1][:, 0]
    logits = obj.decoder(cls)
    vocab = logits.shape[-1]
    rows = []
    special_ids = set(obj.tokenizer.all_special_ids)
    for i in range(2 * m):
        # labels: the token ids of the unmasked text between [CLS] and [SEP], minus special tokens
        n = int(batch["attention_mask"][i % m].sum())
        real = [t for t in batch["input_ids"][i % m][1:n - 1].tolist() if t not in special_ids]
        y = naive_bow(real, vocab)
        per = F.binary_cross_entropy_with_logits(logits[i], y, reduction="none")
        if idf is not None:
            per = per * idf
        rows.append(per.sum() if reduction == "sum" else per.mean())
    l_rec = torch.stack(rows).mean()
    return l_mlm, l_rec, cls, logits


def test_cpdae_forward_matches_naive(tiny_bert_dir, tok, examples):
    obj = make("cpdae", tiny_bert_dir, tok).eval()
    batch = obj.collate(examples)
    out = obj(batch)
    assert set(out.flat()) == {"loss", "mlm", "rec", "cl"}
    assert out["loss"].item() == pytest.approx((out["rec"] + out["mlm"] + 0.1 * out["cl"]).item(), rel=1e-6)
    l_mlm, l_rec, cls, logits = _naive_components(obj, batch)
    assert out["mlm"].item() == pytest.approx(l_mlm.item(), rel=1e-5)
    assert out["rec"].item() == pytest.approx(l_rec.item(), rel=1e-5)
    s = torch.sigmoid(logits.detach().double())
    p = s / s.sum(-1, keepdim=True)
    m = len(examples)
    sim = [[-naive_js(p[i], p[j]) for j in range(2 * m)] for i in range(2 * m)]
    assert out["cl"].item() == pytest.approx(naive_info_nce(sim, m), rel=1e-5)
    assert tok.unk_token_id in examples[2]  # a special token inside a text: excluded from the REC labels above


def test_cpdae_gradients_match_naive(tiny_bert_dir, tok, examples):
    """The gradient of each loss component on every parameter equals that of a naive computation
    (full B×L×|V| MLM logits, broadcast JS, explicit twin targets with the row itself excluded),
    and ``loss`` combines them with λ = 0.1."""
    from pretrain.model.losses import pairwise_js_naive
    # float64: in float32 the naive H(M) - (H_i + H_j)/2 loses ~3 digits to cancellation (JS << H)
    obj = make("cpdae", tiny_bert_dir, tok, temperature=0.05).eval().double()
    with torch.no_grad():  # spread the logits: at N(0, 0.02) init all ž are nearly uniform and L_CL's gradient ~0
        obj.decoder.decoder.weight.normal_(std=0.5, generator=torch.Generator().manual_seed(0))
    batch = obj.collate(examples)
    named = [(n, p) for n, p in obj.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    got = obj.compute_losses(batch)
    l_mlm, l_rec, _, logits = _naive_components(obj, batch)
    s = torch.sigmoid(logits)
    p = s / s.sum(-1, keepdim=True)
    n, m = p.shape[0], p.shape[0] // 2
    sim = (-pairwise_js_naive(p) / 0.05).masked_fill(torch.eye(n, dtype=torch.bool), float("-inf"))
    ref = {"mlm": l_mlm, "rec": l_rec, "cl": F.cross_entropy(sim, (torch.arange(n) + m) % n)}
    assert set(got) == set(ref)
    for key in ref:
        g_got = torch.autograd.grad(got[key], params, allow_unused=True, retain_graph=True)
        g_ref = torch.autograd.grad(ref[key], params, allow_unused=True, retain_graph=True)
        assert sum(g is not None and bool(g.any()) for g in g_ref) >= 3, key
        scale = max(float(g.abs().max()) for g in g_ref if g is not None)  # this component's largest gradient
        for (name, _), a, b in zip(named, g_got, g_ref):
            if b is None:
                assert a is None or not bool(a.any()), (key, name)
                continue
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * scale,
                                       msg=lambda e, k=key, nm=name: f"{k} {nm}: {e}")
    out = obj(batch)
    assert out["loss"].item() == pytest.approx((got["rec"] + got["mlm"] + 0.1 * got["cl"]).item(), rel=1e-6)


def test_cpdae_r_contrasts_cls_vectors_by_dot_product(tiny_bert_dir, tok, examples):
    obj = make("cpdae_r", tiny_bert_dir, tok, temperature=20.0).eval()
    batch = obj.collate(examples)
    out = obj(batch)
    _, l_rec, cls, _ = _naive_components(obj, batch)
    m = len(examples)
    sim = [[float(cls[i].detach() @ cls[j].detach()) / 20.0 for j in range(2 * m)] for i in range(2 * m)]
    assert out["cl"].item() == pytest.approx(naive_info_nce(sim, m), rel=1e-4)
    assert out["rec"].item() == pytest.approx(l_rec.item(), rel=1e-5)


def test_nocl_and_idfrec(tiny_bert_dir, tok, examples):
    obj = make("cpdae_nocl", tiny_bert_dir, tok, rec_reduction="mean").eval()
    batch = obj.collate(examples)
    out = obj(batch)
    assert set(out.flat()) == {"loss", "mlm", "rec"} and not obj.contrastive
    l_mlm, l_rec, _, _ = _naive_components(obj, batch, reduction="mean")
    assert out["rec"].item() == pytest.approx(l_rec.item(), rel=1e-5)
    assert out["loss"].item() == pytest.approx(l_rec.item() + l_mlm.item(), rel=1e-5)

    vocab = obj.mlm_model.config.vocab_size
    idf = torch.rand(vocab, generator=torch.Generator().manual_seed(1)) * 8
    obj = make("cpdae_idfrec", tiny_bert_dir, tok, idf=idf).eval()
    batch = obj.collate(examples)
    out = obj(batch)
    assert set(out.flat()) == {"loss", "mlm", "rec"}
    _, l_rec, _, _ = _naive_components(obj, batch, idf=idf)
    assert out["rec"].item() == pytest.approx(l_rec.item(), rel=1e-5)
    with pytest.raises(ValueError, match="idf"):
        make("cpdae_idfrec", tiny_bert_dir, tok, idf=None)
    with pytest.raises(ValueError, match="shape"):
        make("cpdae_idfrec", tiny_bert_dir, tok, idf=torch.ones(10))
    with pytest.raises(ValueError, match="idf"):
        make("cpdae", tiny_bert_dir, tok, idf=idf)


def test_mlm_objective_matches_hf_loss(tiny_bert_dir, tok, examples):
    obj = make("mlm", tiny_bert_dir, tok).eval()
    batch = obj.collate(examples)
    assert batch["masked_input_ids"].shape[1] == 1
    out = obj(batch)
    assert set(out.flat()) == {"loss", "mlm"}
    ref = obj.mlm_model(input_ids=batch["masked_input_ids"][:, 0], attention_mask=batch["attention_mask"],
                        labels=batch["mlm_labels"][:, 0]).loss
    assert out["loss"].item() == pytest.approx(ref.item(), rel=1e-5)


def test_whole_word_views(tiny_bert_dir, tok):
    obj = make("cpdae", tiny_bert_dir, tok, whole_word_mask=True, mlm_probability=0.5)
    ex = [tok("unbelievably astonishing hyperparameters", add_special_tokens=False)["input_ids"]] * 2
    b = obj.collate(ex)
    pieces = tok.convert_ids_to_tokens(b["input_ids"][0].tolist())
    for v in range(2):
        sel = (b["mlm_labels"][0, v] != -100).tolist()
        # a continuation piece is selected iff the piece before it is
        for k in range(1, len(pieces)):
            if pieces[k].startswith("##"):
                assert sel[k] == sel[k - 1]


# --------------------------------------------------------------------------- training
def test_short_training_run_lowers_every_component(tiny_bert_dir, tok, examples):
    """40 optimizer steps on 4 repeated texts: L_REC, L_MLM and L_CL all fall.

    Uses λ=1, τ=0.1, mean reduction and softmax word distributions so that the contrastive
    term is informative from the first steps on a tiny random model (with the paper's
    sigmoid normalisation over 30k words and τ=1, ž starts out almost uniform and L_CL
    only moves after L_REC has sharpened the decoder).
    """
    obj = make("cpdae", tiny_bert_dir, tok, cl_weight=1.0, temperature=0.1, rec_reduction="mean",
               cl_distribution="softmax")
    opt = torch.optim.AdamW(obj.parameters(), lr=1e-2)
    hist = []
    for _ in range(40):
        out = obj(obj.collate(examples))
        out["loss"].backward()
        opt.step()
        opt.zero_grad()
        hist.append({k: v.item() for k, v in out.flat().items()})
    first = {k: sum(h[k] for h in hist[:3]) / 3 for k in hist[0]}
    last = {k: sum(h[k] for h in hist[-3:]) / 3 for k in hist[0]}
    assert last["mlm"] < 0.9 * first["mlm"], (first, last)
    assert last["rec"] < 0.5 * first["rec"], (first, last)
    assert last["cl"] < first["cl"] - 0.2, (first, last)
    assert last["loss"] < first["loss"]


# --------------------------------------------------------------------------- decoder + loading
def test_save_pretrained_decoder_round_trip(tiny_bert_dir, tok, examples, tmp_path):
    obj = make("cpdae", tiny_bert_dir, tok).eval()
    with torch.no_grad():
        obj.decoder.decoder.bias.normal_()
    obj.save_pretrained(str(tmp_path))
    assert os.path.isfile(tmp_path / "decoder" / "model.safetensors")
    dec = CPDAEDecoder.from_pretrained(tmp_path / "decoder")
    for (k1, a), (k2, b) in zip(obj.decoder.state_dict().items(), dec.state_dict().items()):
        assert k1 == k2 and torch.equal(a, b)
    # the saved encoder + decoder reproduce the decoder logits of the objective
    from transformers import AutoModel
    enc = AutoModel.from_pretrained(str(tmp_path)).eval()
    batch = obj.collate(examples)
    with torch.no_grad():
        h1 = obj.encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state[:, 0]
        h2 = enc(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state[:, 0]
        assert torch.allclose(obj.decoder(h1), dec(h2), atol=1e-5)
    with pytest.raises(FileNotFoundError):
        CPDAEDecoder.from_pretrained(tmp_path / "nope")


def test_decoder_init_from_mlm_head(tiny_bert_dir, tok):
    obj = make("cpdae", tiny_bert_dir, tok, decoder_init="mlm_head")
    head = obj.mlm_model.cls.predictions
    d = obj.decoder
    assert torch.equal(d.transform.dense.weight, head.transform.dense.weight)
    assert torch.equal(d.transform.LayerNorm.bias, head.transform.LayerNorm.bias)
    assert torch.equal(d.decoder.weight, obj.mlm_model.get_input_embeddings().weight)
    assert d.decoder.weight.data_ptr() != obj.mlm_model.get_input_embeddings().weight.data_ptr()  # a copy
    x = torch.randn(3, d.config.hidden_size)
    assert torch.allclose(d(x), obj.mlm_model.cls(x), atol=1e-5)


def test_load_mlm_model(minilm_path, tiny_bert_dir, tmp_path):
    with pytest.raises(ValueError, match="no trained masked-LM head"):
        load_mlm_model(minilm_path, new_mlm_head=False)
    model = load_mlm_model(minilm_path)  # a new head, without asking (new_mlm_head=True does the same)
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    # encoder weights are the checkpoint's
    from transformers import AutoModel
    enc = AutoModel.from_pretrained(minilm_path)
    assert torch.equal(model.bert.embeddings.word_embeddings.weight, enc.embeddings.word_embeddings.weight)
    # a proper masked-LM checkpoint loads its head
    tiny = load_mlm_model(tiny_bert_dir)
    from safetensors.torch import load_file
    state = load_file(os.path.join(tiny_bert_dir, "model.safetensors"))
    assert torch.equal(tiny.cls.predictions.transform.dense.weight, state["cls.predictions.transform.dense.weight"])
    # --from-config: random weights with the config's shape
    rnd = load_mlm_model(tiny_bert_dir, from_config=tiny_bert_dir)
    assert rnd.config.hidden_size == 32
    assert not torch.equal(rnd.cls.predictions.transform.dense.weight, tiny.cls.predictions.transform.dense.weight)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_bert_dir, tok, examples):
    """--gradient-checkpointing (trainer.enable_gradient_checkpointing on the objective) changes memory, not results."""
    from pretrain.training.trainer import enable_gradient_checkpointing
    obj = make("cpdae", tiny_bert_dir, tok).train()  # train mode: dropout on, checkpointing active
    batch = obj.collate(examples)
    runs = []
    for checkpointing in (False, True):
        if checkpointing:
            enable_gradient_checkpointing(obj)
        torch.manual_seed(1)
        loss = obj(batch)["loss"]
        runs.append((loss.item(), torch.autograd.grad(loss, [p for p in obj.parameters() if p.requires_grad])))
    assert obj.mlm_model.bert.encoder.layer[0].gradient_checkpointing  # really switched on
    assert runs[0][0] == pytest.approx(runs[1][0], rel=1e-6)
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_bias_prior_sets_the_decoder_bias_and_checks_its_shape(tiny_bert_dir, tok):
    torch.manual_seed(0)
    prior = torch.randn(tok.vocab_size)
    cfg = objective_config("cpdae", model=tiny_bert_dir, batch_size=4)
    obj = build_objective("cpdae", load_mlm_model(tiny_bert_dir), tok, cfg, bias_prior=prior)
    assert torch.equal(obj.decoder.decoder.bias.detach(), prior)
    for bad in (torch.zeros(5), torch.full((tok.vocab_size,), float("inf"))):
        with pytest.raises(ValueError, match="bias_prior"):
            build_objective("cpdae", load_mlm_model(tiny_bert_dir), tok, cfg, bias_prior=bad)
