"""Tests of pretrain.training.trainer.Trainer on a tiny deterministic regression task (tests/_train_worker.py)."""
from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from _warm_python import torchrun, warm_python
import torch

from _train_worker import RegressionData, TinyRegressor, collate, collate_clean
from pretrain.config import TrainConfig
from pretrain.logging_utils import read_metrics, summarize_metrics
from pretrain.training.checkpoint import list_checkpoints
from pretrain.training.optim import parameter_groups, resolve_mixed_precision
from pretrain.training.run_dir import check_output_dir
from pretrain.training.sampler import GlobalBatchSampler
from pretrain.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]


def cfg(tmp_path: Path, name: str = "run", **kw) -> TrainConfig:
    base = dict(output=str(tmp_path / name), batch_size=8, max_steps=12, learning_rate=0.05, warmup_ratio=0.1,
                logging_steps=1, save_steps=4, save_total_limit=2, seed=3, weight_decay=0.01)
    base.update(kw)
    return TrainConfig(**base)


def losses(output: str, cols=("loss", "mse", "l1", "lr")) -> list[tuple[int, ...]]:
    return [(r["step"],) + tuple(r[c] for c in cols) for r in read_metrics(os.path.join(output, "logs", "metrics.csv"))]


def assert_same_losses(a, b, rel=1e-5):
    assert [r[0] for r in a] == [r[0] for r in b]
    for ra, rb in zip(a, b):
        for x, y in zip(ra[1:], rb[1:]):
            assert x == pytest.approx(y, rel=rel, abs=1e-7), (ra, rb)


def test_loss_curves_need_two_logged_rows(tmp_path, caplog):
    """A run that logged one row draws no curve (and says so); two rows are plotted as PNG + SVG."""
    one = cfg(tmp_path, "one", max_steps=2, logging_steps=2, save_steps=100)
    with caplog.at_level("INFO", logger="pretrain.training.trainer"):
        Trainer(TinyRegressor(dropout=0.0), RegressionData(64), collate, one).train()
    logs = Path(one.output) / "logs"
    assert len(read_metrics(str(logs / "metrics.csv"))) == 1
    assert not (logs / "loss_curves.png").exists() and not (logs / "loss_curves.svg").exists()
    assert "loss curves not plotted" in caplog.text and "holds 1 logged row" in caplog.text
    two = cfg(tmp_path, "two", max_steps=2, logging_steps=1, save_steps=100)
    Trainer(TinyRegressor(dropout=0.0), RegressionData(64), collate, two).train()
    logs = Path(two.output) / "logs"
    assert len(read_metrics(str(logs / "metrics.csv"))) == 2
    assert (logs / "loss_curves.png").stat().st_size > 1000 and (logs / "loss_curves.svg").stat().st_size > 1000


def test_loss_falls_and_outputs(tmp_path):
    c = cfg(tmp_path, max_steps=40, learning_rate=0.1)
    module = TinyRegressor(dropout=0.0)
    result = Trainer(module, RegressionData(64), collate, c).train()
    s = {r["name"]: r for r in summarize_metrics(os.path.join(c.output, "logs", "metrics.csv"), window=5)}
    assert set(s) == {"loss", "mse", "l1"}
    assert all(r["last"] < 0.5 * r["first"] for r in s.values()), s
    out = Path(c.output)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert not (out / ".export-tmp").exists()
    assert (out / "logs" / "loss_curves.png").stat().st_size > 1000
    assert any((out / "logs" / "tb").iterdir())  # the default --report-to: csv,tensorboard
    run = json.loads((out / "run_config.json").read_text())
    assert run["config"]["batch_size"] == 8 and run["trainer"]["total_steps"] == 40
    # save_total_limit=2: only the two newest checkpoints remain (the last one is the final step)
    assert [s for s, _ in list_checkpoints(c.output)] == [36, 40]
    assert result["step"] == 40
    # on_step is called after every optimizer step with the total
    assert module.steps_seen == [(i, 40) for i in range(1, 41)]


