"""Failures a user can cause or meet are one line naming the cause, never a library traceback: an option torch
cannot represent, a full disk while a checkpoint is written, and a second main job on one work directory."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain import __main__ as entry

DOCS = ["Dense retrieval encodes a text into one vector. The decoder reconstructs its words.",
        "Apples grow on trees in the orchard. Bananas are yellow when ripe.",
        "The river runs to the sea. Boats carry goods along the coast.",
        "Physics studies matter and energy. Chemistry studies reactions."]


def run_cli(monkeypatch, capsys, argv: list[str]) -> tuple[int, str]:
    """``python -m pretrain <argv>`` in this process: (exit code, the one ``error:`` line)."""
    monkeypatch.setattr(sys, "argv", ["pretrain", *argv])
    code = entry._run()
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == (1 if code else 0), err[-2000:]
    return code, lines[0] if lines else ""


def pretrain_args(model: str, corpus: Path, out: Path, cache: Path, *extra: str, objective: str = "mlm") -> list[str]:
    return ["--model", model, "--corpus", str(corpus), "--output", str(out), "--cache-dir", str(cache),
            "--objective", objective, "--batch-size", "2", "--max-length", "32", "--max-steps", "4", "--save-steps", "2",
            "--logging-steps", "1", "--learning-rate", "1e-3", "--report-to", "csv", "--cpu", *extra]


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(DOCS * 4) + "\n")
    return path


# ----------------------------------------------------------------------------- options torch cannot represent
@pytest.mark.parametrize("option, value, says", [
    ("--learning-rate", "1e39", "within float32's range"),   # passed the check, then overflowed in AdamW's step
    ("--learning-rate", "1e7", "in (0, 1000000]"),           # finite in float32, but lr / (1 - beta1) need not be
    ("--temperature", "1e39", "within float32's range"),
    ("--cl-weight", "1e39", "within float32's range"),
])
def test_a_float_option_beyond_float32_is_refused_naming_it(tmp_path, tiny_bert_dir, corpus, monkeypatch, capsys,
                                                             option, value, says):
    out = tmp_path / "run"
    argv = pretrain_args(tiny_bert_dir, corpus, out, tmp_path / "cache", option, value, objective="cpdae")
    code, line = run_cli(monkeypatch, capsys, argv)
    assert code == 2 and line.startswith(f"error: ValueError: {option} must be") and says in line
    assert not out.exists()  # refused before anything was written


def test_a_fine_tuning_learning_rate_beyond_float32_is_refused(tmp_path, tiny_bert_dir, monkeypatch, capsys):
    code, line = run_cli(monkeypatch, capsys, ["finetune", "--model", tiny_bert_dir, "--train", "sample", "--output",
                                               str(tmp_path / "ft"), "--learning-rate", "1e39", "--cpu"])
    assert code == 2 and "--learning-rate must be a number within float32's range" in line
