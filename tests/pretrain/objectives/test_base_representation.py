"""The default representation is the base's own pipeline (a sentence-transformers base pooling by mean keeps mean +
Normalize), a run that changes it says so in its log, the export's max_seq_length is one rule whatever the pooling,
and the export's root loads in sentence-transformers without a load report (the MLM head lies in mlm_head/)."""
from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from pretrain.objectives import build_objective, objective_config
from pretrain.objectives.base import export_lengths, resolve_representation


def test_resolve_representation_against_the_base(minilm_path, tiny_bert_dir):
    # reference: all-MiniLM-L6-v2 declares Transformer -> Pooling (mean) -> Normalize, max_seq_length 256
    with open(os.path.join(minilm_path, "modules.json")) as f:
        assert [m["type"].rsplit(".", 1)[-1] for m in json.load(f)] == ["Transformer", "Pooling", "Normalize"]
    pooling, note = resolve_representation("auto", minilm_path)
    assert pooling == "mean" and "mean pooling + Normalize" in note
    pooling, note = resolve_representation("cls", minilm_path)
    assert pooling == "cls" and "replaces the base's mean pooling + Normalize" in note
    assert resolve_representation("mean", minilm_path) == ("mean", None)
    assert resolve_representation("auto", tiny_bert_dir) == ("cls", None)  # no pipeline: the papers' [CLS]
    assert resolve_representation("auto", None) == ("cls", None)
    with pytest.raises(ValueError, match="--representation must be auto, cls or mean"):
        resolve_representation("max", minilm_path)
    # one length rule, whatever the pooling: the base's declared max_seq_length, else the run's max_length
    assert export_lengths(minilm_path, 64) == (256, False)
    assert export_lengths(tiny_bert_dir, 64) == (64, False)


@pytest.mark.parametrize("option", ["auto", "cls"])
def test_minilm_continuation_keeps_its_pipeline_unless_asked_and_its_export_loads_quietly(
        option, minilm_path, tmp_path, caplog, capfd):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    from pretrain.model.modeling import load_mlm_model

    with caplog.at_level(logging.INFO):
        model = load_mlm_model(minilm_path)  # no MLM head: a new one, without --new-mlm-head
        tok = AutoTokenizer.from_pretrained(minilm_path)
        cfg = objective_config("cpdae", model=minilm_path, max_length=64, batch_size=4, decoder_bias_init="zero",
                               representation=option)
        obj = build_objective("cpdae", model, tok, cfg)
    messages = [r.getMessage() for r in caplog.records]
    assert any("has no MLM head: a new one is initialised" in m for m in messages)
    expected = "mean" if option == "auto" else "cls"
    assert obj.representation == expected
    said = [m for m in messages if "--representation" in m]
    assert len(said) == 1 and ("mean pooling + Normalize" in said[0])
    assert ("replaces" in said[0]) == (option == "cls")
    # the objective reads the vector it says: the masked mean of the last layer under auto
    ids = torch.tensor([[101, 2054, 2003, 102, 0]])
    am = torch.tensor([[1, 1, 1, 1, 0]])
    with torch.no_grad():
        h = obj.encoder(input_ids=ids, attention_mask=am).last_hidden_state
        v = obj.text_vectors(h, am)
    ref = h[:, :4].mean(1) if expected == "mean" else h[:, 0]
    assert torch.allclose(v, ref, atol=1e-6)
    out = tmp_path / option
    obj.save_pretrained(str(out))
    with open(out / "modules.json") as f:
        modules = [m["type"].rsplit(".", 1)[-1] for m in json.load(f)]
    assert modules == (["Transformer", "Pooling", "Normalize"] if option == "auto" else ["Transformer", "Pooling"])
    with open(out / "sentence_bert_config.json") as f:
        assert json.load(f)["max_seq_length"] == 256  # the base's, with either pooling
    assert (out / "mlm_head" / "model.safetensors").is_file() and (out / "decoder" / "config.json").is_file()
    capfd.readouterr()
    st = SentenceTransformer(str(out), device="cpu")
    printed = "".join(capfd.readouterr())
    assert "UNEXPECTED" not in printed and "cls.predictions" not in printed and "MISSING" not in printed
    with torch.no_grad():
        e = st.encode(["what is dense retrieval"], convert_to_tensor=True)
    assert abs(float(e.norm()) - 1.0) < 1e-5 if option == "auto" else e.shape == (1, 384)


def test_a_cls_objective_refuses_another_representation(tiny_bert_dir):
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    model = AutoModelForMaskedLM.from_pretrained(tiny_bert_dir)
    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    with pytest.raises(ValueError, match="objective 'simcse' trains the cls vector: --representation mean does not apply"):
        build_objective("simcse", model, tok, objective_config("simcse", model=tiny_bert_dir, representation="mean"))
