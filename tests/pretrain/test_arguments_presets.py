"""Per-objective ``--preset paper`` for pre-training: each resolves to the settings its paper (or the authors'
code) reports, as transcribed here from the sources named in docs/pretraining.md, and flags / config files still
override it. The controlled comparison (experiments/paper) uses no preset: one shared budget."""
from __future__ import annotations

import dataclasses
import json

import pytest

from pretrain.arguments import parse_args, run_config, shared_option_names
from pretrain.objectives import available_objectives, objective_class

# Written from the sources, not from the code: objective -> {option: value}
PAPER = {
    # CPDAE (Ma et al., CIKM 2022) Sec. 5.1: Wikipedia, 3 epochs, batch 64, lr 5e-5, 10% warm-up, 512 tokens, λ 0.1, no τ
    "cpdae": {"learning_rate": 5e-5, "global_batch_size": 64, "num_train_epochs": 3.0, "warmup_steps": 0.1, "max_length": 512,
              "cl_weight": 0.1, "temperature": 1.0},
    "cpdae_r": {"learning_rate": 5e-5, "global_batch_size": 64, "num_train_epochs": 3.0, "warmup_steps": 0.1, "max_length": 512,
                "cl_weight": 0.1, "temperature": 1.0},
    "cpdae_nocl": {"learning_rate": 5e-5, "global_batch_size": 64, "num_train_epochs": 3.0, "warmup_steps": 0.1, "max_length": 512},
    "cpdae_idfrec": {"learning_rate": 5e-5, "global_batch_size": 64, "num_train_epochs": 3.0, "warmup_steps": 0.1, "max_length": 512},
    # SimCSE unsupervised (Gao et al. 2021; run_unsup_example.sh): batch 64, lr 3e-5, 32 tokens, τ 0.05, 1 epoch
    "simcse": {"learning_rate": 3e-5, "global_batch_size": 64, "max_length": 32, "temperature": 0.05,
               "num_train_epochs": 1.0, "warmup_steps": 0.0, "weight_decay": 0.0},
    # RetroMAE (staoxiao/RetroMAE examples/pretrain/README.md): lr 1e-4, 32 per device, 8 epochs, masks 0.3 / 0.5
    "retromae": {"learning_rate": 1e-4, "global_batch_size": 32, "num_train_epochs": 8.0, "warmup_steps": 0.1,
                 "weight_decay": 0.01,
                 "max_length": 512, "encoder_mask_ratio": 0.3, "decoder_mask_ratio": 0.5},
    # BoW (bowdpr README): lr 3e-4, 64 x 4 accumulation, 140k steps, 4k warm-up, 512 tokens, 30% masking, cosine
    # schedule with a floor of 0.1 of the peak
    "bow": {"learning_rate": 3e-4, "global_batch_size": 256, "max_steps": 140000, "warmup_steps": 4000,
            "weight_decay": 0.01, "max_length": 512, "lr_scheduler_type": "cosine_with_min_lr",
            "lr_scheduler_kwargs": {"min_lr_rate": 0.1}, "mlm_probability": 0.3},
    # SEED-Encoder: 3-layer decoder, attention span 2
    "seed": {"seed_decoder_layers": 3, "seed_attention_span": 2},
    # ICT (ORQA's ict_experiment.py): lr 1e-4, 288-token blocks, mask rate 0.9
    "ict": {"learning_rate": 1e-4, "max_length": 288, "ict_keep_probability": 0.1, "temperature": 1.0},
    # PROP: Poisson λ 3, margin 1, subsampling 1e-4, whole-word masking
    "prop": {"prop_poisson_lambda": 3.0, "prop_margin": 1.0, "prop_subsample_t": 1e-4, "whole_word_mask": True},
}


def _resolved(argv, tmp_path):
    """Every option of ``python -m pretrain ARGV`` as the parser resolves it (the TrainingArguments too)."""
    model, data, train, opts = parse_args([*argv, "--output_dir", str(tmp_path / "run")])
    values = {**vars(model), **vars(data), **vars(opts)}
    for k in ("learning_rate", "global_batch_size", "num_train_epochs", "warmup_steps", "weight_decay", "max_steps",
              "lr_scheduler_kwargs", "preset"):
        values[k] = getattr(train, k)
    values["lr_scheduler_type"] = getattr(train.lr_scheduler_type, "value", train.lr_scheduler_type)
    return values


