"""Decoder inspection (pretrain.analysis.inspect_decoder): top-k tokens, per-word probabilities, HTML, CLI."""
from __future__ import annotations

import html
import json
import math
import re
import shutil

import pytest
import torch
from torch import nn



class FixedLogits(nn.Module):
    """A 'decoder' that ignores its input and returns the same logits for every text."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = nn.Parameter(logits, requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(hidden.shape[0], -1)


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


HAND_TEXT = "Unbelievably, cats & dogs <run>. Cats again"
# un ##bel ##ie ##va ##bly , cats & dogs < run > . cats again
HAND_PROBS = {"un": 0.2, "##bel": 0.1, "##ie": 0.05, "##va": 0.05, "##bly": 0.1, "cats": 0.9, "dogs": 0.3, "<": 0.6}


@pytest.fixture(scope="module")
def hand_inspector(tok, tiny_bert_dir):
    from transformers import AutoModel

    from pretrain.analysis.inspect_decoder import DecoderInspector

    logits = torch.full((len(tok),), -30.0)
    for t, p in HAND_PROBS.items():
        logits[tok.convert_tokens_to_ids(t)] = _logit(p)
    return DecoderInspector(AutoModel.from_pretrained(tiny_bert_dir), tok, FixedLogits(logits), device="cpu")


def test_word_scores_sum_subwords(hand_inspector):
    words = hand_inspector.word_scores(HAND_TEXT)
    assert [w.word for w in words] == ["Unbelievably", ",", "cats", "&", "dogs", "<", "run", ">", ".", "Cats", "again"]
    got = {(w.word, w.start): w.prob for w in words}
    assert got[("Unbelievably", 0)] == pytest.approx(0.2 + 0.1 + 0.05 + 0.05 + 0.1, abs=1e-6)
    assert words[0].tokens == ("un", "##bel", "##ie", "##va", "##bly")
    assert got[("cats", 14)] == pytest.approx(0.9) and got[("Cats", 33)] == pytest.approx(0.9)
    assert got[("<", 26)] == pytest.approx(0.6) and got[("run", 27)] == pytest.approx(0.0, abs=1e-9)
    assert all(HAND_TEXT[w.start:w.end] == w.word for w in words)


def test_top_words_hand(hand_inspector):
    top = hand_inspector.top_words(HAND_TEXT, k=3)
    assert [t for t, _ in top] == ["cats", "<", "dogs"]
    assert [p for _, p in top] == pytest.approx([0.9, 0.6, 0.3])
    with pytest.raises(ValueError):
        hand_inspector.top_words(HAND_TEXT, k=0)


def test_render_html_every_word_once_and_escaped(hand_inspector, tmp_path):
    out = tmp_path / "sub" / "page.html"
    page = hand_inspector.render_html([HAND_TEXT, "plain <b>bold</b> & more"], out, top_k=5)
    assert out.read_text(encoding="utf-8") == page
    section = page.split("<section>")[1]
    text_html = re.search(r'<p class="text">(.*?)</p>', section).group(1)
    spans = re.findall(r'<span class="w" style="background-color: rgba\(220, 40, 40, ([0-9.]+)\)" '
                       r'title="p=([0-9.]+) \([^"]*\)">(.*?)</span>', text_html)
    assert [html.unescape(w) for _, _, w in spans] == [w.word for w in hand_inspector.word_scores(HAND_TEXT)]
    # the visible text (tags stripped, entities decoded) is the original text, each word exactly once
    assert html.unescape(re.sub(r"<[^>]+>", "", text_html)) == HAND_TEXT
    assert float(spans[0][1]) == pytest.approx(0.5, abs=1e-4) and float(spans[0][0]) == pytest.approx(0.5, abs=1e-3)
    assert float(spans[2][0]) == pytest.approx(0.9, abs=1e-3)
    # raw markup of the input never reaches the page unescaped
    assert "<b>bold</b>" not in page and "&lt;b&gt;bold&lt;/b&gt;" not in page  # split into words, each escaped
    assert "&lt;" in text_html and "&amp;" in text_html


# ----------------------------------------------------------------------------- a saved model

def test_missing_decoder_error(tiny_bert_dir, tmp_path):
    from pretrain.analysis.inspect_decoder import DecoderInspector, main, top_words

    with pytest.raises(FileNotFoundError, match=r"no CPDAE decoder in .*decoder .*; was it pre-trained with --objective cpdae"):
        top_words(tiny_bert_dir, "some text")
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        DecoderInspector.from_pretrained(tmp_path / "nope")
    other = tmp_path / "seedmodel"
    shutil.copytree(tiny_bert_dir, other)
    (other / "decoder").mkdir()
    (other / "decoder" / "decoder.safetensors").write_bytes(b"")
    (other / "decoder" / "decoder_config.json").write_text(json.dumps({"objective": "seed"}))
    with pytest.raises(ValueError, match="trained with --objective seed"):
        main(["--model", str(other), "--text", "x"])
    with pytest.raises(ValueError, match="nothing to inspect"):
        main(["--model", str(other)])


@pytest.fixture(scope="module")
def cpdae_dir(tiny_bert_dir, tmp_path_factory):
    """A tiny random encoder + CPDAEDecoder saved in the trainer's layout (``Objective.save_pretrained``)."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from pretrain.objectives import objective_config
    from pretrain.model.modeling import CPDAEDecoder, CPDAEDecoderConfig
    from pretrain.objectives.base import Objective

    class Saved(Objective):
        name = "cpdae"

        def __init__(self, mlm, tok, config):
            super().__init__(mlm, tok, config)
            self.decoder = CPDAEDecoder(CPDAEDecoderConfig(hidden_size=mlm.config.hidden_size,
                                                           vocab_size=mlm.config.vocab_size))

        def decoder_modules(self):
            return {"decoder": self.decoder}

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    objective = Saved(AutoModelForMaskedLM.from_pretrained(tiny_bert_dir), tok, objective_config("cpdae", model=tiny_bert_dir))
    with torch.no_grad():  # spread the decoder's outputs so that the top-k is well separated
        objective.decoder.decoder.weight.normal_(0, 1.0)
        objective.decoder.decoder.bias.normal_(0, 1.0)
    out = tmp_path_factory.mktemp("cpdae-model")
    objective.eval()
    objective.save_pretrained(str(out))
    return out, objective


