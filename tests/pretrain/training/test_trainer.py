"""``python -m pretrain`` on the Hugging Face Trainer: the guarantees of a run, tested on the new loop.

The loss terms in the log history and TensorBoard; a non-finite loss stopping with one line; no unpickling of a
checkpoint's files; the output directory locked and watched; a run directory of the previous format refused; a
run killed (kill -9) in mid-epoch and resumed ending with bit-identical weights; the global batch independent of the
number of processes (torchrun, gloo).
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

WORDS = ("the of and retrieval dense encoder query passage document model training corpus search vector "
         "index token block wiki text").split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 30))) + "\n" for _ in range(60)))
    return str(path)


def args(model: str, corpus: str, out: Path, *extra: str, objective: str = "mlm") -> list[str]:
    return ["--objective", objective, "--model", model, "--corpus", corpus, "--output_dir", str(out),
            "--cache_dir", str(out.parent / "cache"), "--max_length", "32", "--global_batch_size", "8",
            "--use_cpu", "--report_to", "none", "--logging_steps", "1", "--seed", "3", *extra]


def run(argv: list[str], env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pretrain", *argv], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})}, **kw)


def log_history(out: Path, step: int) -> list[dict]:
    return json.loads((out / f"checkpoint-{step}" / "trainer_state.json").read_text())["log_history"]


def test_log_history_and_tensorboard_hold_the_loss_terms(tmp_path, tiny_bert_dir, corpus):
    out = tmp_path / "run"
    argv = args(tiny_bert_dir, corpus, out, "--max_steps", "4", "--save_steps", "4", "--logging_steps", "2",
                "--eval_strategy", "steps", "--eval_steps", "2", "--probe", "sample", "--probe_max_queries", "12",
                "--probe_max_docs", "80", objective="cpdae")
    argv[argv.index("none")] = "tensorboard"
    proc = run(argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    history = log_history(out, 4)
    rows = [r for r in history if "loss" in r]
    assert [r["step"] for r in rows] == [2, 4]
    probes = [r for r in history if "eval_probe_ndcg_cut_10" in r]
    assert [r["step"] for r in probes] == [2, 4]
    # the figure logged at the last step is the probe's on the exported weights (the encoder of step 4)
    from transformers import AutoModel, AutoTokenizer

    from pretrain.evaluation.probe import RetrievalProbe
    probe = RetrievalProbe("sample", max_queries=12, max_docs=80)
    again = probe.evaluate(AutoModel.from_pretrained(out), AutoTokenizer.from_pretrained(out), pooling="cls",
                           max_length=32, batch_size=8)
    assert probes[-1]["eval_probe_ndcg_cut_10"] == pytest.approx(again["ndcg_cut_10"], abs=1e-4)
    assert probes[-1]["eval_probe_recip_rank_10"] == pytest.approx(again["recip_rank_10"], abs=1e-4)
    for r in rows:  # the terms of CPDAE's loss, L = L_REC + L_MLM + 0.1 L_CL, averaged over the window
        assert r["loss"] == pytest.approx(r["rec"] + r["mlm"] + 0.1 * r["cl"], rel=1e-3)
    events = list(out.glob("runs/**/events.out.tfevents.*"))
    assert events
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    assert {"train/loss", "train/mlm", "train/rec", "train/cl", "eval/probe_ndcg_cut_10"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("train/rec")] == [2, 4]
    card = (out / "README.md").read_text()
    assert "cpdae" in card and (out / "model_card.json").is_file() and (out / "decoder").is_dir()


def test_non_finite_loss_stops_with_one_line_naming_step_and_term(tmp_path, tiny_bert_dir, corpus):
    out = tmp_path / "run"
    proc = run(args(tiny_bert_dir, corpus, out, "--max_steps", "6", "--save_steps", "100", "--learning_rate", "1e6",
                    "--max_grad_norm", "0", "--warmup_steps", "0"))
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: NonFiniteError: training stopped, step ") and "the loss term " in last
    assert "Traceback" not in proc.stderr
    step = int(last.split("step ")[1].split(":")[0])
    assert step >= 2  # the first update, at a finite loss, made the weights explode
    assert not list(out.glob("checkpoint-*")) and not (out / "model.safetensors").exists()


def _pickle_payload(path: Path, marker: Path) -> None:
    import pickle

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path.write_bytes(pickle.dumps({"state": Payload()}))


def test_resume_never_unpickles_a_crafted_checkpoint_file(tmp_path, tiny_bert_dir, corpus):
    out = tmp_path / "run"
    proc = run(args(tiny_bert_dir, corpus, out, "--max_steps", "2", "--save_steps", "2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    marker = tmp_path / "executed"
    _pickle_payload(out / "checkpoint-2" / "optimizer.pt", marker)
    proc = run(args(tiny_bert_dir, corpus, out, "--max_steps", "4", "--save_steps", "2",
                    "--resume_from_checkpoint", "true"))
    assert proc.returncode != 0 and not marker.exists()
    assert "optimizer.pt" in proc.stderr.strip().splitlines()[-1]


def test_run_directory_of_the_previous_format_is_refused_with_what_to_do(tmp_path, tiny_bert_dir, corpus):
    out = tmp_path / "run"
    (out / "checkpoints" / "checkpoint-5").mkdir(parents=True)
    (out / "run_config.json").write_text(json.dumps({"config": {"objective": "mlm"}, "trainer": {}}))
    proc = run(args(tiny_bert_dir, corpus, out, "--max_steps", "2", "--resume_from_checkpoint", "true"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"error: ValueError: --output_dir {out} holds a run of the previous format")
    assert "--overwrite_output_dir" in proc.stderr


def test_output_directory_is_locked(tmp_path, tiny_bert_dir, corpus):
    from pyterrier_cpdae._locking import build_lock

    out = tmp_path / "run"
    out.mkdir()
    with build_lock(str(out), "output directory of a pre-training run", "written"):
        proc = run(args(tiny_bert_dir, corpus, out, "--max_steps", "2"))
    assert proc.returncode == 2 and "ConcurrentBuildError" in proc.stderr.strip().splitlines()[-1]


def test_moved_output_directory_stops_the_run_before_it_writes(tmp_path, tiny_bert_dir, corpus, monkeypatch):
    from pretrain import cli
    from pretrain.training.run_dir import RunDirectoryError
    from pretrain.training.trainer import PretrainTrainer

    out, moved = tmp_path / "run", tmp_path / "elsewhere"
    step = PretrainTrainer.training_step

    def move_after_first(self, *a, **k):
        if self.state.global_step == 1 and not moved.exists():
            os.replace(out, moved)
        return step(self, *a, **k)

    monkeypatch.setattr(PretrainTrainer, "training_step", move_after_first)
    with pytest.raises(RunDirectoryError, match="was moved to .*elsewhere"):
        cli.main(args(tiny_bert_dir, corpus, out, "--max_steps", "4", "--save_steps", "2"))
    assert not out.exists() and not (moved / "checkpoint-2").exists()


def _final_weights(out: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(out / "model.safetensors"))


def test_kill_9_in_mid_epoch_then_resume_gives_bit_identical_weights(tmp_path, tiny_bert_dir, corpus):
    # 60 texts of <= 30 words in blocks of 32 tokens, batches of 8: several steps per epoch; 12 steps span epochs
    common = ("--max_steps", "12", "--save_steps", "2", "--save_total_limit", "3")
    ref = tmp_path / "ref"
    proc = run(args(tiny_bert_dir, corpus, ref, *common, objective="cpdae"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads((ref / "checkpoint-12" / "trainer_state.json").read_text())
    steps_per_epoch = round(12 / state["epoch"]) if state["epoch"] else 0
    assert steps_per_epoch > 4  # checkpoint-4 lies inside the first epoch

    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "pretrain", *args(tiny_bert_dir, corpus, out, *common,
                                                                       objective="cpdae")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while not (out / "checkpoint-4" / "trainer_state.json").exists():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "model.safetensors").exists()
    done = run(args(tiny_bert_dir, corpus, out, *common, "--resume_from_checkpoint", "true", objective="cpdae"))
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = _final_weights(ref), _final_weights(out)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].equal(b[k]), k
    ra = [(r["step"], r["loss"]) for r in log_history(ref, 12) if "loss" in r]
    rb = [(r["step"], r["loss"]) for r in log_history(out, 12) if "loss" in r]
    assert ra == rb


@pytest.fixture(scope="module")
def no_dropout_bert_dir(tmp_path_factory, tiny_bert_dir) -> str:
    """The tiny BERT without dropout: one process and two then compute the same function of the same batch."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    out = tmp_path_factory.mktemp("tiny-bert-no-dropout")
    model = AutoModelForMaskedLM.from_pretrained(tiny_bert_dir, hidden_dropout_prob=0.0,
                                                 attention_probs_dropout_prob=0.0)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_bert_dir).save_pretrained(out)
    return str(out)


