"""Input-token coverage (Drop your Decoder, Algorithm 1) vs a naive per-text computation; CLI."""
from __future__ import annotations

import csv
import os

import pytest
import torch

from pretrain.coverage import load_for_coverage, main, token_coverage

TEXTS = ["the quick brown fox jumps over the lazy dog", "a b c",
         "information retrieval evaluation campaigns at trec and clef",
         "pre-training language models for search; dense retrieval with the cls vector", "retrieval retrieval retrieval"]


def _naive(model, tok, texts, ks, projection):
    special = set(tok.all_special_ids)
    out = {k: 0.0 for k in ks}
    with torch.no_grad():
        for text in texts:
            ids = tok(text)["input_ids"]
            h = model.bert(input_ids=torch.tensor([ids])).last_hidden_state[0, 0]
            z = model.cls(h) if projection == "mlm_head" else model.bert.embeddings.word_embeddings.weight @ h
            ranked = [t for t in torch.argsort(z, descending=True).tolist() if t not in special]
            in_text = {t for t in ids if t not in special}
            for k in ks:
                out[k] += len([t for t in ranked[:k] if t in in_text]) / k
    return {k: v / len(texts) for k, v in out.items()}


@pytest.mark.parametrize("projection", ["mlm_head", "embeddings"])
def test_matches_naive(tiny_bert_dir, projection):
    model, tok, resolved = load_for_coverage(tiny_bert_dir, projection)
    assert resolved == projection
    ks = (1, 2, 5, 10, 50)
    got = token_coverage(model, tok, TEXTS, ks, projection=projection, batch_size=2)
    ref = _naive(model, tok, TEXTS, ks, projection)
    assert got.keys() == ref.keys()
    for k in ks:
        assert got[k] == pytest.approx(ref[k], abs=1e-9), k


def test_auto_projection(tiny_bert_dir, minilm_path):
    assert load_for_coverage(tiny_bert_dir)[2] == "mlm_head"
    assert load_for_coverage(minilm_path)[2] == "embeddings"  # sentence-transformers' MiniLM has no MLM head
    with pytest.raises(ValueError, match="masked-LM head"):
        load_for_coverage(minilm_path, "mlm_head")


def test_bad_input(tiny_bert_dir, tmp_path):
    model, tok, _ = load_for_coverage(tiny_bert_dir)
    with pytest.raises(ValueError, match="k must be"):
        token_coverage(model, tok, TEXTS, [0])
    with pytest.raises(ValueError, match="at least one text"):
        token_coverage(model, tok, [], [1])
    with pytest.raises(FileNotFoundError):
        load_for_coverage(str(tmp_path / "missing"))


def test_cli_writes_csv_and_plot(tiny_bert_dir, tmp_path):
    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    csv_path, png = tmp_path / "cov.csv", tmp_path / "cov.png"
    res = main(["--model", f"tiny={tiny_bert_dir}", "--model", tiny_bert_dir, "--projection", "embeddings",
                "--corpus", str(corpus), "--num-texts", "3", "--k", "1", "5", "--csv", str(csv_path), "--plot", str(png)])
    model, tok, _ = load_for_coverage(tiny_bert_dir)
    ref = _naive(model, tok, TEXTS[:3], (1, 5), "embeddings")
    assert res["tiny"] == pytest.approx(ref)
    rows = list(csv.DictReader(open(csv_path)))
    assert [(r["model"], r["k"]) for r in rows] == [("tiny", "1"), ("tiny", "5"), (tiny_bert_dir, "1"), (tiny_bert_dir, "5")]
    assert float(rows[1]["coverage"]) == pytest.approx(ref[5], abs=1e-6)
    assert os.path.getsize(png) > 1000


def test_cpdae_decoder_projection_matches_naive(tiny_bert_dir, tmp_path):
    """``decoder``: the [CLS] vector read through a CPDAE checkpoint's own decoder (saved as a real run saves it)."""
    from transformers import AutoTokenizer

    from pretrain.config import PretrainConfig
    from pretrain.modeling import load_mlm_model
    from pretrain.objectives import build_objective

    torch.manual_seed(0)
    obj = build_objective("cpdae", load_mlm_model(tiny_bert_dir), AutoTokenizer.from_pretrained(tiny_bert_dir),
                          PretrainConfig(objective="cpdae", batch_size=4))
    tok0 = AutoTokenizer.from_pretrained(tiny_bert_dir)
    text_ids = sorted({t for text in TEXTS for t in tok0(text, add_special_tokens=False)["input_ids"]})
    with torch.no_grad():  # a decoder that ranks some of the texts' words high (unlike the random MLM head)
        bias = obj.decoder.decoder.bias
        bias.copy_(torch.randn_like(bias) * 0.1)
        bias[text_ids[::2]] += 5 + torch.rand(len(text_ids[::2]))
    run = tmp_path / "cpdae_run"
    obj.save_pretrained(str(run))

    model, tok, resolved = load_for_coverage(str(run), "decoder")
    assert resolved == "decoder"
    ks = (1, 2, 5, 10, 50)
    got = token_coverage(model, tok, TEXTS, ks, projection="decoder", batch_size=2)
    special = set(tok.all_special_ids)
    ref = {k: 0.0 for k in ks}
    with torch.no_grad():
        for text in TEXTS:
            ids = tok(text)["input_ids"]
            h = model.bert(input_ids=torch.tensor([ids])).last_hidden_state[0, 0]
            z = obj.decoder.eval()(h[None])[0]
            ranked = [t for t in torch.argsort(z, descending=True).tolist() if t not in special]
            in_text = {t for t in ids if t not in special}
            for k in ks:
                ref[k] += len([t for t in ranked[:k] if t in in_text]) / k / len(TEXTS)
    assert got == pytest.approx(ref, abs=1e-9)
    assert got[1] > 0 and got[50] > 0  # non-trivial (a random projection scores 0 here)
    assert got != pytest.approx(token_coverage(model, tok, TEXTS, ks, projection="mlm_head"), abs=1e-3)

    # CLI: a per-model projection; a model without a decoder is refused with a clear error
    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    res = main(["--model", f"cpdae={run}", "--model", f"tiny={tiny_bert_dir}", "--projection", "cpdae=decoder",
                "--corpus", str(corpus), "--num-texts", "5", "--k", "1", "5"])
    assert res["cpdae"] == pytest.approx({1: ref[1], 5: ref[5]}, abs=1e-9)
    with pytest.raises(FileNotFoundError, match="CPDAE decoder"):
        main(["--model", f"tiny={tiny_bert_dir}", "--projection", "decoder", "--corpus", str(corpus)])
    with pytest.raises(ValueError, match="no --model"):
        main(["--model", f"tiny={tiny_bert_dir}", "--projection", "other=decoder", "--corpus", str(corpus)])
