"""The CPDAE decoder is a Hugging Face model: ``CPDAEDecoderConfig`` + ``CPDAEDecoder`` with
``save_pretrained`` / ``from_pretrained``, transformers' ``BertPredictionHeadTransform`` inside, and the run
layout written before it (``decoder/decoder.safetensors`` + ``decoder_config.json``) still loads."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from pretrain.model.modeling import CPDAEDecoder, CPDAEDecoderConfig, decoder_layout

H, V = 16, 40


def _random_decoder(seed: int = 0) -> CPDAEDecoder:
    """A decoder whose every parameter (LayerNorm included) is random, so that no term of the equation is trivial."""
    torch.manual_seed(seed)
    dec = CPDAEDecoder(CPDAEDecoderConfig(hidden_size=H, vocab_size=V, layer_norm_eps=1e-6)).eval()
    with torch.no_grad():
        for p in dec.parameters():
            p.normal_(0.0, 0.5)
    return dec


def _naive_logits(h: torch.Tensor, W_d, b_d, gamma, beta, W_o, b_o, eps: float) -> torch.Tensor:
    """The paper's decoder (Ma et al., CIKM 2022, Sec. 3.2) written out in float64, row by row:
    ``z = W_o · LN(GELU(W_d h + b_d)) + b_o`` with the exact (erf) GELU and LayerNorm over the hidden units."""
    h, W_d, b_d, gamma, beta, W_o, b_o = (t.detach().double() for t in (h, W_d, b_d, gamma, beta, W_o, b_o))
    rows = []
    for x in h:
        a = [sum(W_d[i, j] * x[j] for j in range(len(x))) + b_d[i] for i in range(len(b_d))]
        g = [0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))) for v in a]
        mu = sum(g) / len(g)
        var = sum((v - mu) ** 2 for v in g) / len(g)  # biased variance, as LayerNorm
        n = torch.tensor([(v - mu) / math.sqrt(var + eps) for v in g], dtype=torch.float64) * gamma + beta
        rows.append(W_o @ n + b_o)
    return torch.stack(rows)


def _legacy_files(dec: CPDAEDecoder, ddir, objective: str = "cpdae") -> None:
    """Write ``dec`` exactly as ``Objective.save_pretrained`` did before the decoder became a Hugging Face model:
    top-level ``dense``/``LayerNorm``/``decoder`` parameters under the module name ``decoder.``."""
    from safetensors.torch import save_file

    t = dec.transform
    old = {"dense.weight": t.dense.weight, "dense.bias": t.dense.bias, "LayerNorm.weight": t.LayerNorm.weight,
           "LayerNorm.bias": t.LayerNorm.bias, "decoder.weight": dec.decoder.weight, "decoder.bias": dec.decoder.bias}
    ddir.mkdir(parents=True, exist_ok=True)
    save_file({f"decoder.{k}": v.detach().contiguous() for k, v in old.items()}, str(ddir / "decoder.safetensors"))
    (ddir / "decoder_config.json").write_text(json.dumps({
        "objective": objective, "hidden_size": dec.config.hidden_size, "vocab_size": dec.config.vocab_size,
        "representation": "cls",
        "decoder_class": "CPDAEDecoder", "layer_norm_eps": dec.config.layer_norm_eps, "hidden_act": "gelu",
        "initializer_range": 0.02, "cl_distribution": "sigmoid", "rec_reduction": "sum", "decoder_init": "random"}))


def test_forward_is_the_papers_equation():
    dec = _random_decoder()
    x = torch.randn(3, H)
    t = dec.transform
    ref = _naive_logits(x, t.dense.weight, t.dense.bias, t.LayerNorm.weight, t.LayerNorm.bias,
                        dec.decoder.weight, dec.decoder.bias, eps=1e-6)
    with torch.no_grad():
        got = dec(x)
    assert got.shape == (3, V)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_reuses_transformers_bert_head_transform():
    from transformers.models.bert.modeling_bert import BertPredictionHeadTransform
    dec = _random_decoder()
    assert type(dec.transform) is BertPredictionHeadTransform
    assert [n for n, _ in dec.named_parameters()] == [
        "transform.dense.weight", "transform.dense.bias", "transform.LayerNorm.weight", "transform.LayerNorm.bias",
        "decoder.weight", "decoder.bias"]


def test_bert_initialisation():
    torch.manual_seed(0)
    dec = CPDAEDecoder(CPDAEDecoderConfig(hidden_size=64, vocab_size=500, initializer_range=0.05)).requires_grad_(False)
    assert float(dec.decoder.weight.std()) == pytest.approx(0.05, rel=0.05)
    assert float(dec.transform.dense.weight.std()) == pytest.approx(0.05, rel=0.1)
    for b in (dec.decoder.bias, dec.transform.dense.bias, dec.transform.LayerNorm.bias):
        assert float(b.abs().max()) == 0.0
    assert torch.equal(dec.transform.LayerNorm.weight, torch.ones(64))


def test_save_pretrained_round_trip_gives_identical_logits(tmp_path):
    from transformers import AutoConfig, AutoModel

    dec = _random_decoder(1)
    dec.save_pretrained(tmp_path / "d")
    assert decoder_layout(tmp_path / "d") == "hf"
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["model_type"] == "cpdae_decoder" and (cfg["hidden_size"], cfg["vocab_size"]) == (H, V)
    assert cfg["layer_norm_eps"] == 1e-6 and cfg["hidden_act"] == "gelu"
    x = torch.randn(5, H)
    with torch.no_grad():
        ref = dec(x)
        for loaded in (CPDAEDecoder.from_pretrained(tmp_path / "d"), AutoModel.from_pretrained(str(tmp_path / "d"))):
            assert type(loaded) is CPDAEDecoder and not loaded.training
            assert torch.equal(loaded(x), ref)
    assert isinstance(AutoConfig.from_pretrained(str(tmp_path / "d")), CPDAEDecoderConfig)


def test_old_format_decoder_dir_loads(tmp_path, caplog):
    """A run saved before this change (decoder/decoder.safetensors + decoder_config.json) loads from the run directory
    and from its decoder/ directory, and its logits are the paper's equation on the saved weights."""
    import logging

    dec = _random_decoder(2)
    run = tmp_path / "run"
    _legacy_files(dec, run / "decoder")
    assert decoder_layout(run / "decoder") == "legacy" and decoder_layout(run) is None
    x = torch.randn(4, H)
    t = dec.transform
    ref = _naive_logits(x, t.dense.weight, t.dense.bias, t.LayerNorm.weight, t.LayerNorm.bias,
                        dec.decoder.weight, dec.decoder.bias, eps=1e-6)
    with caplog.at_level(logging.INFO, logger="pretrain.model.modeling"):
        for path in (run, run / "decoder", str(run)):
            old = CPDAEDecoder.from_pretrained(path)
            with torch.no_grad():
                torch.testing.assert_close(old(x).double(), ref, rtol=1e-5, atol=1e-5)
    assert "save_pretrained" in caplog.text  # says how to convert it
    # converted: the Hugging Face layout written next to it wins
    old.save_pretrained(run / "decoder")
    assert decoder_layout(run / "decoder") == "hf"
    with torch.no_grad():
        assert torch.equal(CPDAEDecoder.from_pretrained(run)(x), old(x))


