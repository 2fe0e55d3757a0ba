"""The paper pipeline as a run: one pipeline per work directory, tables written whole, a
failed stage under ``--jobs 2`` named with a non-zero exit and the other stages' results kept.

The stages here are fake (``python -m pretrain`` is replaced by a function writing what a finished run leaves: its
``run_config.json`` holding the stage's own parsed options, and an exported ``config.json``), so that the pipeline's
own logic (locks, scheduling, records, the stage-done check) is what runs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pandas as pd
import pytest
from tests.helpers.warm_python import warm_python

REPO = Path(__file__).resolve().parents[3]
SMOKE = ["--scale", "smoke"]


# ----------------------------------------------------------------------------- one pipeline per work directory
def test_a_second_pipeline_in_the_same_work_dir_is_refused_in_one_line_naming_the_first(tmp_path):
    """Was: the second pipeline started its stages and met the first one's stage lock, a ConcurrentBuildError
    traceback. Now it is refused at once, before touching any stage: one line naming the running pipeline (its pid),
    exit 2. The first pipeline is stood in for by a process holding what a running one holds: the work directory's
    lock and the lock of the stage it is training."""
    work = tmp_path / "work"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from pyterrier_cpdae._locking import build_lock
        Path({str(work / 'pretrain')!r}).mkdir(parents=True)
        with build_lock({str(work)!r}, "work", "used"), build_lock({str(work / 'pretrain' / 'base')!r}, "output", "written"):
            print("holding", flush=True)
            time.sleep(120)
        """)], cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "holding"
        t0 = time.perf_counter()
        second = subprocess.run([warm_python(), "-m", "experiments.paper", *SMOKE, "--work-dir", str(work), "--out",
                                 str(tmp_path / "out"), "--stages", "base", "--no-tables"], cwd=REPO,
                                capture_output=True, text=True, timeout=300,
                                env={**{k: v for k, v in os.environ.items() if k != "PAPER_DEBUG"},
                                     "PYTHONPATH": str(REPO)})
        wall = time.perf_counter() - t0
    finally:
        holder.kill()
        holder.wait()
    assert second.returncode == 2, second.stderr[-3000:]
    assert "Traceback" not in second.stderr
    err = second.stderr.strip().splitlines()
    assert len(err) == 1, second.stderr
    assert err[0].startswith("error: ConcurrentBuildError: the work directory of a paper pipeline")
    assert f"by pid {holder.pid} on host" in err[0]
    assert not (work / "stages").exists() and not (work / "pretrain" / "base").exists()  # no stage touched
    assert not (work / "pretrain" / "base.pid").exists()
    assert wall < 120  # refused at once, not after a stage ran


def test_the_work_dir_lock_is_released_when_the_pipeline_ends(tmp_path, monkeypatch):
    """After a run (however it ends) the next one takes the lock: no stale lock is left behind."""
    from experiments.paper import __main__ as cli
    from pyterrier_cpdae._locking import holder

    seen = []
    monkeypatch.setattr(cli, "run_stages", lambda *a, **kw: seen.append(holder(tmp_path / "w")) or ([], [], []))
    argv = [*SMOKE, "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "o"), "--stages", "negatives:*",
            "--no-tables"]
    cli.main(argv)
    cli.main(argv)
    assert [h["pid"] for h in seen] == [os.getpid(), os.getpid()]  # held while running
    assert holder(tmp_path / "w") is None                               # and released after


# ----------------------------------------------------------------------------- tables written whole
class _Unprintable:
    """A table cell that fails when formatted: a failure in the middle of writing a table."""

    def __str__(self):
        raise OSError(28, "No space left on device")

    __repr__ = __format__ = lambda self, *a: self.__str__()


def _writer(out: Path):
    from experiments.paper.tables import Writer

    cfg = {"scale": "smoke", "sizes_from": "smoke", "config_file": str(REPO / "experiments/configs/paper_smoke.json"),
           "finetune": {}, "finetune_sets": {}}
    w = Writer(out, "python -m experiments.paper --scale smoke", cfg)
    w.header = lambda title: f"# {title}\n\n"  # the header's machine and recipe lines are not what is tested
    return w


def test_a_failure_while_writing_a_table_leaves_the_old_table_whole(tmp_path):
    """Was: table1.md was rewritten, then table1.csv truncated and left half written: a new Markdown table beside a
    broken CSV. Now each file is written to a temporary and renamed: the old files stay, byte for byte."""
    out = tmp_path / "tables"
    w = _writer(out)
    old = pd.DataFrame({"system": ["BM25", "CPDAE"], "nDCG@10": [0.5, 0.6]})
    w.write("table1", "Table 1", [("Results", "old table")], old)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(before) == {"table1.md", "table1.csv"}
    rows = 3000  # several of pandas' write chunks
    new = pd.DataFrame({"system": [f"s{i}" for i in range(rows)], "nDCG@10": [0.7] * (rows - 1) + [_Unprintable()]})
    with pytest.raises(OSError, match="No space left"):
        w.write("table1", "Table 1", [("Results", "new table")], new)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # and no temporary left behind


