"""Reliability promises of pre-training / fine-tuning runs and of the token cache.

One test per promise:
* a run directory is data, not code: crafted pickles in it are never executed on resume
  (pre-training and fine-tuning);
* a corrupt or truncated checkpoint file (RNG states, model, optimizer, trainer state) is refused
  with an error naming it and offering the previous intact checkpoint, which then resumes exactly;
* a crash while writing a checkpoint leaves the previous one intact and the partial one unbuilt;
* a truncated token-cache file is named when opened directly and rebuilt by ``build_or_load``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from _train_worker import RegressionData, TinyRegressor, collate
from pretrain.config import TrainConfig
from pretrain.logging_utils import read_metrics
from pretrain.training.checkpoint import list_checkpoints
from pretrain.training.trainer import Trainer

#: Names under which pickles have been (or could be) read from a checkpoint by accelerate or the HF Trainer.
PICKLE_NAMES = ("custom_checkpoint_0.pkl", "random_states_0.pkl", "scheduler.bin", "scheduler.pt", "sampler.bin",
                "scaler.pt", "rng_state.pth", "rng_state_0.pth", "training_args.bin", "dl_state_dict.bin")


class _Payload:
    """Pickles to a call of ``exec`` that writes ``marker``: what a crafted checkpoint file would do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('code from the run directory ran')",)


def write_payload(path: Path, marker: Path) -> None:
    torch.save({"state": _Payload(marker)}, path)


def plant_pickles(run: Path, marker: Path) -> int:
    """A crafted pickle under every known pickle name in every checkpoint directory of ``run``."""
    n = 0
    for ckpt in (run / "checkpoints").iterdir():
        for name in PICKLE_NAMES:
            write_payload(ckpt / name, marker)
            n += 1
    return n


def cfg(tmp_path: Path, name: str = "run", **kw) -> TrainConfig:
    base = dict(output=str(tmp_path / name), batch_size=8, max_steps=14, learning_rate=0.05, warmup_ratio=0.1,
                logging_steps=2, save_steps=4, save_total_limit=5, seed=3)
    base.update(kw)
    return TrainConfig(**base)


def losses(output) -> list[tuple]:
    return [(r["step"], r["loss"], r["lr"]) for r in read_metrics(os.path.join(output, "logs", "metrics.csv"))]


def crashed_run(tmp_path: Path, name: str = "crash", fail_after: int = 10) -> TrainConfig:
    """A run killed (exception) after its step-8 checkpoint: checkpoints at steps 4 and 8."""
    c = cfg(tmp_path, name)
    with pytest.raises(RuntimeError, match="simulated crash"):
        Trainer(TinyRegressor(fail_after=fail_after), RegressionData(64), collate, c).train()
    assert [s for s, _ in list_checkpoints(c.output)] == [4, 8]
    return c


def resume(c: TrainConfig) -> dict:
    return Trainer(TinyRegressor(seed=123), RegressionData(64), collate, cfg(Path(c.output).parent,
                                                                             Path(c.output).name, resume=True)).train()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[tuple]:
    """Losses of the uninterrupted run."""
    c = cfg(tmp_path_factory.mktemp("ref"), "full")
    Trainer(TinyRegressor(), RegressionData(64), collate, c).train()
    return losses(c.output)


def assert_same(a, b):
    assert [r[0] for r in a] == [r[0] for r in b]
    for ra, rb in zip(a, b):
        assert ra[1:] == pytest.approx(rb[1:], rel=1e-5, abs=1e-7), (ra, rb)


# ----------------------------------------------------------------------------- run directory is data
def test_payload_is_live(tmp_path):
    """The crafted file used below does run code when unpickled (so the tests below can fail)."""
    marker = tmp_path / "marker"
    write_payload(tmp_path / "x.pkl", marker)
    torch.load(tmp_path / "x.pkl", weights_only=False)
    assert marker.exists()


