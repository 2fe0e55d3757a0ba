"""Finite training: a non-finite loss, gradient norm or weight stops the run.

One test per promise:
* ``python -m pretrain`` and ``python -m pretrain finetune`` with a learning rate that makes the loss NaN exit 1
  with one line naming the step and the loss terms; nothing is exported; every checkpoint left is finite and the
  last one resumes;
* a NaN in one loss term is named by the term and its step; the last checkpoint resumes exactly (the losses of
  an uninterrupted clean run);
* an update that turns a weight non-finite is caught at its step, before any checkpoint of it;
* weights are checked before every checkpoint and export;
* under fp16 loss scaling, a bounded number of consecutive skipped steps is tolerated, not more.
"""
from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
from pathlib import Path

import pytest
import torch

from _train_worker import RegressionData, TinyRegressor, collate
from pretrain.training.checkpoint import verify_checkpoint
from pretrain.config import TrainConfig
from pretrain.logging_utils import read_metrics
from pretrain.training.checkpoint import list_checkpoints
from pretrain.training.finite import FiniteGuard, NonFiniteError
from pretrain.training.trainer import Trainer
from _warm_python import warm_python

REPO = Path(__file__).resolve().parents[1]
WORDS = "retrieval dense encoder corpus query document ranking vector token decoder passage index search".split()
EXPORT = ("config.json", "model.safetensors")


def cfg(tmp_path: Path, name: str = "run", **kw) -> TrainConfig:
    base = dict(output=str(tmp_path / name), batch_size=8, max_steps=8, learning_rate=0.05, warmup_ratio=0.1,
                logging_steps=1, save_steps=4, save_total_limit=5, seed=3, report_to="csv")
    base.update(kw)
    return TrainConfig(**base)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([warm_python(), "-m", "pretrain", *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=600)


def tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(path))


def assert_finite_checkpoints(output: Path) -> list[tuple[int, str]]:
    found = list_checkpoints(str(output))
    assert found, f"no checkpoint left in {output}"
    for _, path in found:
        verify_checkpoint(path)
        bad = [k for k, t in tensors(Path(path) / "model.safetensors").items()
               if t.is_floating_point() and not torch.isfinite(t).all()]
        assert not bad, (path, bad[:3])
    return found


def failed_step(stderr: str) -> int:
    m = re.search(r"step (\d+): the loss terms? ([\w, ]+?) (?:is|are) not finite", stderr)
    assert m, stderr[-2000:]
    return int(m.group(1))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("corpus") / "docs.txt"
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(20)) + "." for _ in range(40)) + "\n")
    return str(path)


# ----------------------------------------------------------------------------- the commands
def test_pretrain_with_a_diverging_learning_rate_exits_1_naming_step_and_terms(tmp_path, tiny_bert_dir, corpus):
    out = tmp_path / "run"
    args = ["--objective", "cpdae", "--model", tiny_bert_dir, "--corpus", corpus, "--output", str(out),
            "--cache-dir", str(tmp_path / "cache"), "--batch-size", "4", "--max-length", "32", "--max-steps", "8",
            "--save-steps", "2", "--logging-steps", "1", "--learning-rate", "1e6", "--report-to", "csv"]
    r = run_cli(*args)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "error: NonFiniteError" in r.stderr
    step = failed_step(r.stderr)
    rows = read_metrics(str(out / "logs" / "metrics.csv"))
    # the step named is the first one not logged; every logged row is finite
    assert [row["step"] for row in rows] == list(range(1, step))
    assert all(math.isfinite(row[k]) for row in rows for k in ("loss", "mlm", "rec", "cl"))
    named = re.search(r"the loss terms? ([\w, ]+?) (?:is|are) not finite", r.stderr).group(1).split(", ")
    assert set(named) <= {"mlm", "rec", "cl"} and named
    # nothing exported, neither encoder nor decoder
    assert not any((out / f).exists() for f in EXPORT) and not (out / "decoder").exists()
    found = assert_finite_checkpoints(out)
    last = found[-1][0]
    assert last == max(s for s in range(2, step, 2)) and f"checkpoint-{last} (step {last})" in r.stderr
    # the last checkpoint resumes (here to its own step: the same options diverge again after it)
    r2 = run_cli(*args[:args.index("--max-steps") + 1], str(last), *args[args.index("--max-steps") + 2:], "--resume")
    assert r2.returncode == 0, r2.stderr[-2000:]
    exported, saved = tensors(out / "model.safetensors"), tensors(Path(found[-1][1]) / "model.safetensors")
    key = "bert.embeddings.word_embeddings.weight"
    assert torch.equal(exported[key], saved["mlm_model." + key])