def test_an_interrupted_rename_leaves_each_file_old_or_new_never_partial(tmp_path, monkeypatch):
    """A kill between the files of a table: the files already renamed are new and whole, the rest old and whole."""
    import pyterrier_cpdae._files as files

    out = tmp_path / "tables"
    w = _writer(out)
    w.write("table2", "Table 2", [("Results", "old")], pd.DataFrame({"a": [1]}))
    real = files.os.replace
    calls = []

    def replace(src, dst):
        calls.append(Path(dst).name)
        if Path(dst).name == "table2.md":
            raise KeyboardInterrupt  # killed before the Markdown file's rename
        return real(src, dst)
    monkeypatch.setattr(files.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        w.write("table2", "Table 2", [("Results", "new")], pd.DataFrame({"a": [2]}))
    monkeypatch.undo()
    assert calls == ["table2.csv", "table2.md"]
    assert pd.read_csv(out / "table2.csv")["a"].tolist() == [2]         # new, whole
    assert "## Results\n\nold" in (out / "table2.md").read_text()      # old, whole
    assert sorted(p.name for p in out.iterdir()) == ["table2.csv", "table2.md"]


def test_no_table_file_is_written_in_place():
    """Tables 1-4, the coverage table and the run summary: no file of theirs is written in place (a plain
    ``write_text``, ``to_csv(path)`` or ``open(path, "w")``); all go through the atomic write tested above."""
    import ast

    for module in ("experiments/paper/table4", "experiments/paper/coverage_figure", "experiments/paper/tables",
                   "experiments/paper/__main__", "pretrain/analysis/coverage"):
        tree = ast.parse((REPO / f"{module}.py").read_text())
        plain = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and (n.func.attr == "write_text" or (n.func.attr == "to_csv" and n.args))]
        opens = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "open"
                 and any(isinstance(a, ast.Constant) and a.value == "w" for a in n.args)]
        assert not plain and not opens, (module, plain, opens)


# ----------------------------------------------------------------------------- --jobs 2 with a failing stage
def _fake_pretrain(fail: set[str], seconds: float = 0.3):
    """Stands in for ``subprocess.run([python, -m, pretrain, ...])``: writes what a finished run leaves, or fails."""
    from pretrain.arguments import parse_args, run_config

    def run(argv, cwd=None, stdout=None, stderr=None, env=None):
        args = [a for a in argv[3:] if a != "--resume"]
        if "--resume_from_checkpoint" in args:
            i = args.index("--resume_from_checkpoint")
            del args[i:i + 2]
        out = Path(args[args.index("--output-dir" if args[0] == "finetune" else "--output_dir") + 1])
        time.sleep(seconds / 6 if out.name in fail else seconds)  # fails while the stage beside it runs
        if out.name in fail:
            stdout.write(f"error: ValueError: {out.name} cannot be trained\n")
            stdout.flush()
            return types.SimpleNamespace(returncode=2)
        out.mkdir(parents=True, exist_ok=True)
        if args[0] == "finetune":
            from pretrain.finetune.train import recorded_options
            (out / "reproduction.json").write_text(json.dumps({"options": recorded_options(args[1:]),
                                                               "finished": True}))
        else:
            cfg = run_config(*parse_args(args)).options()
            (out / "run_config.json").write_text(json.dumps({"config": cfg}))
        (out / "config.json").write_text("{}")
        return types.SimpleNamespace(returncode=0)
    return run


def test_jobs_2_with_a_failing_stage_exits_non_zero_naming_it_and_keeps_the_others(tmp_path, monkeypatch, capsys):
    from experiments.paper import __main__ as cli
    from experiments.paper import stages as st
    from experiments.paper.config import load_config
    from experiments.paper.pipeline import Plan

    work = tmp_path / "w"
    argv = [*SMOKE, "--work-dir", str(work), "--out", str(tmp_path / "o"), "--stages",
            "base,continue:mlm,continue:bow,continue:cpdae", "--no-tables", "--jobs", "2"]
    monkeypatch.delenv("PAPER_DEBUG", raising=False)
    monkeypatch.setattr(st.subprocess, "run", _fake_pretrain(fail={"cpdae"}))
    assert cli._run(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith("error: StageError: stage continue:cpdae failed (exit 2); its log is "
                          f"{work / 'pretrain' / 'cpdae.log'}:\nerror: ValueError: cpdae cannot be trained")
    plan = Plan(load_config("smoke", work_dir=work))
    records = {p.stem for p in (work / "stages").glob("*.json")}
    # the plan's order: base, then mlm and cpdae at once (cpdae fails, mlm finishes), bow not started after it
    assert records == {"base", "continue__mlm"}
    assert [plan.stages[n].state() for n in ("base", "continue:mlm", "continue:cpdae", "continue:bow")] == \
        ["done", "done", "todo", "todo"]
    assert not (work / "pretrain" / "bow.log").exists()
    for name in ("base", "continue:mlm"):  # their records are those of the runs on disk
        rec = json.loads((work / "stages" / f"{name.replace(':', '__')}.json").read_text())
        assert rec["command"] == plan.stages[name].command and rec["output"] == str(plan.stages[name].output)

    monkeypatch.setattr(st.subprocess, "run", _fake_pretrain(fail=set()))
    summary = cli.main(argv)  # the next call runs only what is left
    assert sorted(summary["ran"]) == ["continue:bow", "continue:cpdae"]


def test_an_in_process_stage_failure_is_named_too(tmp_path, monkeypatch, capsys):
    """The smoke scale runs stages in-process: a failure there (any exception) is reported naming the stage."""
    from experiments.paper import __main__ as cli
    from experiments.paper import stages as st

    def boom(self, stage, argv):
        raise ValueError("--corpus: no such file")
    monkeypatch.setattr(st.Runner, "_execute", boom)
    monkeypatch.delenv("PAPER_DEBUG", raising=False)
    assert cli._run([*SMOKE, "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "o"), "--stages", "base",
                     "--no-tables"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: StageError: stage base failed: ValueError: --corpus: no such file"]