def test_pretrain_resume_never_unpickles_the_run_directory(tmp_path, reference):
    c = crashed_run(tmp_path)
    marker = tmp_path / "PWNED"
    assert plant_pickles(Path(c.output), marker) > 0
    resume(c)
    assert not marker.exists(), "resuming executed a pickle from the run directory"
    assert_same(reference, losses(c.output))


def test_crafted_optimizer_file_is_refused_not_executed(tmp_path):
    """Even a manifest-consistent crafted file under a name the loader reads is loaded weights-only."""
    c = crashed_run(tmp_path)
    ckpt = Path(list_checkpoints(c.output)[-1][1])
    marker = tmp_path / "PWNED"
    opt = next(p for p in ckpt.iterdir() if p.name.startswith("optimizer"))
    write_payload(opt, marker)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    from pretrain.training.checkpoint import file_digest
    state["files"][opt.name] = {"bytes": opt.stat().st_size, "sha256": file_digest(str(opt))}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match=re.escape(opt.name) + ".*cannot be loaded into this run.*UnpicklingError"):
        resume(c)
    assert not marker.exists()


def test_legacy_pickle_checkpoint_is_refused_with_explanation(tmp_path):
    """A ``step-N`` checkpoint of the earlier, pickle-based layout is recognised and refused, not unpickled."""
    c = crashed_run(tmp_path)
    for step, path in list_checkpoints(c.output):
        legacy = Path(path).parent / f"step-{step}"
        os.rename(path, legacy)
        (legacy / "trainer_state.json").write_text(json.dumps({"step": step, "epoch": 0, "step_in_epoch": step}))
    marker = tmp_path / "PWNED"
    plant_pickles(Path(c.output), marker)
    with pytest.raises(ValueError, match="step-8 is a checkpoint of an earlier version.*unpickling.*--overwrite"):
        resume(c)
    assert not marker.exists()


# ----------------------------------------------------------------------------- corrupt / truncated checkpoints
def _corrupt_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) - 64  # inside the tensor data, past the safetensors header: the file still parses
    data[mid:mid + 32] = bytes(b ^ 0xFF for b in data[mid:mid + 32])
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


@pytest.mark.parametrize("damage", ["flipped", "truncated", "garbage"])
def test_corrupt_rng_state_fails_loudly_and_previous_checkpoint_resumes_exactly(tmp_path, reference, damage):
    c = crashed_run(tmp_path)
    ckpt = Path(list_checkpoints(c.output)[-1][1])
    rng = [p for p in ckpt.iterdir() if "random" in p.name or "rng" in p.name]
    assert len(rng) == 1
    {"flipped": _corrupt_middle, "truncated": _truncate,
     "garbage": lambda p: p.write_bytes(b"\x00garbage" * 40)}[damage](rng[0])
    with pytest.raises(ValueError) as err:
        resume(c)
    msg = str(err.value)
    assert rng[0].name in msg and str(ckpt) in msg
    previous = list_checkpoints(c.output)[0][1]
    assert "previous checkpoint" in msg and previous in msg and "step 4" in msg
    # following the advice resumes from step 4 with the losses of an uninterrupted run
    shutil.move(str(ckpt), str(ckpt.parent / f".corrupt-{ckpt.name}"))
    resume(c)
    assert_same(reference, losses(c.output))


@pytest.mark.parametrize("victim", ["model", "optimizer", "trainer_state"])
def test_truncated_checkpoint_file_is_named_and_previous_offered(tmp_path, victim):
    c = crashed_run(tmp_path)
    ckpt = Path(list_checkpoints(c.output)[-1][1])
    path = next(p for p in sorted(ckpt.iterdir()) if p.name.startswith(victim))
    _truncate(path)
    with pytest.raises(ValueError) as err:
        resume(c)
    msg = str(err.value)
    assert path.name in msg and str(ckpt) in msg
    assert "previous checkpoint" in msg and list_checkpoints(c.output)[0][1] in msg
    # no raw error type leaks without the file name: the message starts with what to do about which checkpoint
    assert msg.startswith("cannot resume from")


