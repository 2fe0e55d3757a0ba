"""A resumed run trains to the length asked for, or refuses in one line, and its record describes its weights.

A finished or interrupted run resumed with another ``--max-steps`` (or ``--epochs``) is continued only where the
result is the run asked for: no more steps trained than asked, and every step taken at the rate the new total's
linear schedule gives it. Otherwise ``--resume`` stops with one line before writing anything, so the run's record,
card and export still describe the weights it holds. A fine-tuning round trained for another length is continued
(or refused), never reported "already trained"; a paper pipeline stage whose length changed is run again or
refused, never marked done with the old weights."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from safetensors.numpy import load_file

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


def pretrain_args(model: str, corpus: Path, out: Path, cache: Path, steps: int) -> list[str]:
    return ["--model", model, "--corpus", str(corpus), "--output", str(out), "--cache-dir", str(cache),
            "--objective", "mlm", "--batch-size", "2", "--max-length", "32", "--max-steps", str(steps),
            "--save-steps", "2", "--logging-steps", "1", "--learning-rate", "1e-3", "--report-to", "none", "--cpu"]


def weights(path: Path) -> dict:
    return load_file(str(path / "model.safetensors"))


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(DOCS * 4) + "\n")
    return path


def test_a_finished_pre_training_resumed_shorter_is_refused_and_keeps_its_record(tmp_path, tiny_bert_dir, corpus,
                                                                                   monkeypatch, capsys):
    """An 8-step run resumed with --max-steps 2 was exported with the 8-step weights and max_steps 2 recorded."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    assert run_cli(monkeypatch, capsys, pretrain_args(tiny_bert_dir, corpus, out, cache, 8))[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    code, line = run_cli(monkeypatch, capsys, pretrain_args(tiny_bert_dir, corpus, out, cache, 2) + ["--resume"])
    assert code == 2
    assert "--resume refused" in line and "has trained 8 of its 8 steps, more than the 2 asked for" in line
    # nothing written: the record, the card and the weights are the 8-step run's
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert json.loads((out / "run_config.json").read_text())["config"]["max_steps"] == 8


def test_a_pre_training_extended_on_another_schedule_is_refused(tmp_path, tiny_bert_dir, corpus, monkeypatch, capsys):
    """4 steps resumed as 8 (warm-up 1 step of 4, then 1 of 8): step 3 ran at x0.667 of the peak rate (2/3), an 8-step
    run gives it x0.857 (6/7; hand-computed: (T - 2) / (T - 1)). The continuation would not be an 8-step run."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    assert run_cli(monkeypatch, capsys, pretrain_args(tiny_bert_dir, corpus, out, cache, 4))[0] == 0
    before = weights(out)
    code, line = run_cli(monkeypatch, capsys, pretrain_args(tiny_bert_dir, corpus, out, cache, 8) + ["--resume"])
    assert code == 2 and "--resume refused" in line
    assert "step 3: x0.857143 of the peak rate, not x0.666667" in line and "start a new run of 8 steps" in line
    assert json.loads((out / "run_config.json").read_text())["config"]["max_steps"] == 4
    after = weights(out)
    assert all((after[k] == before[k]).all() for k in before)


def test_a_pipeline_stage_shortened_is_refused_not_marked_done(tmp_path, tiny_bert_dir, corpus, monkeypatch):
    """A pre-training stage run for 6 steps, then configured for 3: it was resumed, exported the 6-step weights
    with max_steps 3 recorded and marked done. Now the stage stops with the refusal and is not done."""
    from experiments.paper import stages
    from experiments.paper.stages import Runner, Stage, StageError

    monkeypatch.setattr(stages, "RUNNING_WINDOW_S", 0)  # a run killed long ago: resumed, not waited for
    out, cache = tmp_path / "work" / "pretrain" / "base", tmp_path / "cache"

    def stage(steps: int) -> Stage:
        argv = pretrain_args(tiny_bert_dir, corpus, out, cache, steps)
        argv[argv.index("--save-steps") + 1] = "3"
        return Stage("base", "pretrain", argv, out)

    runner = Runner(tmp_path / "work", mode="inprocess", log=lambda _: None)
    runner.run(stage(6))
    assert stage(6).state() == "done"
    six = weights(out)
    shorter = stage(3)
    assert shorter.state() == "resume"
    with pytest.raises((ValueError, StageError), match="has trained 6 of its 6 steps, more than the 3 asked for"):
        runner.run(shorter)
    assert shorter.state() != "done" and not shorter.finished()
    assert all((weights(out)[k] == six[k]).all() for k in six)