def test_lr_schedule_matches_formula(tmp_path):
    c = cfg(tmp_path, max_steps=20, warmup_ratio=0.1, learning_rate=0.01)
    Trainer(TinyRegressor(), RegressionData(64), collate, c).train()
    rows = read_metrics(os.path.join(c.output, "logs", "metrics.csv"))
    total, warm = 20, math.ceil(0.1 * 20)
    for r in rows:
        k = r["step"] - 1  # optimizer steps taken before this update
        expected = 0.01 * (k / warm if k < warm else max(0.0, (total - k) / (total - warm)))
        assert r["lr"] == pytest.approx(expected, abs=1e-12)


def test_epochs_define_total_steps(tmp_path):
    # 64 examples, global batch 8 -> 8 steps per epoch; 1.5 epochs -> 12 steps; the data order covers
    # each example exactly once per epoch
    c = cfg(tmp_path, max_steps=-1, epochs=1.5, save_steps=1000)
    t = Trainer(TinyRegressor(), RegressionData(64), collate, c)
    assert (t.steps_per_epoch, t.total_steps) == (8, 12)
    assert t.train()["step"] == 12
    sampler = GlobalBatchSampler(64, 8, seed=3)
    assert sorted(sampler) == list(range(64))


def test_sampler_shards_global_batches():
    # the union of all ranks' micro-batches of a step is the global batch of the single-process order
    single = list(GlobalBatchSampler(40, 8, grad_accum=1, world_size=1, seed=1))
    shards = [list(GlobalBatchSampler(40, 8, grad_accum=2, rank=r, world_size=2, seed=1)) for r in range(2)]
    for s in range(5):
        got = set()
        for r in range(2):
            got |= set(shards[r][s * 4:(s + 1) * 4])
        assert got == set(single[s * 8:(s + 1) * 8])
    sm = GlobalBatchSampler(40, 8, seed=1)
    sm.set_position(0, 3)
    assert list(sm) == single[24:40] and len(sm) == 16
    with pytest.raises(ValueError, match="divisible"):
        GlobalBatchSampler(40, 6, grad_accum=4)


def test_grad_accum_equivalence(tmp_path):
    """Batch 8 in one step == batch 8 as 2 accumulated micro-batches of 4 (same update)."""
    weights = []
    for accum in (1, 2):
        c = cfg(tmp_path, name=f"acc{accum}", grad_accum=accum, max_steps=3, save_steps=1000, warmup_ratio=0.0,
                learning_rate=0.1)
        m = TinyRegressor(dropout=0.0, seed=0)
        Trainer(m, RegressionData(64), collate_clean, c).train()
        weights.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    assert not torch.allclose(weights[0], TinyRegressor(dropout=0.0, seed=0).linear.weight.new_zeros(1))
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-5, atol=1e-6)
    assert losses(str(tmp_path / "acc1"))[0][1] == pytest.approx(losses(str(tmp_path / "acc2"))[0][1], rel=1e-6)


