"""A resume refuses a changed schedule: ``--resume_from_checkpoint`` with another learning rate, scheduler, warm-up,
global batch, seed, objective option or data stops with one line naming the option and what to do; another length is
refused where it gives the steps already taken other learning rates (reference: the linear decay written out; a
length that keeps them is accepted: tests/pretrain/export/test_card.py::test_resume_regenerates_the_card); the same options
resume."""
from __future__ import annotations

import shutil

import pytest

from tests.helpers.cli import pretrain_args, run_cli

CHANGED = [("--learning_rate", "1e-3", "learning_rate"), ("--lr_scheduler_type", "cosine", "lr_scheduler_type"),
           ("--warmup_steps", "0.5", "warmup_steps"), ("--global_batch_size", "4", "global_batch_size"),
           ("--seed", "4", "seed"), ("--mlm_probability", "0.3", "mlm_probability"), ("--max_length", "24", "max_length")]


@pytest.fixture
def unfinished(tmp_path, corpus, tiny_bert_dir, monkeypatch, capsys):
    """A 4-step run whose last checkpoint is step 2 (checkpoint-4 and the export removed: it was killed after 2)."""
    out = tmp_path / "run"
    args = pretrain_args(tiny_bert_dir, corpus, out, tmp_path / "cache", "--max-steps", "4", "--save-steps", "2",
                         "--warmup_steps", "0", "--objective", "mlm")
    assert run_cli(monkeypatch, capsys, args)[0] == 0
    shutil.rmtree(out / "checkpoint-4")
    for name in ("config.json", "model.safetensors"):
        (out / name).unlink()
    return out, args


def test_a_changed_schedule_option_is_refused_in_one_line(unfinished, monkeypatch, capsys):
    out, args = unfinished
    for option, value, name in CHANGED:
        code, line = run_cli(monkeypatch, capsys, [*args, option, value, "--resume_from_checkpoint", "true"])
        assert code == 2, option
        assert line.startswith(f"error: ValueError: --resume_from_checkpoint refused: the run in {out} was started "
                               f"with other options (--{name}: "), line
        assert "resume with the options it was started with" in line and "--overwrite_output_dir" in line
        assert not (out / "checkpoint-4").exists()


def test_another_length_is_refused_where_the_steps_taken_had_other_rates(unfinished, monkeypatch, capsys):
    out, args = unfinished
    # linear decay without warm-up: step k (0-based) of an n-step run runs at (n - k) / n of the peak; step 2 of a
    # 4-step run ran at 3/4, an 8-step run gives it 7/8
    code, line = run_cli(monkeypatch, capsys, [*args, "--max-steps", "8", "--resume_from_checkpoint", "true"])
    assert code == 2 and "--resume_from_checkpoint refused" in line and "a run of 8 steps" in line
    assert f"step 2: {7 / 8:.6g} x the peak, not {3 / 4:.6g}" in line and "(4 steps)" in line
    # a run cannot be cut below the steps it has trained
    code, line = run_cli(monkeypatch, capsys, [*args, "--max-steps", "1", "--resume_from_checkpoint", "true"])
    assert code == 2 and "has trained 2 of its 4 steps, more than the 1 asked for" in line


def test_the_same_options_resume(unfinished, monkeypatch, capsys):
    out, args = unfinished
    assert run_cli(monkeypatch, capsys, [*args, "--resume_from_checkpoint", "true"])[0] == 0
    assert (out / "checkpoint-4" / "trainer_state.json").is_file() and (out / "model.safetensors").is_file()