# ----------------------------------------------------------------------------- the Trainer
class NaNTerm(TinyRegressor):
    """TinyRegressor whose ``l1`` term (and so the loss) is NaN from forward call ``nan_at`` on."""

    def __init__(self, nan_at: int, **kw):
        super().__init__(**kw)
        self.nan_at = nan_at

    def forward(self, batch):
        out = super().forward(batch)
        if self.calls >= self.nan_at:
            l1 = out["l1"] * float("nan")
            out = {"loss": out["mse"] + 0.1 * l1, "mse": out["mse"], "l1": l1}
        return out


def test_a_nan_loss_term_is_named_and_the_last_checkpoint_resumes_exactly(tmp_path):
    c = cfg(tmp_path, "nan")
    with pytest.raises(NonFiniteError, match=r"step 6: the loss term l1 is not finite \(loss=nan, mse=[0-9.]+, "
                                             r"l1=nan\)") as e:
        Trainer(NaNTerm(nan_at=6), RegressionData(64), collate, c).train()
    assert "checkpoint-4 (step 4)" in str(e.value)
    assert [s for s, _ in assert_finite_checkpoints(Path(c.output))] == [4]
    assert not any((Path(c.output) / f).exists() for f in EXPORT)
    # reference: the same run without the NaN, uninterrupted
    ref = cfg(tmp_path, "ref")
    Trainer(TinyRegressor(), RegressionData(64), collate, ref).train()
    Trainer(TinyRegressor(seed=123), RegressionData(64), collate, cfg(tmp_path, "nan", resume=True)).train()
    got = read_metrics(os.path.join(c.output, "logs", "metrics.csv"))
    want = read_metrics(os.path.join(ref.output, "logs", "metrics.csv"))
    assert [r["step"] for r in got] == [r["step"] for r in want]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-6)
    assert torch.equal(tensors(Path(c.output) / "model.safetensors")["linear.weight"],
                       tensors(Path(ref.output) / "model.safetensors")["linear.weight"])


def test_an_update_that_makes_a_weight_non_finite_is_caught_at_its_step(tmp_path):
    module = TinyRegressor()
    calls = []

    def overflow(optimizer, args, kwargs):  # stands for an update that overflows float32 at the 3rd step
        calls.append(1)
        if len(calls) == 3:
            with torch.no_grad():
                module.linear.weight[0, 0] = float("inf")

    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(overflow)
    try:
        with pytest.raises(NonFiniteError, match=r"step 3: the update \(learning rate [0-9.e-]+\) made 1 weight "
                                                 r"tensor\(s\) non-finite \(linear.weight\)"):
            Trainer(module, RegressionData(64), collate, cfg(tmp_path, save_steps=2)).train()
    finally:
        handle.remove()
    out = Path(tmp_path / "run")
    assert [s for s, _ in assert_finite_checkpoints(out)] == [2]
    assert not any((out / f).exists() for f in EXPORT)


