"""Input-token coverage (Drop your Decoder, Algorithm 1): precision (÷k) and recall (÷|T|) vs a naive
per-text computation and a hand-computed example; CLI."""
from __future__ import annotations

import csv
import os

import pytest
import torch

from pretrain.analysis.coverage import load_for_coverage, main, token_coverage, token_coverages

TEXTS = ["the quick brown fox jumps over the lazy dog", "a b c",
         "information retrieval evaluation campaigns at trec and clef",
         "pre-training language models for search; dense retrieval with the cls vector", "retrieval retrieval retrieval"]


def _naive(model, tok, texts, ks, projection, measure="precision"):
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
                out[k] += len([t for t in ranked[:k] if t in in_text]) / (k if measure == "precision" else len(in_text))
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
    both = token_coverages(model, tok, TEXTS, ks, projection=projection, batch_size=2)
    assert both["precision"] == got
    assert both["recall"] == pytest.approx(_naive(model, tok, TEXTS, ks, projection, "recall"), abs=1e-9)
    assert token_coverage(model, tok, TEXTS, ks, projection=projection, measure="recall") == both["recall"]


class _FixedRanking(torch.nn.Module):
    """A stand-in 'decoder' that gives every text the same vocabulary scores."""

    def __init__(self, scores):
        super().__init__()
        self.register_buffer("scores", scores)

    def forward(self, cls):
        return self.scores.expand(cls.shape[0], -1)


def test_precision_and_recall_hand_computed(tiny_bert_dir):
    """Ranking apple > ocean > river > cat > moon > the rest, for every text:

    "apple river apple"   T = {apple, river}            hits@1,2,3,5 = 1, 1, 2, 2
    "ocean cat dog bird"  T = {ocean, cat, dog, bird}   hits@1,2,3,5 = 0, 1, 1, 2
    precision@k = mean(hits/k):   @1 (1+0)/2, @2 (1/2+1/2)/2, @3 (2/3+1/3)/2, @5 (2/5+2/5)/2
    recall@k = mean(hits/|T|):    @1 (1/2+0)/2, @2 (1/2+1/4)/2, @3 (1+1/4)/2, @5 (1+2/4)/2
    (|T| counts "apple" once: the token *set*.)
    """
    model, tok, _ = load_for_coverage(tiny_bert_dir, "mlm_head")
    vocab = model.get_input_embeddings().weight.shape[0]
    scores = torch.full((vocab,), -1.0)
    for rank, word in enumerate(["apple", "ocean", "river", "cat", "moon"]):
        (token_id,) = tok(word, add_special_tokens=False)["input_ids"]
        scores[token_id] = 10.0 - rank
    model.cpdae_decoder = _FixedRanking(scores)
    got = token_coverages(model, tok, ["apple river apple", "ocean cat dog bird"], (1, 2, 3, 5), projection="decoder")
    assert got["precision"] == pytest.approx({1: 0.5, 2: 0.5, 3: 0.5, 5: 0.4}, abs=1e-12)
    assert got["recall"] == pytest.approx({1: 0.25, 2: 0.375, 3: 0.625, 5: 0.75}, abs=1e-12)


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
    with pytest.raises(ValueError, match="unknown coverage measure"):
        token_coverage(model, tok, TEXTS, [1], measure="f1")
    with pytest.raises(ValueError, match="unknown coverage measure"):
        token_coverages(model, tok, TEXTS, [1], measures=["precision", "ndcg"])
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
    ref_recall = _naive(model, tok, TEXTS[:3], (1, 5), "embeddings", "recall")
    assert res["tiny"]["precision"] == pytest.approx(ref)   # both measures by default
    assert res["tiny"]["recall"] == pytest.approx(ref_recall)
    rows = list(csv.DictReader(open(csv_path)))
    assert [(r["model"], r["measure"], r["k"]) for r in rows] == [
        (name, m, k) for name in ("tiny", tiny_bert_dir) for m in ("precision", "recall") for k in ("1", "5")]
    assert float(rows[1]["coverage"]) == pytest.approx(ref[5], abs=1e-6)
    assert float(rows[3]["coverage"]) == pytest.approx(ref_recall[5], abs=1e-6)
    assert os.path.getsize(png) > 1000
    one = main(["--model", f"tiny={tiny_bert_dir}", "--projection", "embeddings", "--corpus", str(corpus),
                "--num-texts", "3", "--k", "1", "5", "--measure", "recall"])
    assert list(one["tiny"]) == ["recall"] and one["tiny"]["recall"] == pytest.approx(ref_recall)


def test_cpdae_decoder_projection_matches_naive(tiny_bert_dir, tmp_path):
    """``decoder``: the [CLS] vector read through a CPDAE checkpoint's own decoder (saved as a real run saves it)."""
    from transformers import AutoTokenizer

    from pretrain.objectives import objective_config
    from pretrain.model.modeling import load_mlm_model
    from pretrain.objectives import build_objective

    torch.manual_seed(0)
    obj = build_objective("cpdae", load_mlm_model(tiny_bert_dir), AutoTokenizer.from_pretrained(tiny_bert_dir),
                          objective_config("cpdae", batch_size=4))
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
    # the export keeps its trained MLM head in mlm_head/: --projection auto finds it, bit for bit
    model, _, resolved = load_for_coverage(str(run))
    assert resolved == "mlm_head"
    assert torch.equal(model.cls.predictions.transform.dense.weight,
                       obj.mlm_model.cls.predictions.transform.dense.weight)
    assert got != pytest.approx(token_coverage(model, tok, TEXTS, ks, projection="mlm_head"), abs=1e-3)

    # CLI: a per-model projection; a model without a decoder is refused with a clear error
    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    res = main(["--model", f"cpdae={run}", "--model", f"tiny={tiny_bert_dir}", "--projection", "cpdae=decoder",
                "--corpus", str(corpus), "--num-texts", "5", "--k", "1", "5"])
    assert res["cpdae"]["precision"] == pytest.approx({1: ref[1], 5: ref[5]}, abs=1e-9)
    with pytest.raises(FileNotFoundError, match="CPDAE decoder"):
        main(["--model", f"tiny={tiny_bert_dir}", "--projection", "decoder", "--corpus", str(corpus)])
    with pytest.raises(ValueError, match="no --model"):
        main(["--model", f"tiny={tiny_bert_dir}", "--projection", "other=decoder", "--corpus", str(corpus)])