def test_no_intact_checkpoint_says_start_again(tmp_path):
    c = crashed_run(tmp_path)
    for _, path in list_checkpoints(c.output):
        _truncate(Path(path) / "model.safetensors")
    with pytest.raises(ValueError, match="No earlier checkpoint is intact.*--overwrite"):
        resume(c)


def test_crash_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path, reference, monkeypatch):
    import pretrain.training.checkpoint as ckpt_mod
    import pretrain.training.trainer as trainer_mod
    real = ckpt_mod.save_train_state

    def dies_at_step_8(directory, model, *a, **k):
        if directory.endswith("-8"):
            with open(os.path.join(directory, "model.safetensors"), "wb") as f:
                f.write(b"partial")
            raise KeyboardInterrupt("killed while writing")
        return real(directory, model, *a, **k)
    monkeypatch.setattr(trainer_mod, "save_train_state", dies_at_step_8)
    c = cfg(tmp_path, "crash")
    with pytest.raises(KeyboardInterrupt):
        Trainer(TinyRegressor(), RegressionData(64), collate, c).train()
    monkeypatch.undo()
    root = Path(c.output) / "checkpoints"
    assert [s for s, _ in list_checkpoints(c.output)] == [4]
    assert [p.name for p in root.iterdir() if p.name.startswith(".tmp-")] == [".tmp-checkpoint-8"]
    resume(c)
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert_same(reference, losses(c.output))


# ----------------------------------------------------------------------------- token cache
@pytest.fixture(scope="module")
def tok(minilm_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(minilm_path)


@pytest.mark.parametrize("victim", ["tokens.bin", "offsets.bin", "df.npy", "meta.json"])
def test_truncated_token_cache_is_named_and_rebuilt(tmp_path, tok, victim, caplog):
    from pretrain.data.corpus import TokenCache
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"Document {i} talks about rivers. It has a second sentence about mountain {i}."
                                for i in range(30)) + "\n")
    built = TokenCache.build_or_load(str(corpus), tok, 16, tmp_path / "cache", progress=False)
    expected = [built[i] for i in range(len(built))]
    _truncate(built.path / victim)
    if victim != "meta.json":
        with pytest.raises(ValueError, match=re.escape(str(built.path / victim)) + ".*delete"):
            TokenCache(built.path)
    with caplog.at_level("WARNING"):
        again = TokenCache.build_or_load(str(corpus), tok, 16, tmp_path / "cache", progress=False)
    assert [again[i] for i in range(len(again))] == expected
    assert again.document_frequency().shape == (len(tok),)
    if victim != "meta.json":
        assert victim in caplog.text and "rebuilding" in caplog.text


def test_resume_on_another_number_of_processes_warns(tmp_path, caplog):
    """A checkpoint of 1 process resumed as rank 1 of 2: loaded, with a warning that the RNG of rank 1 is not restored."""
    from transformers import get_linear_schedule_with_warmup

    from pretrain.training.checkpoint import load_checkpoint
    c = crashed_run(tmp_path)
    step, path = list_checkpoints(c.output)[-1]
    module = TinyRegressor(seed=123)
    from pretrain.training.optim import parameter_groups
    opt = torch.optim.AdamW(parameter_groups(module, 0.01), lr=0.05)
    sched = get_linear_schedule_with_warmup(opt, 2, 14)
    with caplog.at_level("WARNING"):
        state = load_checkpoint(c.output, step, path, module, opt, sched, rank=1, world_size=2)
    assert state["step"] == 8 and "written by 1 process(es), resumed on 2" in caplog.text
    from safetensors.torch import load_file
    saved = load_file(os.path.join(path, "model.safetensors"))
    assert all(torch.equal(saved[k], v) for k, v in module.state_dict().items())
    assert sched.last_epoch == 8
