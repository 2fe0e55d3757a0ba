"""The smoke scale end to end (every stage, every objective, tiny sizes), run once for the tests of this file: the
shape of every table (rows, columns, files, not the numbers), a second run that re-runs nothing, the gpu protocol at
smoke sizes in the same work directory, Table 1's DL19 columns, ``--eval-set`` on the finished run and the pilot
beside it. The run is shared (a module fixture) because it is the suite's most expensive step; each test that
changes something writes to its own ``--out`` or to a part of the work directory no other test reads. The smoke
scale reads only the tiny collections the project ships (``experiments/smoke_data``), so these tests run where
``../shared/data`` is absent too.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from tests.helpers.paper_run import REPO, TABLE1_COLS, TABLE1_ROWS
from tests.helpers.paper_run import run_paper as _run
from tests.helpers.warm_python import warm_python


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The smoke scale run once into a fresh work directory: ``(work, out, first run's summary)``."""
    root = tmp_path_factory.mktemp("smoke")
    work, out = root / "work", root / "out"
    first = _run(["--scale", "smoke", "--work-dir", str(work), "--out", str(out)])
    assert first.returncode == 0, first.stderr[-4000:]
    return work, out, json.loads((out / "run.json").read_text())


def _check_tables(out: Path, figures: bool = True) -> None:
    """The shapes of Tables 1-3 and of experiments.csv and stages.csv; with ``figures``, Table 4's and the coverage
    figure's files too."""
    t1 = pd.read_csv(out / "table1.csv")
    assert list(t1[t1["block"] == "zero-shot"]["model"]) == TABLE1_ROWS
    assert list(t1[t1["block"] == "fine-tuned"]["model"]) == TABLE1_ROWS
    assert all(c in t1.columns for c in TABLE1_COLS)
    # MARCO in both blocks; SciFact, Vaswani, Cranfield zero-shot only ("blocks": ["zero-shot"])
    zs, ftb = t1[t1["block"] == "zero-shot"], t1[t1["block"] == "fine-tuned"]
    assert zs[TABLE1_COLS].notna().all().all() and ftb[TABLE1_COLS[:3]].notna().all().all()
    assert ftb[TABLE1_COLS[3:]].isna().all().all()
    assert (t1["status"] == "ok").all(), t1[["block", "model", "status"]]
    md = (out / "table1.md").read_text()
    assert "Command: `python -m experiments.paper" in md and "CPU cores" in md and "## Stages" in md
    t2 = pd.read_csv(out / "table2.csv")
    assert len(t2) == 10 and (t2["status"] == "ok").all()
    assert "CPDAE, CL active (selected τ)" in set(t2["model"])
    # rows over fine-tuning seeds: every fine-tuned MARCO and DL19 cell is a mean ± std over the smoke sizes' 2 seeds
    ft = t1[t1["block"] == "fine-tuned"].set_index("model").drop("BM25")
    assert (ft["MARCO MRR@10 seeds"] == 2).all() and (ft["DL19 nDCG@10 seeds"] == 2).all()
    assert t1[["DL19 nDCG@10", "DL19 MRR@10 (rel>=2)", "DL19 R@1000 (rel>=2)"]].notna().all().all()
    md1 = (out / "table1.md").read_text()
    rows = [line for line in md1.splitlines() if line.startswith("|")]  # (the notes explain the "(1 seed)" mark)
    assert " ± " in md1 and not any("(1 seed)" in line for line in rows) and "ttest_rel" in md1
    assert "CL active" in (out / "table2.md").read_text() and "select_cl.md" in (out / "table2.md").read_text()
    t3 = pd.read_csv(out / "table3.csv")
    assert list(t3.columns) == ["Model", "training queries", "runs", "R@100 mean", "R@100 std", "R@100 min",
                                "R@100 max", "RR@10 mean", "RR@10 std", "nDCG@10 mean", "nDCG@10 std"]
    assert list(t3["Model"]) == ["BERT", "BERT", "SEED", "SEED", "CPDAE", "CPDAE"] and (t3["runs"] == 2).all()
    exps = pd.read_csv(out / "experiments.csv")
    assert {"R@100 p-value", "eval_set", "block", "baseline"} <= set(exps.columns)
    stages = pd.read_csv(out / "stages.csv")
    assert (stages["status"] == "done").all()
    seqs = stages.set_index("stage")["encoder sequences"]
    assert seqs["continue:cpdae"] == 2 * seqs["continue:mlm"] > 0   # two masked views per text
    for name in ("table4", "coverage") if figures else ():
        assert (out / f"{name}.md").exists() or (out / name).is_dir()


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
def test_smoke_scale_end_to_end_then_reuses_everything(smoke, tmp_path):
    work, out, summary = smoke
    _check_tables(out)
    assert "continue:cpdae" in summary["ran"] and "finetune:marco:cpdae:s1" in summary["ran"]  # core rows: seeded
    again_out = tmp_path / "out"
    # Tables 1-3 need every stage and every index (Table 4 and the coverage figure read the continuations' checkpoints
    # only and cache nothing: made again, they would repeat the first run's computation, checked above)
    second = _run(["--scale", "smoke", "--work-dir", str(work), "--out", str(again_out), "--tables", "1,2,3"])
    assert second.returncode == 0, second.stderr[-4000:]
    again = json.loads((again_out / "run.json").read_text())
    assert again["ran"] == [] and again["skipped"] == []
    assert "indexed" not in second.stdout                # every index and run reused
    assert again["stage_seconds"] < 120                  # only the plan's state checks
    _check_tables(again_out, figures=False)
    for name in ("table1.csv", "table2.csv", "table3.csv"):  # made again from the saved runs: the same figures
        pd.testing.assert_frame_equal(pd.read_csv(again_out / name), pd.read_csv(out / name))

    # the gpu protocol at smoke sizes: the very same stage commands (the gpu scale only changes sizes), so in the same
    # work directory every stage it needs is done (its dry run states each one: the check a run makes before it would
    # run a stage), and its tables name the protocol and the sizes
    gpu = _run(["--scale", "gpu", "--sizes", "smoke", "--work-dir", str(work), "--dry-run"])
    assert gpu.returncode == 0, gpu.stderr[-4000:]
    assert "scale gpu (sizes smoke)" in gpu.stdout
    states = dict(line[1:].split("] ", 1) for line in gpu.stdout.splitlines() if line.startswith("["))
    assert set(states) == set(pd.read_csv(out / "stages.csv")["stage"]) and set(states.values()) == {"done"}, states
    from experiments.paper.config import load_config
    from experiments.paper.tables import Writer
    gpu_cfg = load_config("gpu", sizes="smoke", work_dir=work)
    header = Writer(tmp_path / "gpu_out", "python -m experiments.paper --scale gpu --sizes smoke", gpu_cfg).header("T")
    assert "Scale: `gpu` with the sizes of `smoke`" in header


