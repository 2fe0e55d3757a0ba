"""The CPDAE paper's fine-tuning recipe: its pairwise loss, ``--preset paper``/``paper-document``, ``--round-init``."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from pretrain.finetune import negatives as neg
from pretrain.finetune.biencoder import pairwise_loss
from pretrain.config import FINETUNE_PRESETS, FinetuneConfig, config_fields, parse_config
from pretrain.finetune.train import main

from test_finetune import _args, _write_beir


# ----------------------------------------------------------------------------- the pairwise loss
def _pairwise_reference(q, p, group_size):
    """The paper's pairwise loss written from its equation, one (query, positive, negative) triple at a time:

    L = 1/|pairs| · Σ_(q, d+, d-) −log( exp(s(q,d+)) / (exp(s(q,d+)) + exp(s(q,d−))) ),  s = dot product.
    """
    total, pairs = 0.0, 0
    for i in range(q.shape[0]):
        qi = [float(x) for x in q[i]]
        group = [[float(x) for x in p[i * group_size + g]] for g in range(group_size)]
        s_pos = sum(a * b for a, b in zip(qi, group[0]))
        for d_neg in group[1:]:
            s_neg = sum(a * b for a, b in zip(qi, d_neg))
            total += -math.log(math.exp(s_pos) / (math.exp(s_pos) + math.exp(s_neg)))
            pairs += 1
    return total / pairs


@pytest.mark.parametrize("batch,group_size", [(3, 8), (2, 2), (4, 5)])
def test_pairwise_loss_equals_the_equation(batch, group_size):
    g = torch.Generator().manual_seed(batch * 10 + group_size)
    q = torch.randn(batch, 6, generator=g, dtype=torch.float64) * 0.7
    p = torch.randn(batch * group_size, 6, generator=g, dtype=torch.float64) * 0.7
    got = pairwise_loss(q, p, group_size)
    assert float(got) == pytest.approx(_pairwise_reference(q, p, group_size), rel=1e-6)
    # the reference is not symmetric in pos/neg, and sum and mean differ: a flipped sign or another reduction fails
    swapped = torch.cat([p.view(batch, group_size, -1)[:, 1:2], p.view(batch, group_size, -1)[:, :1],
                         p.view(batch, group_size, -1)[:, 2:]], 1).reshape_as(p)
    assert abs(_pairwise_reference(q, swapped, group_size) - _pairwise_reference(q, p, group_size)) > 1e-3


def test_pairwise_loss_gradient_equals_the_equation():
    g = torch.Generator().manual_seed(7)
    q = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    p = torch.randn(3 * 8, 4, generator=g, dtype=torch.float64, requires_grad=True)
    pairwise_loss(q, p, 8).backward()
    # dL/dq_i = 1/(B·n) Σ_j σ(s_ij− − s_i+) (d_ij− − d_i+)
    pv = p.detach().view(3, 8, 4)
    s = torch.einsum("bd,bgd->bg", q.detach(), pv)
    want = torch.zeros(3, 4, dtype=torch.float64)
    for i in range(3):
        for j in range(1, 8):
            want[i] += torch.sigmoid(s[i, j] - s[i, 0]) * (pv[i, j] - pv[i, 0]) / (3 * 7)
    assert torch.allclose(q.grad, want, atol=1e-12)


# ----------------------------------------------------------------------------- presets
def test_paper_preset_is_exactly_the_papers_recipe():
    cfg = parse_config(FinetuneConfig, ["--preset", "paper"])
    # CPDAE (Ma et al., CIKM 2022), Sec. 5.1: pairwise loss, 1 positive + 7 negatives, lr 5e-6, batch 64, and for
    # passages "static hard negatives using the BM25 warm-up model following [23]" (STAR): a warm-up round on BM25
    # negatives, then one round on the warm-up model's top-200, continuing from the warm-up model
    assert (cfg.loss, cfg.negatives, cfg.num_negatives, cfg.learning_rate, cfg.batch_size) == \
        ("pairwise", "bm25", 7, 5e-6, 64)
    assert (cfg.pooling, cfg.in_batch_negatives, cfg.preset) == ("cls", False, "paper")
    assert (cfg.mining_rounds, cfg.round_init, cfg.negatives_depth) == (1, "previous", 200)
    warm = parse_config(FinetuneConfig, ["--preset", "paper-warmup"])  # the warm-up stage alone, under its own name
    assert (warm.negatives, warm.mining_rounds, warm.loss, warm.num_negatives, warm.learning_rate) == \
        ("bm25", 0, "pairwise", 7, 5e-6)
    doc = parse_config(FinetuneConfig, ["--preset", "paper-document"])
    # documents: from the warm-up model, mine with the current model twice, 1 epoch each, continuing; 512 tokens
    assert (doc.loss, doc.num_negatives, doc.learning_rate, doc.batch_size, doc.epochs) == ("pairwise", 7, 5e-6, 64, 1.0)
    assert (doc.negatives, doc.mining_rounds, doc.round_init, doc.doc_max_length, doc.negatives_depth) == \
        ("model", 1, "previous", 512, 200)
    # every preset names real options with valid values
    names = {f.name for f in config_fields(FinetuneConfig)}
    for preset, values in FINETUNE_PRESETS.items():
        assert set(values) <= names, preset
        FinetuneConfig(**values)


def test_preset_precedence_and_the_defaults(tmp_path):
    default = parse_config(FinetuneConfig, [])
    assert (default.loss, default.in_batch_negatives, default.round_init, default.preset) == \
        ("listwise", True, "base", None)
    # a flag overrides the preset; a config file overrides the preset; the preset may come from the file
    assert parse_config(FinetuneConfig, ["--preset", "paper", "--learning-rate", "1e-5"]).learning_rate == 1e-5
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("num_negatives: 3\n")
    cfg = parse_config(FinetuneConfig, ["--preset", "paper", "--config", str(cfg_file)])
    assert (cfg.num_negatives, cfg.loss) == (3, "pairwise")
    cfg_file.write_text("preset: paper-document\nbatch-size: 8\n")
    cfg = parse_config(FinetuneConfig, ["--config", str(cfg_file), "--mining-rounds", "3"])
    assert (cfg.preset, cfg.batch_size, cfg.mining_rounds, cfg.round_init, cfg.loss) == \
        ("paper-document", 8, 3, "previous", "pairwise")
    with pytest.raises(SystemExit):
        parse_config(FinetuneConfig, ["--preset", "tevatron"])
    cfg_file.write_text("preset: nope\n")
    with pytest.raises(ValueError, match="preset"):
        parse_config(FinetuneConfig, ["--config", str(cfg_file)])


# ----------------------------------------------------------------------------- --round-init
def _spy_on_round_starts(monkeypatch):
    """Record the encoder weights each round's Trainer starts from, keyed by the round directory's name."""
    import pretrain.training.trainer as trainer_mod

    starts: dict[str, dict[str, torch.Tensor]] = {}
    real = trainer_mod.Trainer

    class Spy(real):
        def __init__(self, module, examples, collate, cfg, **kw):
            starts[os.path.basename(cfg.output)] = {k: v.detach().clone() for k, v in module.encoder.state_dict().items()}
            super().__init__(module, examples, collate, cfg, **kw)

    monkeypatch.setattr(trainer_mod, "Trainer", Spy)
    return starts


def _encoder_weights(path):
    from transformers import AutoModel
    return AutoModel.from_pretrained(path, add_pooling_layer=False).state_dict()


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_round_init_previous_continues_and_base_restarts(tmp_path, tiny_bert_dir, monkeypatch):
    spec = _write_beir(tmp_path / "beir")
    base = _encoder_weights(tiny_bert_dir)

    starts = _spy_on_round_starts(monkeypatch)
    prev_out = tmp_path / "previous"
    main(_args(tiny_bert_dir, spec, prev_out, "--negatives", "model", "--mining-rounds", "2",
               "--round-init", "previous", "--loss", "pairwise"))
    rounds = [_encoder_weights(str(prev_out / "rounds" / f"round-{r}")) for r in range(3)]
    assert _same(starts["round-0"], base)                  # round 0 starts from --model
    assert _same(starts["round-1"], rounds[0])             # then each round from the previous round's model
    assert _same(starts["round-2"], rounds[1])
    assert not _same(rounds[1], base) and not _same(rounds[1], rounds[0])   # (the rounds did train)
    assert json.loads((prev_out / "rounds" / "round-2" / "training_args.json").read_text())["init"] == \
        str(prev_out / "rounds" / "round-1")

    starts.clear()
    base_out = tmp_path / "base"
    main(_args(tiny_bert_dir, spec, base_out, "--negatives", f"model:{tiny_bert_dir}", "--mining-rounds", "2",
               "--round-init", "base", "--loss", "pairwise"))
    assert _same(starts["round-0"], base) and _same(starts["round-1"], base) and _same(starts["round-2"], base)
    assert not _same(starts["round-2"], _encoder_weights(str(base_out / "rounds" / "round-1")))
    # --negatives model mines round 0 with --model itself: the same groups as model:<--model>
    assert neg.read_groups(str(prev_out / "groups" / "round-0.jsonl")) == \
        neg.read_groups(str(base_out / "groups" / "round-0.jsonl"))


def test_round_init_is_part_of_the_run_identity(tmp_path, tiny_bert_dir):
    spec = _write_beir(tmp_path / "beir")
    out = tmp_path / "ft"
    main(_args(tiny_bert_dir, spec, out, "--negatives", "bm25"))
    with pytest.raises(ValueError, match="round_init"):
        main(_args(tiny_bert_dir, spec, out, "--negatives", "bm25", "--round-init", "previous", "--resume"))
