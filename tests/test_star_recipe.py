"""``--preset paper`` runs the CPDAE paper's passage fine-tuning as STAR (Zhan et al., SIGIR 2021) describes it:
a warm-up model trained on BM25 negatives, its top-200 mined as static hard negatives, then training continued
from the warm-up model on them; ``paper-warmup`` is the first stage alone. Tables name the recipe they show."""
from __future__ import annotations

import json

from pretrain.finetune import train as ft
from pretrain.finetune import negatives as neg
from pretrain.finetune.train import main

from test_finetune import _write_beir
from test_finetune_paper_recipe import _encoder_weights, _same, _spy_on_round_starts


def _tiny(model, train, out, *preset):
    # only sizes are overridden; the recipe (negatives, rounds, round init, depth) comes from the preset
    return [*preset, "--model", model, "--train", train, "--output", str(out), "--batch-size", "4", "--max-steps", "2",
            "--num-negatives", "2", "--query-max-length", "16", "--doc-max-length", "24", "--learning-rate", "1e-3",
            "--logging-steps", "1", "--report-to", "csv", "--cpu"]


def _spy_on_mining(monkeypatch):
    """Record which source mined each round's negatives, and how deep."""
    calls = []
    real_bm25, real_dense = ft._pools_bm25, ft._pools_dense

    def bm25(cfg, data):
        calls.append(("bm25", None, cfg.negatives_depth))
        return real_bm25(cfg, data)

    def dense(cfg, data, checkpoint, round_):
        calls.append(("dense", checkpoint, cfg.negatives_depth))
        return real_dense(cfg, data, checkpoint, round_)

    monkeypatch.setattr(ft, "_pools_bm25", bm25)
    monkeypatch.setattr(ft, "_pools_dense", dense)
    return calls


def test_paper_preset_runs_the_star_stages(tmp_path, tiny_bert_dir, monkeypatch):
    spec = _write_beir(tmp_path / "beir", n_docs=240)   # more documents than the mining depth of 200
    calls = _spy_on_mining(monkeypatch)
    starts = _spy_on_round_starts(monkeypatch)
    out = tmp_path / "star"
    summary = main(_tiny(tiny_bert_dir, spec, out, "--preset", "paper"))
    # stage 1: the warm-up model, trained from --model on BM25 negatives; stage 2: mined by the warm-up model
    assert [r["round"] for r in summary["rounds"]] == [0, 1]
    warmup = str(out / "rounds" / "round-0")
    assert calls == [("bm25", None, 200), ("dense", warmup, 200)]
    assert _same(starts["round-0"], _encoder_weights(tiny_bert_dir))
    assert _same(starts["round-1"], _encoder_weights(warmup))       # trained from the warm-up model
    args = json.loads((out / "rounds" / "round-1" / "training_args.json").read_text())
    assert args["init"] == warmup
    cfg = json.loads((out / "training_args.json").read_text())["config"]
    assert (cfg["negatives"], cfg["mining_rounds"], cfg["round_init"], cfg["negatives_depth"], cfg["loss"]) == \
        ("bm25", 1, "previous", 200, "pairwise")
    # the static hard negatives are the warm-up model's top 200 minus the positive
    r1, _ = neg.read_groups(str(out / "groups" / "round-1.jsonl"))
    assert all(len(g.negs) == 199 and g.pos[0] not in g.negs for g in r1)
    # and the final model is the second stage's
    assert _same(_encoder_weights(str(out)), _encoder_weights(str(out / "rounds" / "round-1")))


def test_paper_warmup_preset_is_the_first_stage_alone(tmp_path, tiny_bert_dir, monkeypatch):
    spec = _write_beir(tmp_path / "beir")
    calls = _spy_on_mining(monkeypatch)
    out = tmp_path / "warm"
    summary = main(_tiny(tiny_bert_dir, spec, out, "--preset", "paper-warmup"))
    assert [r["round"] for r in summary["rounds"]] == [0] and calls == [("bm25", None, 200)]


def test_tables_name_the_fine_tuning_recipe():
    from experiments.paper.config import load_config
    from experiments.paper.tables import finetune_recipes

    paper = finetune_recipes(load_config("paper"))
    assert "`--preset paper` (the CPDAE paper's passage recipe, STAR's two stages" in paper
    assert "MS MARCO passage train: `--preset paper`" in paper and "2 training rounds" in paper
    assert "MS MARCO document train: `--preset paper-document`" in paper
    for scale in ("cpu", "smoke"):       # the small scales keep the warm-up stage and say so
        text = finetune_recipes(load_config(scale))
        assert "`--preset paper-warmup`" in text and "not the paper's full recipe" in text
        assert "`--preset paper`" not in text
    assert "`--preset paper` (the CPDAE paper's passage recipe" in finetune_recipes(load_config("gpu"))  # fits an H100
    for scale in ("cpu", "gpu"):  # SciFact is zero-shot only there: its (defined, never run) recipe is not named
        assert "SciFact" not in finetune_recipes(load_config(scale))
        assert "MARCO-sample train" in finetune_recipes(load_config(scale))
    # the paper scale reports R@100 for documents, as the paper does
    cfg = load_config("paper")
    assert cfg["eval_sets"]["marco_doc_dev"]["metrics"] == ["RR@100", "R@100"]
    assert cfg["eval_sets"]["dl19_doc"]["metrics"] == ["nDCG@10", "R@100"]