@pytest.mark.slow
def test_smoke_pipeline_writes_table1_with_the_dl19_column(smoke):
    work, out, _ = smoke
    t1 = pd.read_csv(out / "table1.csv")
    cols = ["DL19 nDCG@10", "DL19 MRR@10 (rel>=2)", "DL19 R@1000 (rel>=2)"]
    ok = t1[t1["status"] == "ok"]
    assert list(ok[ok["block"] == "fine-tuned"]["model"]) == TABLE1_ROWS
    assert list(ok[ok["block"] == "zero-shot"]["model"]) == TABLE1_ROWS
    assert ok[cols].notna().all().all() and ((ok[cols] >= 0) & (ok[cols] <= 1)).all().all()
    ft = ok[ok["block"] == "fine-tuned"].set_index("model").drop("BM25")
    assert (ft["DL19 nDCG@10 seeds"] == 2).all()
    md = (out / "table1.md").read_text()
    assert "judged pool" in md and "(rel>=2)" in md and "unequal seed counts" in md
    exps = pd.read_csv(out / "experiments.csv")
    dl = exps[(exps["eval_set"] == "dl19") & (exps["block"] == "fine-tuned")]
    assert dl["nDCG@10 p-value vs bert"].notna().any()                  # significance against the BERT row
    assert json.loads((work / "data" / "dl19" / "materialised.json").read_text())["num_queries"] == 2


