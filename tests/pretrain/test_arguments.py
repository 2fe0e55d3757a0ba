"""The options of ``python -m pretrain`` on HfArgumentParser: Trainer options by their own names, config files through
the bounded reader, presets, per-objective options, the global batch."""
from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from pretrain.arguments import build_parser, parse_args


def test_help_lists_trainer_options_by_their_names_and_only_the_objectives_own():
    out = subprocess.run([sys.executable, "-m", "pretrain", "--objective", "cpdae", "--help"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for name in ("--learning_rate", "--learning-rate", "--per_device_train_batch_size", "--lr_scheduler_type",
                 "--report_to", "--resume_from_checkpoint", "--eval_strategy", "--gradient_checkpointing",
                 "--global_batch_size", "--probe", "--cl_weight", "--corpus"):
        assert name in out.stdout, name
    assert "--bow_weight" not in out.stdout  # another objective's option
    bow = build_parser("bow").format_help()
    assert "--bow_weight" in bow and "--cl_weight" not in bow


def test_underscore_and_dash_spellings_mean_the_same(tmp_path):
    a = parse_args(["--output_dir", str(tmp_path), "--learning_rate", "3e-4", "--max-length", "64"])
    b = parse_args(["--output_dir", str(tmp_path), "--learning-rate", "3e-4", "--max_length", "64"])
    assert a[2].learning_rate == b[2].learning_rate == 3e-4
    assert a[1].max_length == b[1].max_length == 64


def test_config_file_then_flags(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("objective: mlm\nlearning-rate: 2.0e-4\nmax_length: 96\nmlm_probability: 0.3\n"
                   "per_device_train_batch_size: 4\n")
    model, data, train, opts = parse_args(["--config", str(cfg), "--output_dir", str(tmp_path / "o"),
                                           "--max_length", "128"])
    assert model.objective == "mlm" and opts.mlm_probability == 0.3
    assert train.learning_rate == 2e-4 and train.per_device_train_batch_size == 4
    assert data.max_length == 128  # the flag overrides the file


def test_config_file_key_given_twice_is_refused_naming_the_file(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("learning_rate: 1.0e-4\nlearning-rate: 2.0e-4\n")
    with pytest.raises(ValueError, match="run.yaml"):
        parse_args(["--config", str(cfg), "--output_dir", str(tmp_path / "o")])


def test_config_file_unknown_key_and_bad_value_are_refused(tmp_path):
    cfg = tmp_path / "run.json"
    cfg.write_text('{"objective": "mlm", "cl_weight": 0.2}')  # an option of cpdae, not of mlm
    with pytest.raises(ValueError, match="unknown option.*cl_weight"):
        parse_args(["--config", str(cfg), "--output_dir", str(tmp_path / "o")])
    cfg.write_text('{"max_length": "many"}')
    with pytest.raises(ValueError, match="max_length"):
        parse_args(["--config", str(cfg), "--output_dir", str(tmp_path / "o")])


def test_declared_range_is_checked_with_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"--max_length must be >= 3, got 2"):
        parse_args(["--output_dir", str(tmp_path), "--max_length", "2"])
    with pytest.raises(ValueError, match=r"--cl_weight must be >= 0"):
        parse_args(["--output_dir", str(tmp_path), "--cl_weight", "-1"])


def test_bow_preset_sets_cosine_with_a_floor_of_a_tenth_and_says_so(tmp_path, caplog):
    import torch
    from transformers import get_scheduler

    with caplog.at_level(logging.INFO, logger="pretrain.arguments"):
        _, data, train, opts = parse_args(["--objective", "bow", "--preset", "paper", "--output_dir", str(tmp_path),
                                           "--max_steps", "100", "--warmup_steps", "10"])
    assert "--preset paper of objective bow sets" in caplog.text
    assert "--warmup_steps 10.0 overrides the value of --preset paper (4000" in caplog.text
    assert train.lr_scheduler_type.value == "cosine_with_min_lr" and train.learning_rate == 3e-4
    assert opts.mlm_probability == 0.3 and data.max_length == 512 and train.global_batch_size == 256
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=train.learning_rate)
    sched = get_scheduler(train.lr_scheduler_type, opt, num_warmup_steps=10, num_training_steps=100,
                          scheduler_specific_kwargs=train.lr_scheduler_kwargs)
    lrs = []
    for _ in range(100):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    import math
    peak, floor = 3e-4, 0.1 * 3e-4
    # the reference: cosine from the peak to the floor over the 90 steps after the warm-up
    for s in (10, 40, 70, 99):
        ref = floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * (s - 10) / 90))
        assert lrs[s] == pytest.approx(ref, rel=1e-6)


def test_unknown_preset_names_the_objectives_presets(tmp_path):
    with pytest.raises(ValueError, match="unknown preset 'nope' for objective 'cpdae'; its presets: paper"):
        parse_args(["--preset", "nope", "--output_dir", str(tmp_path)])


def test_global_batch_is_split_over_processes_and_accumulation(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    train = parse_args(["--output_dir", str(tmp_path), "--global_batch_size", "8",
                        "--gradient_accumulation_steps", "2"])[2]
    assert train.per_device_train_batch_size == 2
    with pytest.raises(ValueError, match="--global_batch_size 6 must be divisible"):
        parse_args(["--output_dir", str(tmp_path), "--global_batch_size", "6", "--gradient_accumulation_steps", "2"])

