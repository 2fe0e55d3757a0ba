"""`--eval-set` on a finished smoke run, and the pilot at smoke sizes (split from test_paper_pipeline.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from _paper_run import REPO
from _paper_run import need_data as _need_data
from _paper_run import run_paper as _run


# ----------------------------------------------------------------------------- --eval-set on a finished smoke run
def _small_smoke_stand_ins(root: Path) -> Path:
    """The smoke scale with fewer objectives and collections (same code path): mlm, cpdae and the CL-active row
    (its selection included), MARCO sample (2 seeds for the core rows) and Cranfield."""
    root.mkdir(parents=True)
    keep = {"mlm", "cpdae", "cpdae_clactive"}
    drop = {o: None for o in ("seed", "bow", "retromae", "simcse", "ict", "prop", "cpdae_r", "cpdae_nocl",
                              "cpdae_idfrec", "cpdae_clsum")}
    assert not keep & set(drop)
    (root / "overrides.json").write_text(json.dumps({
        "objectives": drop, "finetune_sets": {"scifact": None},
        "eval_sets": {"scifact_dev": None, "vaswani": None},
        "tables": {"table3": {"models": []}, "table4": {"models": ["cpdae", "cpdae_clactive"]}}}))
    return root


#: ``python -c`` driver: ``experiments.paper`` with every way of training or mining replaced by a failure, so that a
#: run that trains anything fails; prints the summary as JSON. (A fresh interpreter: ir_datasets fixes a dataset's
#: home when it is first imported, so the pipeline's own IR_DATASETS_HOME must come before any other test's.)
_NO_TRAINING = """
import json, sys
from experiments.paper import __main__ as paper, pipeline, select_tau
from experiments.paper.stages import Runner
def no_training(*args, **kw):
    raise AssertionError("a stage ran during --eval-set")
Runner._execute = no_training
paper.mine_negatives = no_training
pipeline.mine_negatives = no_training
select_tau.run_selection = no_training
print(json.dumps(paper.main(sys.argv[1:]), default=str))
"""


@pytest.mark.slow
def test_eval_set_adds_a_collection_to_a_finished_run_without_training(tmp_path):
    _need_data()
    stand = _small_smoke_stand_ins(tmp_path / "stand")
    work, out = tmp_path / "work", tmp_path / "out"
    common = ["--scale", "smoke", "--stand-ins", str(stand), "--work-dir", str(work), "--out", str(out)]
    # a new collection on an unfinished run is refused, naming what is missing
    refused = _run([*common, "--eval-set", "extra=trec:../shared/data/vaswani"])
    assert refused.returncode != 0 and "not finished: base" in refused.stderr, refused.stderr[-2000:]
    done = _run([*common, "--tables", "1,2"])
    assert done.returncode == 0, done.stderr[-4000:]
    first = json.loads((out / "run.json").read_text())
    assert "select:cl" in first["ran"] and "continue:cpdae_clactive" in first["ran"]
    t1 = pd.read_csv(out / "table1.csv")
    assert "Vaswani nDCG@10" not in t1.columns
    sel = json.loads((out / "select_cl.json").read_text())
    assert sel["chosen"]["setting"] in [{"temperature": 1.0}, {"temperature": 0.05, "cl_reduction": "sum"}]
    assert all(len(c["curve"]) == 2 for c in sel["candidates"])          # one L_CL value per step (2 steps)

    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", _NO_TRAINING, *common, "--eval-set", "extra=trec:../shared/data/vaswani"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    again = json.loads(proc.stdout.strip().splitlines()[-1])
    assert again["ran"] == [] and again["skipped"] == []
    t1 = pd.read_csv(out / "table1.csv")
    assert {"extra nDCG@10", "extra R@100"} <= set(t1.columns)
    ok = t1[t1["status"] == "ok"]
    assert ok["extra nDCG@10"].notna().all()
    assert set(ok[ok["block"] == "fine-tuned"]["model"]) == {"BM25", "BERT", "MLM", "CPDAE"}
    assert "extra nDCG@10" in pd.read_csv(out / "table2.csv").columns
    assert (work / "indices" / "extra").is_dir()                        # evaluated from the saved checkpoints


@pytest.mark.slow
def test_pilot_runs_at_smoke_sizes_on_training_queries_only(tmp_path):
    _need_data()
    out = tmp_path / "pilot.md"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "experiments.paper.pilot", "--scale", "smoke", "--work-dir",
                           str(tmp_path / "work"), "--out", str(out), "--lengths", "0,2", "--seeds", "1,2",
                           "--head-steps", "2"], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rep = json.loads(out.with_suffix(".json").read_text())
    md = out.read_text()
    assert "## 1. Is the frozen head warm-up needed?" in md and "## 2. Continuation length" in md
    assert len(rep["head"]) == 4 and all(v is not None for v in rep["head"].values())
    assert [len(c["per_seed"]) for c in rep["continuation"].values()] == [2, 2]
    # length 2 is the smoke protocol's own continuation: the pilot ran the protocol's stage, not a copy of it
    assert (tmp_path / "work" / "pretrain" / "cpdae" / "run_config.json").exists()
    assert not (tmp_path / "work" / "pilot" / "cpdae_L2").exists()
    # the pilot's queries are the training split's only: pilot_dev and pilot_train partition it
    split = json.loads((tmp_path / "work" / "pilot" / "split.json").read_text())
    train = set(map(str, json.loads((REPO / "experiments/configs/msmarco_sample_split.json").read_text())["train"]))
    assert set(split["pilot_dev"]) | set(split["pilot_train"]) == train
    assert not set(split["pilot_dev"]) & set(split["pilot_train"])
    # a pilot of another objective reuses the base's fine-tunings (length 0 does not depend on the objective)
    proc = subprocess.run([sys.executable, "-m", "experiments.paper.pilot", "--scale", "smoke", "--work-dir",
                           str(tmp_path / "work"), "--out", str(tmp_path / "pilot_mlm.md"), "--objective", "mlm",
                           "--lengths", "0,3", "--seeds", "1,2", "--head-steps", "2"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    mlm = json.loads((tmp_path / "pilot_mlm.json").read_text())
    assert mlm["continuation"]["0"] == rep["continuation"]["0"]
    assert not (tmp_path / "work" / "pilot" / "finetune" / "mlm_L0_s1").exists()
    assert (tmp_path / "work" / "pilot" / "finetune" / "mlm_L3_s1" / "training_args.json").exists()
    assert len(mlm["continuation"]["3"]["per_seed"]) == 2