def test_an_update_check_read_at_the_next_step_still_names_its_step(tmp_path):
    """The weight check after an update is read with the next step's losses (one device synchronisation per
    step): with no log row or checkpoint at step 3, the overflow of step 3 is found at step 4's check, before the
    non-finite loss that the broken weight gives step 4 -- and is reported as step 3's."""
    module = TinyRegressor()
    calls, forwards = [], []

    def overflow(optimizer, args, kwargs):
        calls.append(1)
        if len(calls) == 3:
            with torch.no_grad():
                module.linear.weight[0, 0] = float("inf")

    from torch.optim.optimizer import register_optimizer_step_post_hook

    module.register_forward_hook(lambda m, i, o: forwards.append(1))
    handle = register_optimizer_step_post_hook(overflow)
    try:
        with pytest.raises(NonFiniteError, match=r"step 3: the update \(learning rate [0-9.e-]+\) made 1 weight "
                                                 r"tensor\(s\) non-finite \(linear.weight\) from finite losses"):
            Trainer(module, RegressionData(64), collate, cfg(tmp_path, logging_steps=100, save_steps=2)).train()
    finally:
        handle.remove()
    assert len(calls) == 3 and len(forwards) == 4  # step 4 ran its forward pass, not its update
    out = Path(tmp_path / "run")
    assert [s for s, _ in assert_finite_checkpoints(out)] == [2]
    assert not any((out / f).exists() for f in EXPORT)


class CorruptAt(TinyRegressor):
    """Writes a NaN into its bias from ``on_step(at)`` on: between the update checks and the save."""

    def __init__(self, at: int):
        super().__init__()
        self.at = at

    def on_step(self, step, total_steps):
        super().on_step(step, total_steps)
        if step == self.at:
            with torch.no_grad():
                self.linear.bias.fill_(float("nan"))


def test_weights_are_checked_before_every_checkpoint_and_export(tmp_path):
    c = cfg(tmp_path, save_steps=2)
    with pytest.raises(NonFiniteError, match=r"refusing to write checkpoint checkpoint-4: 1 weight tensor\(s\) are "
                                             r"not finite \(linear.bias\)"):
        Trainer(CorruptAt(4), RegressionData(64), collate, c).train()
    out = Path(c.output)
    assert [s for s, _ in assert_finite_checkpoints(out)] == [2]
    assert not list((out / "checkpoints").glob(".tmp-*"))
    # the export, on its own
    trainer = Trainer(CorruptAt(-1), RegressionData(64), collate, cfg(tmp_path, "export"))
    os.makedirs(trainer.output)
    with torch.no_grad():
        trainer.module.linear.weight.fill_(float("-inf"))
    with pytest.raises(NonFiniteError, match=r"refusing to write the exported model: .*linear.weight"):
        trainer._export(trainer.module)
    assert os.listdir(trainer.output) == []


def test_fp16_loss_scaling_may_skip_a_bounded_number_of_steps():
    finite = {"loss": 1.0, "mse": 0.9}
    guard = FiniteGuard(loss_scaling=True, max_skipped=3)
    for step in range(1, 4):  # the scaler skips these updates and lowers its scale
        guard.check(step, finite, float("inf"))
    guard.check(4, finite, 2.0)  # a finite step resets the count
    for step in range(5, 8):
        guard.check(step, finite, float("nan"))
    with pytest.raises(NonFiniteError, match=r"step 8: the gradient norm is nan after 3 consecutive updates skipped"):
        guard.check(8, finite, float("nan"))
    # a non-finite loss is not a scaling problem: it stops at once
    with pytest.raises(NonFiniteError, match="step 1: the loss term mse is not finite"):
        FiniteGuard(loss_scaling=True).check(1, {"loss": math.inf, "mse": math.inf}, 1.0)
    # without loss scaling, the first non-finite gradient norm stops the run
    with pytest.raises(NonFiniteError, match=r"step 2: the gradient norm is inf \(losses finite: loss=1"):
        FiniteGuard(loss_scaling=False).check(2, finite, float("inf"))
    with pytest.raises(NonFiniteError, match=r"step 3: the total loss is \(its terms are finite\) not finite"):
        FiniteGuard().check(3, {"loss": math.nan, "mse": 0.5}, 1.0)