def _reference_probs(objective, tok, text):
    """Independent forward: BERT encoder [CLS] -> Linear, GELU, LayerNorm, Linear -> sigmoid."""
    import torch.nn.functional as F

    enc = tok([text], return_tensors="pt", truncation=True, max_length=128)
    d = {k: v.detach() for k, v in objective.decoder.state_dict().items()}
    with torch.no_grad():
        cls = objective.mlm_model.bert(**enc).last_hidden_state[:, 0]
        h = F.gelu(F.linear(cls, d["transform.dense.weight"], d["transform.dense.bias"]))
        h = F.layer_norm(h, h.shape[-1:], d["transform.LayerNorm.weight"], d["transform.LayerNorm.bias"], eps=1e-12)
        return torch.sigmoid(F.linear(h, d["decoder.weight"], d["decoder.bias"]))[0]


def test_top_words_equals_independent_computation(cpdae_dir, tok):
    from pretrain.analysis.inspect_decoder import DecoderInspector, top_words

    path, objective = cpdae_dir
    text = "Albedo is the measure of diffuse reflection of solar radiation."
    ref = _reference_probs(objective, tok, text)
    ref[tok.all_special_ids] = -1
    values, ids = ref.topk(10)
    expected = list(zip(tok.convert_ids_to_tokens(ids.tolist()), values.tolist()))
    got = top_words(str(path), text, k=10)
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert [p for _, p in got] == pytest.approx([p for _, p in expected], abs=1e-5)
    insp = DecoderInspector.from_pretrained(path, device="cpu")
    assert insp.probabilities([text])[0][ids].tolist() == pytest.approx(values.tolist(), abs=1e-5)


def test_cli_prints_top_k_and_writes_html(cpdae_dir, tok, tmp_path, capsys):
    from pretrain.cli import main as cli_main

    path, objective = cpdae_dir
    texts = tmp_path / "texts.txt"
    texts.write_text("first text about physics.\n\nsecond text about <html> & escapes.\n")
    out = tmp_path / "page.html"
    result = cli_main(["inspect", "--model", str(path), "--text", "a dog runs", "--text-file", str(texts),
                       "--top-k", "5", "--html", str(out)])
    printed = capsys.readouterr().out
    assert result["texts"] == ["a dog runs", "first text about physics.", "second text about <html> & escapes."]
    assert printed.count("top-5 tokens: ") == 3 and f"wrote {out}" in printed
    for text, top in zip(result["texts"], result["top_words"]):
        ref = _reference_probs(objective, tok, text)
        ref[tok.all_special_ids] = -1
        assert [t for t, _ in top] == tok.convert_ids_to_tokens(ref.topk(5).indices.tolist())
    page = out.read_text()
    assert page.count("<section>") == 3 and "&lt;html&gt;" not in page and "<html> &" not in page


def test_real_cpdae_objective_output_loads(tiny_bert_dir, tok, tmp_path):
    """What ``--objective cpdae`` saves is what the inspector loads (same probabilities as the objective's decoder)."""
    from transformers import AutoModelForMaskedLM

    from pretrain.objectives import objective_config
    from pretrain.analysis.inspect_decoder import DecoderInspector
    from pretrain.objectives import build_objective

    torch.manual_seed(0)
    objective = build_objective("cpdae", AutoModelForMaskedLM.from_pretrained(tiny_bert_dir), tok,
                                objective_config("cpdae", model=tiny_bert_dir)).eval()
    objective.save_pretrained(str(tmp_path))
    text = "a text about albedo"
    enc = tok([text], return_tensors="pt")
    with torch.no_grad():
        (decoder,) = objective.decoder_modules().values()
        ref = torch.sigmoid(decoder(objective.encoder(**enc).last_hidden_state[:, 0]))[0]
    got = DecoderInspector.from_pretrained(tmp_path, device="cpu").probabilities([text])[0]
    assert torch.allclose(got, ref, atol=1e-5)
