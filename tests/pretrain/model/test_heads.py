"""Every saved head is a Hugging Face model part: SEED's decoder, RetroMAE's enhanced-decoding
layers and PROP's score head are written as an ``ObjectiveHead`` (``config.json`` + ``model.safetensors``) that
``transformers.AutoModel.from_pretrained`` loads after ``import pretrain`` (no ``trust_remote_code``), and the
decoder directories written before (``decoder.safetensors``; tests/fixtures/legacy_decoders, made by commit d8ee866's
code with tests/fixtures/make_legacy_decoders.py) still continue with ``--decoder-from``."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from tests.helpers.warm_python import warm_python

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "legacy_decoders"
OPTIONS = {"seed": {"seed_decoder_layers": 2}, "retromae": {"retromae_decoder_layers": 2}, "prop": {}}


def _objective(tiny_bert_dir: str, name: str):
    from tests.helpers.objectives import load_tiny
    from pretrain.objectives import build_objective

    model, tok, cfg = load_tiny(tiny_bert_dir, objective=name, batch_size=2, **OPTIONS[name])
    extra = {"collection_prob": torch.full((model.config.vocab_size,), 1.0 / model.config.vocab_size), "mu": 10.0,
             "token_frequency": torch.ones(model.config.vocab_size)} if name == "prop" else {}
    return build_objective(name, model, tok, cfg, **extra)


def _decoder_state(obj) -> dict[str, torch.Tensor]:
    return {f"{k}.{n}": t.detach().clone() for k, m in obj.decoder_modules().items() for n, t in m.state_dict().items()}


@pytest.mark.parametrize("name", ["seed", "retromae", "prop"])
def test_head_is_saved_as_a_hugging_face_model(tiny_bert_dir, tmp_path, name):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModel, PreTrainedModel

    from pretrain.model.heads import ObjectiveHead, ObjectiveHeadConfig

    obj = _objective(tiny_bert_dir, name)
    with torch.no_grad():  # not the constructor's initialisation: a reload cannot pass by re-initialising
        for p in obj.decoder_modules()[next(iter(obj.decoder_modules()))].parameters():
            p.add_(torch.randn_like(p))
    ref = _decoder_state(obj)
    obj.save_pretrained(str(tmp_path))
    ddir = tmp_path / "decoder"
    assert sorted(os.listdir(ddir)) == ["config.json", "decoder_config.json", "model.safetensors"]
    cfg = json.loads((ddir / "config.json").read_text())
    assert cfg["model_type"] == "pretrain_objective_head" and cfg["objective"] == name
    assert sorted(cfg["head_modules"]) == sorted(obj.decoder_modules())
    # the weights file holds exactly the objective's decoder state under its module names (as decoder.safetensors did)
    saved = load_file(str(ddir / "model.safetensors"))
    assert sorted(saved) == sorted(ref) and all(torch.equal(saved[k], ref[k]) for k in ref)
    head = AutoModel.from_pretrained(str(ddir))
    assert isinstance(head, PreTrainedModel) and type(head) is ObjectiveHead
    assert isinstance(AutoConfig.from_pretrained(str(ddir)), ObjectiveHeadConfig)
    got = head.state_dict()
    assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    # --decoder-from reads it back into a fresh objective
    fresh = _objective(tiny_bert_dir, name)
    fresh.load_decoder(str(tmp_path))
    got = _decoder_state(fresh)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_seed_head_runs_as_the_objective_decoder(tiny_bert_dir, tmp_path):
    """The reloaded SEED decoder module computes what the trained one does (same class, same arguments)."""
    from transformers import AutoModel

    obj = _objective(tiny_bert_dir, "seed").eval()
    obj.save_pretrained(str(tmp_path))
    head = AutoModel.from_pretrained(str(tmp_path / "decoder")).eval()
    x, am = torch.randn(2, 7, 32), torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    with torch.no_grad():
        assert torch.equal(head.seed_decoder(x, am), obj.decoder(x, am))
    assert head.seed_decoder.window == obj.decoder.window and head.seed_decoder.span == obj.decoder.span


@pytest.mark.parametrize("name", ["seed", "retromae", "prop"])
def test_legacy_decoder_written_by_the_old_code_still_loads(tiny_bert_dir, tmp_path, name):
    """A ``decoder.safetensors`` run directory made by the code before this change continues with ``--decoder-from``,
    and exporting it again writes the Hugging Face layout with the same tensors."""
    from safetensors.torch import load_file
    from transformers import AutoModel

    legacy = FIXTURES / name
    assert sorted(os.listdir(legacy / "decoder")) == ["decoder.safetensors", "decoder_config.json"]
    ref = load_file(str(legacy / "decoder" / "decoder.safetensors"))
    obj = _objective(tiny_bert_dir, name)
    assert not all(torch.equal(_decoder_state(obj)[k], ref[k]) for k in ref)
    obj.load_decoder(str(legacy))
    got = _decoder_state(obj)
    assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    obj.save_pretrained(str(tmp_path))
    head = AutoModel.from_pretrained(str(tmp_path / "decoder"))
    assert all(torch.equal(head.state_dict()[k], ref[k]) for k in ref)


def test_unknown_head_module_type_is_named():
    from pretrain.model.heads import ObjectiveHead, ObjectiveHeadConfig

    with pytest.raises(ValueError, match=r"unknown head module type 'nope'.*import the objective plugin"):
        ObjectiveHead(ObjectiveHeadConfig(objective="x", head_modules={"m": {"type": "nope", "args": {}}}))


def test_import_pretrain_registers_the_auto_classes(tiny_bert_dir, tmp_path):
    """In a fresh process, ``import pretrain`` alone (not pretrain.model.modeling) makes AutoModel read both decoder types."""
    from pretrain.model.modeling import CPDAEDecoder, CPDAEDecoderConfig

    CPDAEDecoder(CPDAEDecoderConfig(hidden_size=8, vocab_size=11)).save_pretrained(tmp_path / "cpdae")
    _objective(tiny_bert_dir, "prop").save_pretrained(str(tmp_path / "prop"))
    code = ("import sys, transformers, pretrain\n"
            "for d in sys.argv[1:]:\n"
            "    m = transformers.AutoModel.from_pretrained(d)\n"
            "    assert isinstance(m, transformers.PreTrainedModel)\n"
            "    print(type(m).__name__)\n")
    out = subprocess.run([warm_python(), "-c", code, str(tmp_path / "cpdae"), str(tmp_path / "prop" / "decoder")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["CPDAEDecoder", "ObjectiveHead"]