@pytest.mark.parametrize("objective", sorted(PAPER))
def test_paper_preset_resolves_to_the_papers_values(objective, tmp_path):
    cfg = _resolved(["--objective", objective, "--preset", "paper"], tmp_path)
    assert cfg["preset"] == "paper"
    got = {k: cfg[k] for k in PAPER[objective]}
    assert got == pytest.approx(PAPER[objective]) if "lr_scheduler_kwargs" not in got else got == PAPER[objective]
    # options the preset does not name keep their defaults
    default = _resolved(["--objective", objective], tmp_path)
    untouched = set(cfg) - set(PAPER[objective]) - {"preset"}
    assert {k: cfg[k] for k in untouched} == {k: default[k] for k in untouched}


def test_every_preset_is_listed_above_and_names_real_options():
    for name, cls in available_objectives().items():
        fields = shared_option_names() | {f.name for f in dataclasses.fields(cls.Options)}
        for preset, values in cls.presets.items():
            assert set(values) <= fields, (name, preset)
            assert values == PAPER[name], name     # no preset without a reference here
    assert objective_class("mlm").presets == {}    # BERT's MLM: the base, no paper preset


def test_flags_and_config_files_override_a_preset(tmp_path):
    cfg = _resolved(["--objective", "simcse", "--preset", "paper", "--learning_rate", "1e-5", "--max_length", "64"],
                    tmp_path)
    assert (cfg["learning_rate"], cfg["max_length"], cfg["temperature"], cfg["global_batch_size"]) == (1e-5, 64, 0.05, 64)
    f = tmp_path / "run.json"
    f.write_text(json.dumps({"objective": "retromae", "preset": "paper", "decoder_mask_ratio": 0.7}))
    cfg = _resolved(["--config", str(f), "--num_train_epochs", "1"], tmp_path)
    assert (cfg["decoder_mask_ratio"], cfg["encoder_mask_ratio"], cfg["num_train_epochs"], cfg["learning_rate"]) == \
        (0.7, 0.3, 1.0, 1e-4)


def test_an_unknown_preset_is_refused_naming_the_objective(tmp_path):
    with pytest.raises(ValueError, match="objective 'mlm'.*no presets"):
        _resolved(["--objective", "mlm", "--preset", "paper"], tmp_path)
    with pytest.raises(ValueError, match="unknown preset 'tevatron' for objective 'cpdae'; its presets: paper"):
        _resolved(["--objective", "cpdae", "--preset", "tevatron"], tmp_path)
    f = tmp_path / "run.json"
    f.write_text(json.dumps({"objective": "bow", "preset": "nope"}))
    with pytest.raises(ValueError, match="unknown preset 'nope' for objective 'bow'; its presets: paper"):
        _resolved(["--config", str(f)], tmp_path)


def test_resume_compares_what_a_preset_resolved_to_not_its_name(tmp_path):
    """The run directory check compares the resolved options: --preset itself may differ (RESUMABLE)."""
    from pretrain.training.run_dir import RESUMABLE

    a = run_config(*parse_args(["--objective", "simcse", "--preset", "paper", "--output_dir", str(tmp_path)]))
    b = run_config(*parse_args(["--objective", "simcse", "--learning_rate", "3e-5", "--output_dir", str(tmp_path)]))
    differ = {k for k in a.options() if a.options()[k] != b.options()[k]} - RESUMABLE
    assert "preset" in RESUMABLE and "learning_rate" not in differ and {"max_length", "weight_decay"} <= differ


def test_the_controlled_comparison_uses_no_preset():
    from experiments.paper.config import load_config
    for scale in ("cpu", "gpu", "smoke", "paper"):
        cfg = load_config(scale)
        assert "preset" not in cfg["pretrain"]["continue"]
        assert all("preset" not in extra for extra in cfg["objectives"].values())