def test_old_parameter_names_load_into_a_nested_decoder():
    """Old training checkpoints and ``--decoder-from`` hand the objective's state dict with the old names."""
    dec = _random_decoder(3)
    t = dec.transform
    old = {"decoder.dense.weight": t.dense.weight, "decoder.dense.bias": t.dense.bias,
           "decoder.LayerNorm.weight": t.LayerNorm.weight, "decoder.LayerNorm.bias": t.LayerNorm.bias,
           "decoder.decoder.weight": dec.decoder.weight, "decoder.decoder.bias": dec.decoder.bias}
    holder = torch.nn.Module()
    holder.decoder = CPDAEDecoder(dec.config)
    holder.load_state_dict({k: v.detach().clone() for k, v in old.items()}, strict=True)
    for (k1, a), (k2, b) in zip(holder.decoder.state_dict().items(), dec.state_dict().items()):
        assert k1 == k2 and torch.equal(a, b)


def test_missing_or_broken_decoder_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty/config\.json .*cpdae_decoder"):
        CPDAEDecoder.from_pretrained(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="not found"):
        CPDAEDecoder.from_pretrained(tmp_path / "nope")
    # an old-layout directory holding another objective's modules
    dec = _random_decoder()
    _legacy_files(dec, tmp_path / "seed")
    from safetensors.torch import save_file
    save_file({"seed_decoder.w": torch.zeros(2)}, str(tmp_path / "seed" / "decoder.safetensors"))
    with pytest.raises(ValueError, match=r"decoder\.safetensors has no tensors under the prefix 'decoder\.'"):
        CPDAEDecoder.from_pretrained(tmp_path / "seed")