@pytest.mark.slow
def test_eval_set_adds_a_collection_to_a_finished_run_without_training(smoke, tmp_path):
    work, out, summary = smoke
    # a new collection on an unfinished run is refused, naming what is missing
    refused = _run(["--scale", "smoke", "--work-dir", str(tmp_path / "unfinished"), "--out", str(tmp_path / "o"),
                    "--eval-set", "extra=trec:experiments/smoke_data/vaswani"])
    assert refused.returncode != 0 and "not finished: base" in refused.stderr, refused.stderr[-2000:]
    assert "select:cl" in summary["ran"] and "continue:cpdae_clactive" in summary["ran"]
    assert "extra nDCG@10" not in pd.read_csv(out / "table1.csv").columns
    sel = json.loads((out / "select_cl.json").read_text())
    assert sel["chosen"]["setting"] in [{"temperature": 1.0}, {"temperature": 0.05, "cl_reduction": "sum"}]
    assert all(len(c["curve"]) == 2 for c in sel["candidates"])          # one L_CL value per step (2 steps)

    extra_out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([warm_python(), "-c", _NO_TRAINING, "--scale", "smoke", "--work-dir", str(work), "--out",
                           str(extra_out), "--eval-set", "extra=trec:experiments/smoke_data/vaswani"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    again = json.loads(proc.stdout.strip().splitlines()[-1])
    assert again["ran"] == [] and again["skipped"] == []
    t1 = pd.read_csv(extra_out / "table1.csv")
    assert {"extra nDCG@10", "extra R@100"} <= set(t1.columns)
    ok = t1[t1["status"] == "ok"]
    assert ok["extra nDCG@10"].notna().all()
    assert list(ok[ok["block"] == "fine-tuned"]["model"]) == TABLE1_ROWS
    assert "extra nDCG@10" in pd.read_csv(extra_out / "table2.csv").columns
    assert (work / "indices" / "extra").is_dir()                        # evaluated from the saved checkpoints


@pytest.mark.slow
def test_pilot_runs_at_smoke_sizes_on_training_queries_only(smoke, tmp_path):
    """The pilot in the smoke run's work directory (its protocol stages are finished there)."""
    work = smoke[0]
    out = tmp_path / "pilot.md"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([warm_python(), "-m", "experiments.paper.pilot", "--scale", "smoke", "--work-dir",
                           str(work), "--out", str(out), "--lengths", "0,2", "--seeds", "1,2",
                           "--head-steps", "2"], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rep = json.loads(out.with_suffix(".json").read_text())
    md = out.read_text()
    assert "## 1. Is the frozen head warm-up needed?" in md and "## 2. Continuation length" in md
    assert len(rep["head"]) == 4 and all(v is not None for v in rep["head"].values())
    assert [len(c["per_seed"]) for c in rep["continuation"].values()] == [2, 2]
    # length 2 is the smoke protocol's own continuation: the pilot used the protocol's stage (finished here), no copy
    assert (work / "pretrain" / "cpdae" / "run_config.json").exists()
    assert not (work / "pilot" / "cpdae_L2").exists()
    # the pilot's queries are the training split's only: pilot_dev and pilot_train partition it
    split = json.loads((work / "pilot" / "split.json").read_text())
    train = set(map(str, json.loads((REPO / "experiments/smoke_data/msmarco_sample_split.json").read_text())["train"]))
    assert set(split["pilot_dev"]) | set(split["pilot_train"]) == train
    assert not set(split["pilot_dev"]) & set(split["pilot_train"])
    # a pilot of another objective reuses the base's fine-tunings (length 0 does not depend on the objective)
    proc = subprocess.run([warm_python(), "-m", "experiments.paper.pilot", "--scale", "smoke", "--work-dir",
                           str(work), "--out", str(tmp_path / "pilot_mlm.md"), "--objective", "mlm",
                           "--lengths", "0,3", "--seeds", "1,2", "--head-steps", "2"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    mlm = json.loads((tmp_path / "pilot_mlm.json").read_text())
    assert mlm["continuation"]["0"] == rep["continuation"]["0"]
    assert not (work / "pilot" / "finetune" / "mlm_L0_s1").exists()
    assert (work / "pilot" / "finetune" / "mlm_L3_s1" / "reproduction.json").exists()
    assert len(mlm["continuation"]["3"]["per_seed"]) == 2