LAUNCHERS = {  # 2 CPU processes (gloo), as a user starts them
    "torchrun": lambda port: ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                              "--master_port", str(port)],
    # accelerate's torchrun launcher (its --cpu flag starts one process only)
    "accelerate": lambda port: ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                                "--main_process_port", str(port)],
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_two_processes_same_global_batch_losses_and_weights(launcher, tmp_path, no_dropout_bert_dir, corpus,
                                                            free_port):
    """The same global batch of 8 texts, as 1 x 8 and as 2 processes x 4 (gloo; torchrun or ``accelerate launch``):
    the same losses and terms at every step (the MLM term normalised by the global count of masked tokens, the
    contrast over the gathered views) and the same weights after 3 updates."""
    common = ("--max_steps", "3", "--save_steps", "3", "--dataloader_num_workers", "0")
    one = tmp_path / "one"
    proc = run(args(no_dropout_bert_dir, corpus, one, *common, objective="cpdae"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = tmp_path / "two"
    proc = subprocess.run([sys.executable, *LAUNCHERS[launcher](free_port), "-m", "pretrain",
                           *args(no_dropout_bert_dir, corpus, two, *common, objective="cpdae")],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((two / "run_config.json").read_text())["trainer"]["world_size"] == 2
    a = [r for r in log_history(one, 3) if "loss" in r]
    b = [r for r in log_history(two, 3) if "loss" in r]
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b):
        for k in ("loss", "mlm", "rec", "cl"):
            assert rb[k] == pytest.approx(ra[k], rel=1e-5, abs=1e-6), k
    wa, wb = _final_weights(one), _final_weights(two)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=1e-4, atol=1e-6), k


def test_fsdp_asked_for_on_the_cpu_stops_instead_of_training_as_ddp(tmp_path, tiny_bert_dir, corpus, free_port):
    """accelerate enables FSDP on accelerators only: 2 CPU processes would train as plain DDP, silently."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, *LAUNCHERS["torchrun"](free_port), "-m", "pretrain",
                           *args(tiny_bert_dir, corpus, out, "--max_steps", "2", "--fsdp", "full_shard auto_wrap")],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode != 0, proc.stderr[-3000:]
    last = [line for line in proc.stderr.splitlines() if line.startswith("error:")][-1]
    assert last.startswith("error: ValueError: --fsdp was given") and "drop --fsdp" in last, last
    assert not list(out.glob("checkpoint-*")) and not (out / "model.safetensors").exists()


def test_best_model_at_end_and_early_stopping_on_the_probe(tmp_path, tiny_bert_dir, corpus):
    out = tmp_path / "run"
    proc = run(args(tiny_bert_dir, corpus, out, "--max_steps", "10", "--save_steps", "1", "--eval_strategy", "steps",
                    "--eval_steps", "1", "--probe", "sample", "--probe_max_queries", "12", "--probe_max_docs", "80",
                    "--load_best_model_at_end", "--metric_for_best_model", "probe_ndcg_cut_10",
                    "--early_stopping_patience", "2", "--learning_rate", "5e-3", objective="cpdae"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads((out / "trainer_state.json").read_text())
    evals = [(r["step"], r["eval_probe_ndcg_cut_10"]) for r in state["log_history"] if "eval_probe_ndcg_cut_10" in r]
    # the reference: the best figure so far and the evaluations since it improved (strictly), as a user counts them
    best, best_step, waiting, stop = None, None, 0, None
    for step, v in evals:
        if best is None or v > best:
            best, best_step, waiting = v, step, 0
        else:
            waiting += 1
            if waiting >= 2:
                stop = step
                break
    assert state["global_step"] == (stop or 10)
    assert state["best_metric"] == pytest.approx(best) and state["best_model_checkpoint"].endswith(f"checkpoint-{best_step}")
    # the export holds the best checkpoint's weights: the probe gives the best figure on it
    from transformers import AutoModel, AutoTokenizer

    from pretrain.evaluation.probe import RetrievalProbe
    again = RetrievalProbe("sample", max_queries=12, max_docs=80).evaluate(
        AutoModel.from_pretrained(out), AutoTokenizer.from_pretrained(out), pooling="cls", max_length=32, batch_size=8)
    assert again["ndcg_cut_10"] == pytest.approx(best, abs=1e-4)


@pytest.mark.parametrize("choice", ["on", "off"])
def test_unpad_auto_probe_keeps_the_chosen_paths_run_bit_for_bit(choice, tmp_path, tiny_bert_dir, corpus,
                                                                  monkeypatch):
    """``--unpad auto`` with its probe (made to run on the CPU, its times overridden to pick ``choice`` after every
    probe step ran): the same final weights, to the last bit, as ``--unpad <choice>`` without a probe; the choice
    is recorded in run_config.json. Packed rows (``on``) train on the Trainer loop."""
    from pretrain import cli
    from pretrain.model import unpadded
    from pretrain.model import path_probe

    common = ("--max_steps", "2", "--save_steps", "2")
    plain = tmp_path / "plain"
    cli.main(args(tiny_bert_dir, corpus, plain, *common, "--unpad", choice, objective="cpdae"))
    real, ran = path_probe.time_paths, []

    def forced(step, paths, **kw):
        times = real(lambda p: (ran.append(p), step(p)), paths, **kw)
        return {p: 0.1 if p == choice else 0.2 for p in times}

    monkeypatch.setattr(unpadded, "PROBE_DEVICES", ("cpu",))
    monkeypatch.setattr(path_probe, "time_paths", forced)
    probed = tmp_path / "probed"
    cli.main(args(tiny_bert_dir, corpus, probed, *common, "--unpad", "auto", objective="cpdae"))
    assert ran == ["off", "on"] * (1 + path_probe.PROBE_ROUNDS)
    resolved = json.loads((probed / "run_config.json").read_text())["resolved"]
    assert resolved["unpad"] == choice and resolved["unpad_option"] == "auto"
    assert json.loads((plain / "run_config.json").read_text())["resolved"]["unpad"] == choice
    a, b = _final_weights(plain), _final_weights(probed)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