# --------------------------------------------------------------------------- a real objective's export
@pytest.fixture(scope="module")
def cpdae_run(tiny_bert_dir, tmp_path_factory):
    """A CPDAE objective (MLM-head-initialised decoder, random bias) exported with ``Objective.save_pretrained``."""
    from transformers import AutoTokenizer

    from pretrain.objectives import objective_config
    from pretrain.model.modeling import load_mlm_model
    from pretrain.objectives import build_objective

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    cfg = objective_config("cpdae", model=tiny_bert_dir, batch_size=4, decoder_init="mlm_head",
                         decoder_bias_init="zero")
    obj = build_objective("cpdae", load_mlm_model(tiny_bert_dir), tok, cfg).eval()
    with torch.no_grad():
        obj.decoder.decoder.bias.normal_()
    out = tmp_path_factory.mktemp("cpdae-run")
    obj.save_pretrained(str(out))
    return out, obj


def test_run_decoder_directory_is_a_hugging_face_model(cpdae_run):
    from transformers import AutoModel

    out, obj = cpdae_run
    files = sorted(p.name for p in (out / "decoder").iterdir())
    assert files == ["config.json", "decoder_config.json", "model.safetensors"]
    saved = json.loads((out / "decoder" / "decoder_config.json").read_text())
    assert saved["objective"] == "cpdae" and saved["decoder_modules"] == ["decoder"]
    x = torch.randn(3, obj.mlm_model.config.hidden_size)
    with torch.no_grad():
        ref = obj.decoder(x)
        assert torch.equal(AutoModel.from_pretrained(str(out / "decoder"))(x), ref)
        assert torch.equal(CPDAEDecoder.from_pretrained(out)(x), ref)


def test_decoder_from_reads_old_and_new_runs(cpdae_run, tiny_bert_dir, tmp_path):
    """``--decoder-from`` (Objective.load_decoder) continues the decoder of a new-layout run and of an old one."""
    from transformers import AutoTokenizer

    from pretrain.objectives import objective_config
    from pretrain.model.modeling import load_mlm_model
    from pretrain.objectives import build_objective

    out, obj = cpdae_run
    old_run = tmp_path / "old"
    _legacy_files(obj.decoder, old_run / "decoder")
    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    for run in (out, old_run):
        cfg = objective_config("cpdae", model=tiny_bert_dir, batch_size=4, decoder_bias_init="zero")
        fresh = build_objective("cpdae", load_mlm_model(tiny_bert_dir), tok, cfg)
        assert not torch.equal(fresh.decoder.decoder.bias, obj.decoder.decoder.bias)
        fresh.load_decoder(str(run))
        for (k1, a), (k2, b) in zip(fresh.decoder.state_dict().items(), obj.decoder.state_dict().items()):
            assert k1 == k2 and torch.equal(a, b), k1


def test_inspect_and_coverage_load_an_old_run(cpdae_run, tmp_path):
    """The loaders of ``python -m pretrain inspect`` and ``coverage`` read a run saved before this change."""
    from pretrain.analysis.coverage import _project, load_for_coverage
    from pretrain.analysis.inspect_decoder import DecoderInspector, decoder_dir

    out, obj = cpdae_run
    old_run = tmp_path / "old"
    shutil.copytree(out, old_run, ignore=shutil.ignore_patterns("decoder"))
    _legacy_files(obj.decoder, old_run / "decoder")
    assert decoder_dir(old_run) == str(old_run / "decoder")
    insp = DecoderInspector.from_pretrained(old_run, device="cpu")
    mlm, _, projection = load_for_coverage(str(old_run), "decoder")
    x = torch.randn(2, obj.mlm_model.config.hidden_size)
    with torch.no_grad():
        ref = obj.decoder(x)
        assert torch.equal(insp.decoder(x), ref)
        assert projection == "decoder" and torch.equal(_project(mlm, x, "decoder"), ref)


def test_decoder_from_refuses_a_cpdae_decoder_in_another_objective(cpdae_run, tiny_bert_dir):
    """The Hugging Face layout does not name the module in its keys: decoder_config.json does, so that a CPDAE
    decoder is still refused where SEED's is needed (and not loaded into it by shape accident)."""
    from tests.helpers.objectives import load_tiny
    from pretrain.objectives import build_objective

    out, _ = cpdae_run
    model, tok, cfg = load_tiny(tiny_bert_dir, objective="seed", batch_size=2)
    seed = build_objective("seed", model, tok, cfg)
    with pytest.raises(ValueError, match=r"decoder modules \['decoder'\] of objective 'cpdae'; objective 'seed' needs"):
        seed.load_decoder(str(out))