def test_resume_after_crash_reproduces_loss_sequence(tmp_path):
    """A run that dies after its step-8 checkpoint, resumed, logs the same losses as an uninterrupted run.

    Dropout and the collate noise use torch's global RNG, so this needs RNG restoration; logging every 3
    steps with checkpoints every 4 also needs the unlogged loss window restored.
    """
    kw = dict(max_steps=14, save_steps=4, logging_steps=3, save_total_limit=3)
    full = cfg(tmp_path, "full", **kw)
    Trainer(TinyRegressor(), RegressionData(64), collate, full).train()

    crash = cfg(tmp_path, "crash", **kw)
    with pytest.raises(RuntimeError, match="simulated crash"):
        Trainer(TinyRegressor(fail_after=10), RegressionData(64), collate, crash).train()
    assert [s for s, _ in list_checkpoints(crash.output)] == [4, 8]
    assert not (Path(crash.output) / "config.json").exists()  # no export from the dead run
    # a plain re-run is refused (it would discard the checkpoints)
    with pytest.raises(ValueError, match="--resume"):
        check_output_dir(crash)
    resumed = cfg(tmp_path, "crash", resume=True, **kw)
    module = TinyRegressor(seed=123)  # different init: must be overwritten by the checkpoint
    Trainer(module, RegressionData(64), collate, resumed).train()
    assert module.steps_seen[0] == (8, 14)
    assert_same_losses(losses(full.output), losses(crash.output))
    from safetensors.torch import load_file
    a = load_file(os.path.join(full.output, "checkpoints", "checkpoint-14", "rng_state_0.safetensors"))
    b = load_file(os.path.join(crash.output, "checkpoints", "checkpoint-14", "rng_state_0.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_before_first_checkpoint_starts_from_scratch(tmp_path):
    """A run killed before its first checkpoint, resumed, starts over (with a warning) and logs the same losses
    as an uninterrupted run; it used to fail with an IndexError on the empty checkpoint list."""
    kw = dict(max_steps=10, save_steps=4, logging_steps=1)
    full = cfg(tmp_path, "full", **kw)
    Trainer(TinyRegressor(), RegressionData(64), collate, full).train()
    crash = cfg(tmp_path, "crash", **kw)
    with pytest.raises(RuntimeError, match="simulated crash"):
        Trainer(TinyRegressor(fail_after=2), RegressionData(64), collate, crash).train()
    assert list_checkpoints(crash.output) == [] and os.path.isdir(crash.output)
    module = TinyRegressor()
    Trainer(module, RegressionData(64), collate, cfg(tmp_path, "crash", resume=True, **kw)).train()
    assert module.steps_seen[0] == (1, 10)
    assert_same_losses(losses(full.output), losses(crash.output))


def test_output_dir_protection(tmp_path):
    c = cfg(tmp_path, max_steps=4)
    Trainer(TinyRegressor(), RegressionData(64), collate, c).train()
    # a different config is refused, naming the differing option
    with pytest.raises(ValueError, match="different run.*--learning-rate: 0.05 -> 1.0"):
        Trainer(TinyRegressor(), RegressionData(64), collate, cfg(tmp_path, max_steps=4, learning_rate=1.0)).train()
    # the same config over a finished run without --resume is refused too
    with pytest.raises(ValueError, match="--resume"):
        Trainer(TinyRegressor(), RegressionData(64), collate, cfg(tmp_path, max_steps=4)).train()
    # a foreign non-empty directory is refused
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        check_output_dir(cfg(tmp_path, "foreign"))
    assert (foreign / "notes.txt").read_text() == "mine"
    # --overwrite replaces the run
    Trainer(TinyRegressor(), RegressionData(64), collate, cfg(tmp_path, max_steps=4, learning_rate=1.0,
                                                              overwrite=True)).train()
    assert json.loads((Path(c.output) / "run_config.json").read_text())["config"]["learning_rate"] == 1.0
    # resume may change max_steps only where the steps taken keep their rates: 4 steps (warm-up 1) as 6 differ at
    # step 3 (2/3 of the peak rate, a 6-step run gives 4/5): refused, the run's record unchanged
    with pytest.raises(ValueError, match=r"--resume refused: .*\(step 3: x0\.8 of the peak rate, not x0\.666667"):
        Trainer(TinyRegressor(), RegressionData(64), collate, cfg(tmp_path, max_steps=6, learning_rate=1.0,
                                                                  resume=True)).train()
    assert json.loads((Path(c.output) / "run_config.json").read_text())["config"]["max_steps"] == 4
    t = Trainer(TinyRegressor(), RegressionData(64), collate, cfg(tmp_path, max_steps=4, learning_rate=1.0,
                                                                  resume=True))
    assert t.train()["step"] == 4
    assert len(read_metrics(os.path.join(c.output, "logs", "metrics.csv"))) == 4


def test_failed_export_does_not_look_complete(tmp_path):
    c = cfg(tmp_path, max_steps=2, save_steps=1000)

    def bad_save(module, path):
        with open(os.path.join(path, "model.safetensors"), "w") as f:
            f.write("partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        Trainer(TinyRegressor(), RegressionData(64), collate, c, save_fn=bad_save).train()
    assert not (Path(c.output) / "config.json").exists()
    assert not (Path(c.output) / "model.safetensors").exists()


def test_bad_configs(tmp_path):
    with pytest.raises(ValueError, match="divisible"):
        Trainer(TinyRegressor(), RegressionData(64), collate, cfg(tmp_path, batch_size=6, grad_accum=4))
    with pytest.raises(ValueError, match="fewer than one global batch"):
        Trainer(TinyRegressor(), RegressionData(5), collate, cfg(tmp_path, batch_size=8))
    with pytest.raises(ValueError, match="output"):
        Trainer(TinyRegressor(), RegressionData(64), collate, cfg(tmp_path, output=None))
    with pytest.raises(ValueError, match="save_pretrained"):
        Trainer(torch.nn.Linear(2, 2), RegressionData(64), collate, cfg(tmp_path))
    with pytest.raises(ValueError, match="gradient checkpointing"):
        Trainer(TinyRegressor(), RegressionData(64), collate, cfg(tmp_path, gradient_checkpointing=True)).train()
    if not torch.cuda.is_available():
        assert resolve_mixed_precision("auto") == "no"
        with pytest.raises(ValueError, match="fp16"):
            resolve_mixed_precision("fp16")


def test_no_weight_decay_on_bias_and_norm():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    groups = parameter_groups(m, 0.1)
    decay = {id(p) for p in groups[0]["params"]}
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert decay == {id(m[0].weight)}
    assert {id(p) for p in groups[1]["params"]} == {id(m[0].bias), id(m[1].weight), id(m[1].bias)}


@pytest.mark.multiproc
def test_ddp_two_processes_match_single_process(tmp_path):
    """torchrun with 2 CPU processes (gloo) and global batch 8 logs the losses of 1 process with batch 8."""
    common = ["--batch-size", "8", "--max-steps", "6", "--logging-steps", "1", "--save-steps", "1000",
              "--learning-rate", "0.05", "--seed", "3", "--clean"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    single = tmp_path / "single"
    subprocess.run([warm_python(), str(REPO / "tests" / "_train_worker.py"), str(single), *common],
                   check=True, env=env, capture_output=True, timeout=300)
    ddp = tmp_path / "ddp"
    proc = subprocess.run(torchrun(["--standalone", "--nproc_per_node", "2"],
                                   [str(REPO / "tests" / "_train_worker.py"), str(ddp), *common, "--grad-accum", "2"]),
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads((ddp / "run_config.json").read_text())
    assert run["trainer"]["world_size"] == 2 and run["trainer"]["micro_batch_size"] == 2
    # same global batches, gradients averaged over ranks and micro-batches: the same losses (averaged
    # over processes in the log) and the same exported weights
    assert_same_losses(losses(str(single)), losses(str(ddp)), rel=1e-5)
    from safetensors.torch import load_file
    wa, wb = load_file(str(single / "model.safetensors")), load_file(str(ddp / "model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)


def test_summarize_metrics_hand_computed(tmp_path):
    from pretrain.logging_utils import CSVTracker
    log = CSVTracker(str(tmp_path / "logs"))
    log.start()
    for s, (a, b) in enumerate([(4.0, 1.0), (2.0, 3.0), (1.0, 5.0), (1.0, 7.0)], start=1):
        log.log({"train/epoch": 0.0, "train/lr": 0.1, "train/loss": a + b, "train/rec": a, "train/cl": b,
                 "train/seqs_per_s": 10.0}, step=s)
    summary = {r["name"]: r for r in summarize_metrics(str(tmp_path / "logs" / "metrics.csv"), window=2)}
    assert list(summary) == ["loss", "rec", "cl"]
    assert (summary["rec"]["first"], summary["rec"]["last"], summary["rec"]["fell"]) == (3.0, 1.0, True)
    assert (summary["cl"]["first"], summary["cl"]["last"], summary["cl"]["fell"]) == (2.0, 6.0, False)
    # resuming at step 2 drops the rows logged after it
    CSVTracker(str(tmp_path / "logs"), resume_step=2).start()
    assert [r["step"] for r in read_metrics(str(tmp_path / "logs" / "metrics.csv"))] == [1, 2]


def _tb_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_report_to_selects_trackers(tmp_path):
    """--report-to: csv only, none, and TensorBoard scalars equal to the CSV rows, also across a resume."""
    c = cfg(tmp_path, "csv", max_steps=4, report_to="csv")
    Trainer(TinyRegressor(), RegressionData(64), collate, c).train()
    logs = Path(c.output) / "logs"
    assert (logs / "metrics.csv").is_file() and not (logs / "tb").exists()
    c = cfg(tmp_path, "none", max_steps=4, report_to="none")
    Trainer(TinyRegressor(), RegressionData(64), collate, c).train()
    assert not (Path(c.output) / "logs").exists() or not any((Path(c.output) / "logs").iterdir())
    # both, with a crash after the step-8 checkpoint and a resume: TensorBoard holds each step once
    kw = dict(max_steps=12, save_steps=4, logging_steps=1, report_to="tensorboard,csv")
    with pytest.raises(RuntimeError, match="simulated crash"):
        Trainer(TinyRegressor(fail_after=10), RegressionData(64), collate, cfg(tmp_path, "both", **kw)).train()
    Trainer(TinyRegressor(), RegressionData(64), collate, cfg(tmp_path, "both", resume=True, **kw)).train()
    out = tmp_path / "both"
    rows = read_metrics(str(out / "logs" / "metrics.csv"))
    tb = _tb_scalars(out / "logs" / "tb", "train/loss")
    assert [s for s, _ in tb] == [r["step"] for r in rows] == list(range(1, 13))
    for (_, v), r in zip(tb, rows):
        assert v == pytest.approx(r["loss"], rel=1e-6)


def test_report_to_wandb_is_imported_only_when_asked(tmp_path, monkeypatch):
    """A stand-in ``wandb`` package records what it receives; it is not imported unless asked for."""
    import sys
    pkg = tmp_path / "stub"
    pkg.mkdir()
    (pkg / "wandb.py").write_text(
        "calls = []\n"
        "class _Run:\n"
        "    def log(self, values, step=None, **kw):\n"
        "        calls.append(('log', step, dict(values)))\n"
        "    def finish(self):\n"
        "        calls.append(('finish',))\n"
        "def init(**kw):\n"
        "    calls.append(('init', kw))\n"
        "    return _Run()\n")
    monkeypatch.syspath_prepend(str(pkg))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    Trainer(TinyRegressor(), RegressionData(64), collate, cfg(tmp_path, "plain", max_steps=2)).train()
    assert "wandb" not in sys.modules
    c = cfg(tmp_path, "wb", max_steps=3, report_to="csv,wandb")
    Trainer(TinyRegressor(), RegressionData(64), collate, c).train()
    calls = sys.modules["wandb"].calls
    assert calls[0][0] == "init" and calls[0][1]["name"] == "wb" and calls[-1] == ("finish",)
    rows = read_metrics(os.path.join(c.output, "logs", "metrics.csv"))
    logged = [c for c in calls if c[0] == "log"]
    assert [c[1] for c in logged] == [r["step"] for r in rows] == [1, 2, 3]
    for (_, _, values), r in zip(logged, rows):
        assert values["train/loss"] == pytest.approx(r["loss"]) and values["train/lr"] == pytest.approx(r["lr"])


def test_report_to_errors(tmp_path, monkeypatch):
    from pretrain.logging_utils import parse_report_to
    assert parse_report_to("TensorBoard, csv,csv") == ["tensorboard", "csv"] and parse_report_to("none") == []
    with pytest.raises(ValueError, match="--report-to.*unknown tracker.*mlflow"):
        Trainer(TinyRegressor(), RegressionData(64), collate, cfg(tmp_path, report_to="csv,mlflow"))
    with pytest.raises(ValueError, match="'none' cannot be combined"):
        parse_report_to("none,csv")
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match="pip install wandb"):
        parse_report_to("csv,wandb")
