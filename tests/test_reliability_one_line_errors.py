"""Failures a user can cause or meet are one line naming the cause, never a library traceback: an option torch
cannot represent, a full disk while a checkpoint is written, and a second main job on one work directory."""
from __future__ import annotations

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


# ----------------------------------------------------------------------------- a full disk under a checkpoint
def tmpfs(path: Path, *options: str) -> Path:
    """A size-limited tmpfs at ``path`` (skips the test where this process may not mount one)."""
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(path)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode}); needs root")
    return path


@pytest.fixture
def mounts():
    made: list[Path] = []
    yield made
    for p in made:
        subprocess.run(["umount", str(p)], capture_output=True)


def fill(disk: Path, leave: int) -> Path:
    """Fill ``disk`` up to ``leave`` free bytes (another process writing: the disk fills between two checkpoints)."""
    filler = disk / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
    size = filler.stat().st_size
    with open(filler, "r+b") as f:
        f.truncate(max(0, size - leave))
    return filler


@pytest.mark.parametrize("leave", ["nothing", "the model file"])
def test_a_full_disk_under_a_pre_training_checkpoint_is_one_line_and_resumes_exactly(
        tmp_path, tiny_bert_dir, corpus, monkeypatch, capsys, mounts, leave):
    """The disk fills before checkpoint-4: with no room at all safetensors fails, with room for the model file only
    torch.save of the optimizer fails (``RuntimeError: basic_ios::clear``, a traceback before). Now one line names
    the file, says the disk is full and which checkpoint to resume from; the partial checkpoint is removed; after
    space is freed ``--resume`` finishes with the weights and losses of an uninterrupted run, bit for bit."""
    from pretrain.training import trainer
    from pretrain.logging_utils import read_metrics
    from safetensors.numpy import load_file

    disk = tmpfs(tmp_path / "disk", "size=64m")
    mounts.append(disk)
    out, ref, cache = disk / "run", tmp_path / "ref", tmp_path / "cache"
    assert run_cli(monkeypatch, capsys, pretrain_args(tiny_bert_dir, corpus, ref, cache))[0] == 0

    original, calls, filler = trainer.save_train_state, [], []

    def disk_fills_before_the_second_checkpoint(directory, *args, **kw):
        calls.append(directory)
        if len(calls) == 2:
            model = out / "checkpoints" / "checkpoint-2" / "model.safetensors"
            filler.append(fill(disk, 0 if leave == "nothing" else model.stat().st_size + (64 << 10)))
        return original(directory, *args, **kw)

    monkeypatch.setattr(trainer, "save_train_state", disk_fills_before_the_second_checkpoint)
    code, line = run_cli(monkeypatch, capsys, pretrain_args(tiny_bert_dir, corpus, out, cache))
    failed = "model.safetensors" if leave == "nothing" else "optimizer.pt"
    assert code == 2 and "checkpoint checkpoint-4 of" in line and "could not be written" in line
    assert f"{failed}: no space left on device" in line and "checkpoint-2 (step 2), is intact" in line
    assert "basic_ios" not in line and "Traceback" not in line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint-2"]  # no partial checkpoint
    assert not (out / "config.json").exists()  # nothing exported

    filler[0].unlink()
    monkeypatch.setattr(trainer, "save_train_state", original)
    assert run_cli(monkeypatch, capsys, pretrain_args(tiny_bert_dir, corpus, out, cache, "--resume"))[0] == 0
    got, want = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert got.keys() == want.keys() and all((got[k] == want[k]).all() for k in want)
    losses = [[r["loss"] for r in read_metrics(str(d / "logs" / "metrics.csv"))] for d in (out, ref)]
    assert losses[0] == losses[1] and len(losses[0]) == 4


# ----------------------------------------------------------------------------- two main jobs on one work directory
def test_a_second_main_job_on_the_same_work_dir_is_one_line(tmp_path, monkeypatch, capsys):
    """Two ``experiments/main.py`` on one ``--work-dir`` met inside an index build with a ``ConcurrentBuildError``
    traceback. The job now holds its work directory's lock: the second (here by a symlink to it) exits 2 at once with
    one line naming the holder, before it writes anything; the lock is free again when the holder ends."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("cpdae_main_job_lock",
                                                  Path(__file__).resolve().parents[1] / "experiments" / "main.py")
    main_job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(main_job)

    work = tmp_path / "work"
    work.mkdir()
    link = tmp_path / "link"
    link.symlink_to(work)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom pyterrier_cpdae._locking import build_lock\n"
         "with build_lock(sys.argv[1], 'work directory of a main job (experiments/main.py)', 'used'):\n"
         "    print('held', flush=True)\n    time.sleep(120)\n", str(work)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        code = main_job._run(["--work-dir", str(link), "--results-dir", str(tmp_path / "results")])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and lines[0].startswith("error: ConcurrentBuildError: ")
        assert f"pid {holder.pid}" in lines[0] and "main job" in lines[0]
        assert sorted(p.name for p in work.iterdir()) == []  # nothing written into it
    finally:
        holder.kill()
        holder.wait()
