"""The last layer at [CLS] only (``pyterrier_cpdae.encoder.first_token``, ``CPDAE(cls_last_layer=...)``).

Reference: the full model's last hidden state at position 0, computed by transformers' own BERT on the same
padded batch (and, through CPDAE, the one-text-at-a-time vectors of tests/pyterrier_cpdae/encoder/test_cpdae.py's naive encoder).
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer, DistilBertConfig, DistilBertModel

from pyterrier_cpdae.encoder import CPDAE
from pyterrier_cpdae.encoder import first_token as ft

TEXTS = ["a", "dense retrieval with a bag of words decoder", "the [CLS] vector of the last layer",
         "contrastive pre-training " * 12, "query", "one two three four five six seven eight nine ten"]


class _Positions:
    """Records the sequence length the last layer's feed-forward block runs on."""

    def __init__(self, layer: torch.nn.Module):
        self.lengths: list[int] = []
        self.handle = layer.intermediate.register_forward_pre_hook(lambda m, args: self.lengths.append(args[0].shape[1]))


def _naive_cls(model, tok, texts):
    """Each text alone, unpadded, the full model: its [CLS] vector."""
    with torch.no_grad():
        return np.stack([model(**tok(t, return_tensors="pt"))[0][0, 0].numpy() for t in texts])


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_trimmed_model_gives_the_full_models_cls_vectors(tiny_bert_dir, attention):
    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    model = AutoModel.from_pretrained(tiny_bert_dir, attn_implementation=attention).eval()
    layers = list(model.encoder.layer)
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    view = ft.first_token_model(model)
    seen = _Positions(layers[-1])
    with torch.no_grad():
        full = model(**batch)[0]
        trimmed = view(**batch)[0]
    assert trimmed.shape == (len(TEXTS), 1, full.shape[-1])
    assert seen.lengths == [full.shape[1], 1]  # the full model's last layer on every position, the view's on one
    np.testing.assert_allclose(trimmed[:, 0].numpy(), full[:, 0].numpy(), atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(trimmed[:, 0].numpy(), _naive_cls(model, tok, TEXTS), atol=1e-5, rtol=1e-4)
    # the model itself is unchanged: the same layers, the full output
    assert list(model.encoder.layer) == layers and all(type(x).__name__ == "BertLayer" for x in layers)
    with torch.no_grad():
        assert model(**batch)[0].shape == full.shape
    assert ft.first_token_problem(model) is None


def test_cpdae_trims_under_cls_pooling_only(tiny_bert_dir):
    vectors, lengths = {}, {}
    for name, kwargs in [("auto", {}), ("full", {"cls_last_layer": False}), ("forced", {"cls_last_layer": True}),
                         ("mean", {"pooling": "mean"})]:
        enc = CPDAE.from_pretrained(tiny_bert_dir, device="cpu", backend="torch", batch_size=4,
                                    **{"pooling": "cls", **kwargs})
        enc.encode_docs(["warm-up"])  # the once-per-model check runs the full layer on a small batch
        seen = _Positions(enc.model.encoder.layer[-1])
        vectors[name] = enc.encode_docs(TEXTS)
        lengths[name] = set(seen.lengths)
    assert lengths["auto"] == lengths["forced"] == {1}
    assert min(lengths["full"]) > 1 and min(lengths["mean"]) > 1
    np.testing.assert_allclose(vectors["auto"], vectors["full"], atol=1e-6, rtol=1e-5)
    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    np.testing.assert_allclose(vectors["auto"], _naive_cls(AutoModel.from_pretrained(tiny_bert_dir).eval(), tok, TEXTS),
                               atol=1e-5, rtol=1e-4)


def test_openvino_graph_of_the_trimmed_model(tiny_bert_dir):
    pytest.importorskip("openvino")
    trimmed = CPDAE.from_pretrained(tiny_bert_dir, device="cpu", backend="openvino", pooling="cls", batch_size=4)
    full = CPDAE.from_pretrained(tiny_bert_dir, device="cpu", backend="torch", pooling="cls", batch_size=4,
                                 cls_last_layer=False)
    np.testing.assert_allclose(trimmed.encode_docs(TEXTS), full.encode_docs(TEXTS), atol=1e-5, rtol=1e-4)
    assert trimmed._openvino is not None
    assert [p.get_partial_shape().to_string() for p in trimmed._openvino.compiled.outputs] == ["[?,32]"]


def test_refusals_and_fallbacks(tiny_bert_dir, monkeypatch, caplog):
    with pytest.raises(ValueError, match="cls_last_layer=True needs pooling='cls'"):
        CPDAE.from_pretrained(tiny_bert_dir, pooling="mean", cls_last_layer=True)
    with pytest.raises(ValueError, match="cls_last_layer must be True, False or None"):
        CPDAE.from_pretrained(tiny_bert_dir, cls_last_layer="yes")
    # a model without BERT's encoder.layer list: automatic keeps the full model, True names why it cannot
    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    torch.manual_seed(0)
    distil = DistilBertModel(DistilBertConfig(vocab_size=tok.vocab_size, dim=32, n_layers=1, n_heads=2,
                                              hidden_dim=64, max_position_embeddings=128)).eval()
    assert "no encoder.layer list" in ft.first_token_problem(distil)
    auto = CPDAE(distil, tok, pooling="cls", backend="torch").encode_docs(TEXTS)
    np.testing.assert_allclose(auto, _naive_cls(distil, tok, TEXTS), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="no encoder.layer list"):
        CPDAE(distil, tok, pooling="cls", backend="torch", cls_last_layer=True).encode_docs(TEXTS)
    # an attention implementation whose mask has no query axis to cut: not trimmed
    model = AutoModel.from_pretrained(tiny_bert_dir).eval()
    monkeypatch.setattr(model.encoder.layer[-1].attention.self.config, "_attn_implementation", "flash_attention_2")
    assert "flash_attention_2" in ft.first_token_problem(model)
    monkeypatch.undo()
    # a trimmed layer that does not reproduce the full one (here: broken on purpose) is caught by the check
    monkeypatch.setattr(ft.FirstTokenLayer, "forward", lambda self, h, *a, **k: torch.zeros_like(h[:, :1]))
    enc = CPDAE.from_pretrained(tiny_bert_dir, device="cpu", backend="torch", pooling="cls")
    with caplog.at_level(logging.WARNING):
        got = enc.encode_docs(TEXTS)
    assert "does not reproduce" in caplog.text
    np.testing.assert_allclose(got, _naive_cls(enc.model, enc.tokenizer, TEXTS), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="did not reproduce"):
        CPDAE.from_pretrained(tiny_bert_dir, device="cpu", backend="torch", cls_last_layer=True).encode_docs(TEXTS)


def test_packed_rows_trim_the_last_layer_too(tiny_bert_dir, monkeypatch):
    """Packed (unpadded) batches with the varlen kernel (here its text-by-text CPU reference): the last layer takes
    each text's first token as its one query against that text's keys; vectors equal the padded full layer's, and
    a kernel that cannot take query segments of length 1 keeps the full layer."""
    from pyterrier_cpdae.encoder.backends import unpadded as unpadded_mod
    from pyterrier_cpdae.encoder import attention

    texts = TEXTS * 3
    full = CPDAE.from_pretrained(tiny_bert_dir, device="cpu", backend="torch", pooling="cls", batch_size=4,
                                 unpad=False, cls_last_layer=False)
    reference = full.encode_docs(texts)
    monkeypatch.setattr(unpadded_mod, "varlen_kernel", lambda device, dtype: attention.reference_kernel)
    packed = CPDAE(full.model, full.tokenizer, pooling="cls", batch_size=4, backend="torch", unpad=True)
    packed.encode_docs(["warm-up"])  # the once-per-model check
    seen = _Positions(full.model.encoder.layer[-1])
    rows = []
    handle = full.model.register_forward_pre_hook(lambda m, a, kw: rows.append(tuple(kw["input_ids"].shape)),
                                                  with_kwargs=True)
    got = packed.encode_docs(texts)
    assert rows and all(r == 1 for r, _ in rows)  # packed rows
    assert seen.lengths == [1] * len(rows)  # the last layer's feed-forward block on one position per text
    np.testing.assert_allclose(got, reference, atol=2e-5, rtol=1e-4)
    # a kernel that only takes equal query and key segments (as the reference kernel did before): the full layer
    def equal_segments_only(q, k, v, cu_q, cu_k, max_q, max_k, scale=None):
        if not torch.equal(cu_q, cu_k):
            raise RuntimeError("query and key segments differ")
        return attention.reference_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale)

    monkeypatch.setattr(unpadded_mod, "varlen_kernel", lambda device, dtype: equal_segments_only)
    seen.lengths.clear()
    np.testing.assert_allclose(packed.encode_docs(texts), reference, atol=2e-5, rtol=1e-4)
    assert min(seen.lengths) > 1
    handle.remove()


def test_trimmed_layer_keeps_attention_dropout_in_training(tiny_bert_dir):
    """In training the trimmed last layer drops attention probabilities as the full layer does (and not in eval):
    with dropout only in the last layer's attention, two training passes differ and two eval passes do not."""
    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    model = AutoModel.from_pretrained(tiny_bert_dir)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    model.encoder.layer[-1].attention.self.dropout.p = 0.5
    view = ft.first_token_model(model)
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    model.train()
    with torch.no_grad():
        a, b = view(**batch)[0], view(**batch)[0]
    assert not torch.allclose(a, b)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(view(**batch)[0], view(**batch)[0])
