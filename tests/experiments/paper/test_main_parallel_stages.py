"""``python -m experiments.paper --jobs N``: independent stages run at once, a stage never before what it reads."""
from __future__ import annotations

import os
import threading
import time

import pytest

from experiments.paper.__main__ import parse_args, run_stages


class FakeStage:
    def __init__(self, name, needs, log, fail=False, seconds=0.05):
        self.name, self.needs, self.log, self.fail = name, needs, log, fail
        self.seconds = 0.01 if fail else seconds  # fails while the others it started with still run
        self.done = False

    def state(self):
        return "done" if self.done else "todo"

    def finished(self):
        return self.done


class FakePlan:
    """Stages with declared needs; ``selections`` and negatives are not used here."""

    selections: dict = {}

    def __init__(self, spec, log, fail=()):
        self.stages = {n: FakeStage(n, needs, log, fail=n in fail) for n, needs in spec.items()}

    def needs_of(self, name):
        return list(self.stages[name].needs)

    def is_done(self, name):
        return self.stages[name].done


class FakeRunner:
    def __init__(self, log):
        self.log = log
        self.lock = threading.Lock()
        self.active = 0
        self.max_active = 0

    def run(self, stage):
        with self.lock:
            # every stage it reads must be finished before it starts
            self.log.append(("start", stage.name, time.perf_counter()))
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        time.sleep(stage.seconds)
        with self.lock:
            self.active -= 1
            self.log.append(("end", stage.name, time.perf_counter()))
        if stage.fail:
            raise RuntimeError(f"stage {stage.name} failed (exit 1)")
        stage.done = True
        return {"stage": stage.name}


SPEC = {"base": [], **{f"continue:{o}": ["base"] for o in "abcdef"},
        **{f"finetune:{o}:s{s}": [f"continue:{o}"] for o in "abcdef" for s in (1, 2)}}


def _times(log):
    start = {n: t for kind, n, t in log if kind == "start"}
    end = {n: t for kind, n, t in log if kind == "end"}
    return start, end


@pytest.mark.parametrize("jobs", [1, 3])
def test_no_stage_starts_before_the_stages_it_reads_and_at_most_jobs_run_at_once(jobs):
    log = []
    plan, runner = FakePlan(SPEC, log), FakeRunner(log)
    ran, skipped, deferred = run_stages(plan, {}, runner, list(SPEC), jobs=jobs)
    assert sorted(ran) == sorted(SPEC) and not skipped and not deferred
    start, end = _times(log)
    for name, needs in SPEC.items():
        for need in needs:
            assert start[name] >= end[need], (name, need)
    assert runner.max_active == jobs  # 1 serially; 3 at once where 6 continuations are ready together


def test_three_jobs_are_faster_than_one_on_independent_stages():
    walls = {}
    for jobs in (1, 3):
        log = []
        t0 = time.perf_counter()
        run_stages(FakePlan(SPEC, log), {}, FakeRunner(log), list(SPEC), jobs=jobs)
        walls[jobs] = time.perf_counter() - t0
    # 19 stages of 0.05 s: 0.95 s serially; base, then 6 continuations in 2 waves, then 12 fine-tunings in 4
    assert walls[3] < 0.6 * walls[1], walls


def test_a_failed_stage_stops_new_starts_lets_the_running_finish_and_is_raised():
    log = []
    plan = FakePlan(SPEC, log, fail={"continue:b"})
    runner = FakeRunner(log)
    with pytest.raises(RuntimeError, match="stage continue:b failed"):
        run_stages(plan, {}, runner, list(SPEC), jobs=3)
    start, end = _times(log)
    assert set(start) == set(end)  # nothing left running
    assert "finetune:b:s1" not in start  # its need failed
    t_fail = end["continue:b"]
    assert all(t <= t_fail for n, t in start.items())  # nothing started after the failure
    assert plan.stages["continue:a"].done and plan.stages["continue:c"].done  # the ones in flight finished


