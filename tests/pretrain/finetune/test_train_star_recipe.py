"""``--preset paper`` runs the CPDAE paper's passage fine-tuning as STAR (Zhan et al., SIGIR 2021) describes it:
a warm-up model trained on BM25 negatives, its top-200 mined as static hard negatives, then training continued
from the warm-up model on them; ``paper-warmup`` is the first stage alone; ``--round_init base`` restarts every
round from ``--model``. Tables name the recipe they show."""
from __future__ import annotations

import os

import torch

from tests.helpers.tiny_sets import tiny_beir
from pretrain.finetune import train as ft


def _tiny(model, train, out, *preset):
    # only sizes are overridden; the recipe (negatives, rounds, round init, depth) comes from the preset
    return [*preset, "--model", model, "--train", train, "--output_dir", str(out), "--per_device_train_batch_size",
            "4", "--max_steps", "2", "--num_negatives", "2", "--max_seq_length", "24", "--learning_rate", "1e-3"]


def _spy(monkeypatch):
    """Which source mined each round (and how deep), and the weights each round started from."""
    calls, starts = [], {}
    real_mine, real_build = ft.mine, ft.build_model

    def mine(fa, out, r, data, normalize):
        kind, model = ft.mining_source(fa, out, r)
        calls.append((kind, model and os.path.relpath(model, out), fa.negatives_depth))
        return real_mine(fa, out, r, data, normalize)

    def build(start, fa):
        model, normalize = real_build(start, fa)
        starts[len(starts)] = {k: v.clone() for k, v in model.state_dict().items()}
        return model, normalize

    monkeypatch.setattr(ft, "mine", mine)
    monkeypatch.setattr(ft, "build_model", build)
    return calls, starts


def _weights_of(path):
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(str(path), device="cpu").state_dict()


def _same(a, b):
    keys = [k for k in a if "pooler" not in k]
    return all(torch.equal(a[k], b[k]) for k in keys)


def test_paper_preset_runs_the_star_stages(tmp_path, tiny_bert_dir, monkeypatch):
    data = f"beir:{tiny_beir(tmp_path / 'beir', docs=240, queries=6)}:train"  # more documents than the depth of 200
    calls, starts = _spy(monkeypatch)
    out = tmp_path / "star"
    record = ft.main(_tiny(tiny_bert_dir, data, out, "--preset", "paper"))
    assert [r["round"] for r in record["rounds"]] == [0, 1]
    assert calls == [("bm25", None, 200), ("dense", os.path.join("rounds", "round-0", "model"), 200)]
    assert _same(starts[0], _weights_of(tiny_bert_dir))
    assert _same(starts[1], _weights_of(out / "rounds" / "round-0" / "model"))  # continued from the warm-up model
    assert not any(r["in_batch_negatives"] for r in record["rounds"]) and record["options"]["round_init"] == "previous"
    # the static hard negatives are the warm-up model's top 200 minus the judged document
    key = __import__("json").loads((out / "negatives" / "round-1.parquet.key.json").read_text())
    groups = ft.neg.load_pools(str(out / "negatives" / "round-1.parquet"), key)
    # (199 when the judged document is in the top 200, else 200: this corpus's near-identical passages tie near rank
    # 200, where float summation order decides)
    assert all(len(set(g.negs)) == len(g.negs) in (199, 200) and g.pos[0] not in g.negs for g in groups)
    assert sum(len(g.negs) == 199 for g in groups) >= len(groups) // 2
    assert _same(_weights_of(out), _weights_of(out / "rounds" / "round-1" / "model"))


def test_round_init_base_restarts_and_warmup_is_one_round(tmp_path, tiny_bert_dir, monkeypatch):
    data = f"beir:{tiny_beir(tmp_path / 'beir', docs=40, queries=6)}:train"
    calls, starts = _spy(monkeypatch)
    record = ft.main(_tiny(tiny_bert_dir, data, tmp_path / "base", "--negatives", "model", "--mining_rounds", "1",
                           "--negatives_depth", "20"))
    assert _same(starts[0], starts[1]) and len(record["rounds"]) == 2
    calls.clear()
    record = ft.main(_tiny(tiny_bert_dir, data, tmp_path / "warm", "--preset", "paper-warmup"))
    assert [r["round"] for r in record["rounds"]] == [0] and calls == [("bm25", None, 200)]


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
    assert "`--preset paper` (the CPDAE paper's passage recipe" in finetune_recipes(load_config("gpu"))
