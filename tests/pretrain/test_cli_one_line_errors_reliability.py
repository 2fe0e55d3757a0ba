"""Failures a user can cause or meet are one line naming the cause, never a library traceback: an option torch
cannot represent, a full disk while a checkpoint is written, and a second main job on one work directory."""
from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import cli
from tests.helpers.cli import DOCS, run_cli


#: this file's runs: 4 steps, a checkpoint every 2, a learning rate that moves a tiny model
pretrain_args = functools.partial(cli.pretrain_args, objective="mlm",
                                  settings={"--max-steps": "4", "--save-steps": "2", "--learning-rate": "1e-3"})


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
    flag = "--" + option[2:].replace("-", "_")
    assert code == 2 and line.startswith(f"error: ValueError: {flag} must be") and says in line
    assert not out.exists()  # refused before anything was written


# ----------------------------------------------------------------------------- a full disk under a checkpoint
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


# ----------------------------------------------------------------------------- two main jobs on one work directory
def test_a_second_main_job_on_the_same_work_dir_is_one_line(tmp_path, monkeypatch, capsys):
    """Two ``experiments/main.py`` on one ``--work-dir`` met inside an index build with a ``ConcurrentBuildError``
    traceback. The job now holds its work directory's lock: the second (here by a symlink to it) exits 2 at once with
    one line naming the holder, before it writes anything; the lock is free again when the holder ends."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("cpdae_main_job_lock",
                                                  Path(__file__).resolve().parents[2] / "experiments" / "main.py")
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