def test_a_stage_whose_need_is_neither_finished_nor_chosen_is_skipped():
    log = []
    plan = FakePlan(SPEC, log)
    ran, skipped, _ = run_stages(plan, {}, FakeRunner(log), ["continue:a", "finetune:a:s1"], jobs=2)
    assert ran == [] and skipped == ["continue:a", "finetune:a:s1"]
    plan.stages["base"].done = True
    ran, skipped, _ = run_stages(plan, {}, FakeRunner(log), ["continue:a", "finetune:a:s1", "finetune:b:s1"], jobs=2)
    assert ran == ["continue:a", "finetune:a:s1"] and skipped == ["finetune:b:s1"]


def test_after_the_deadline_no_stage_starts_and_the_rest_is_deferred():
    log = []
    plan = FakePlan(SPEC, log)
    ran, _, deferred = run_stages(plan, {}, FakeRunner(log), list(SPEC), jobs=2, deadline_s=0.0,
                                  t0=time.perf_counter() - 1)
    assert ran == [] and deferred == list(SPEC)


def test_jobs_option_is_checked():
    assert parse_args(["--jobs", "4"]).jobs == 4
    with pytest.raises(SystemExit):
        parse_args(["--jobs", "0"])


@pytest.mark.slow
@pytest.mark.multiproc
def test_smoke_continuations_run_two_at_a_time_as_real_processes(tmp_path, warm_children):
    import json

    from experiments.paper.__main__ import main

    # (that no more than --jobs run at once, a third waiting for a free slot, is checked on stand-in stages above)
    summary = main(["--scale", "smoke", "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "o"),
                    "--stages", "base,continue:mlm,continue:cpdae", "--no-tables", "--jobs", "2"])
    assert summary["ran"][0] == "base" and sorted(summary["ran"][1:]) == ["continue:cpdae", "continue:mlm"]
    recs = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "w" / "stages").glob("*.json")}
    assert set(recs) == {"base", "continue__mlm", "continue__cpdae"}
    for name in ("mlm", "cpdae"):  # each its own process, with its own log, and a finished model
        out = tmp_path / "w" / "pretrain" / name
        assert (out / "config.json").exists() and (out.parent / f"{name}.log").exists()
        assert recs[f"continue__{name}"]["wall_how"] == "measured by the pipeline"
    # two at a time: the two continuations together took less than the sum of their walls
    walls = sum(recs[f"continue__{n}"]["wall_s"] for n in ("mlm", "cpdae"))
    assert summary["stage_seconds"] - recs["base"]["wall_s"] < walls


def test_concurrent_stage_processes_share_the_cores(tmp_path, monkeypatch):
    """With --jobs N each stage process gets OMP_NUM_THREADS = cores // N (unless the caller set it)."""
    import types

    from experiments.paper import __main__ as cli
    from experiments.paper import stages as st

    seen = {}

    def fake_run(argv, cwd=None, stdout=None, stderr=None, env=None):
        seen["env"] = env
        return types.SimpleNamespace(returncode=0)
    monkeypatch.setattr(st.subprocess, "run", fake_run)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cli.os, "cpu_count", lambda: 16)
    made = {}
    real_runner = st.Runner

    def capture(*a, **kw):
        made["runner"] = real_runner(*a, **kw)
        return made["runner"]
    monkeypatch.setattr(st, "Runner", capture)
    monkeypatch.setattr(cli, "run_stages", lambda *a, **kw: ([], [], []))  # only the runner's set-up is checked
    cli.main(["--scale", "smoke", "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "o"), "--stages",
              "negatives:*", "--no-tables", "--jobs", "4"])
    runner = made["runner"]
    assert runner.mode == "subprocess" and runner.env == {"OMP_NUM_THREADS": "4"}
    stage = types.SimpleNamespace(name="x", output=tmp_path / "out" / "x")
    (tmp_path / "out").mkdir()
    runner._execute(stage, ["--help"])
    assert seen["env"]["OMP_NUM_THREADS"] == "4" and seen["env"]["PATH"] == os.environ["PATH"]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the caller's choice is kept
    cli.main(["--scale", "smoke", "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "o"), "--stages",
              "negatives:*", "--no-tables", "--jobs", "4"])
    assert made["runner"].env == {}
