"""The GPU suite's Trainer row: ``experiments/bench/objective_runs.trainer_worker`` runs an objective's
steps through ``pretrain.training.trainer.PretrainTrainer`` and counts the work of the timed steps from the batches they consumed.
Checked by hand: full-length texts hold ``length`` real tokens each, so every count is known in advance (texts x
views x length tokens; ``forward_macs`` per sequence at the model's shape), and texts drawn from a length histogram
hold fewer real than padded tokens. The rows are started as the GPU run starts them, through
``objective_runs.run_one`` (``bench_objectives.py --worker --trainer ...`` in a process of its own)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from experiments.bench import objective_runs  # noqa: E402
from experiments.bench.objective_runs import forward_macs  # noqa: E402


def trainer_row(model: str, objective: str, **options) -> dict:
    """The Trainer row of ``objective`` on ``model``: 2 timed steps after 1 warm-up, 4 sequences of 16 tokens."""
    run = SimpleNamespace(**{**dict(model=model, config="checkpoint", device="cpu", length=16, sequences=4, steps=2,
                                    warmup=1, threads=1, bf16=False, trainer=True, num_workers=0), **options})
    row = objective_runs.run_one(objective, run)
    assert "error" not in row, row["error"]
    return row


@pytest.mark.parametrize("objective,views", [("mlm", 1), ("cpdae", 2)])
def test_trainer_row_counts_the_timed_steps_work_by_hand(objective, views, tiny_bert_dir, warm_children):
    row = trainer_row(tiny_bert_dir, objective)
    texts = 4 // views
    assert row["loop"] == "Trainer" and row["texts"] == texts and row["sequences"] == 4
    assert row["forwards_counted"] == 2  # the two timed steps' forwards, not the warm-up's
    assert row["real_tokens_per_step"] == row["padded_tokens_per_step"] == views * texts * 16
    # the model's shape from its config (the tiny BERT: 2 layers of width 32, feed-forward 64, bert-base's vocabulary)
    shape = json.loads((Path(tiny_bert_dir) / "config.json").read_text())
    assert (shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]) == (32, 64, 2)
    macs = forward_macs(objective, 32, 64, 2, shape["vocab_size"], 16)
    assert row["macs_per_seq"] == pytest.approx(macs)
    assert row["real_macs_per_step"] == pytest.approx(row["padded_macs_per_step"]) == pytest.approx(4 * macs)
    assert row["step_s"] > 0 and math.isfinite(row["final_loss"])


@pytest.mark.parametrize("unpad", ["auto", "on"])
def test_trainer_row_on_real_block_lengths_counts_less_real_than_padded_work(unpad, tiny_bert_dir, warm_children):
    """At the option's default (``auto``: the padded path on the CPU) and on packed rows (``on``, the GPU suite's second
    Trainer row): the same work counted from the batches' attention masks, the path recorded."""
    row = trainer_row(tiny_bert_dir, "mlm", length_dist=str(ROOT / "experiments" / "results" / "padding_share.json"),
                      bf16=True, unpad=unpad)
    assert row["unpad"] == row["unpad_option"] == unpad and row["unpad_probe_s_per_step"] is None
    assert row["forwards_counted"] == 2
    assert 0 < row["real_tokens_per_step"] < row["padded_tokens_per_step"] <= 4 * 16
    assert 0 < row["real_macs_per_step"] < row["padded_macs_per_step"]
    assert 2 <= row["mean_length"] <= 16


def test_a_failed_trainer_row_fails_the_benchmark_and_the_finished_rows_stay_on_disk(tmp_path, monkeypatch):
    """bench_gpu.py exits non-zero when a Trainer row failed (no quiet exit 0 with an error row), and its
    bench_pretrain.json holds the rows finished before it. On the CPU (--cpu-smoke) the row runs in the benchmark's
    process; on the GPU through ``run_one``, whose failure is its row's error too."""
    sys.path.insert(0, str(ROOT / "experiments" / "gpu"))
    import bench_gpu

    def boom(args):
        raise RuntimeError("boom")
    monkeypatch.setattr(objective_runs, "trainer_worker", boom)
    rc = bench_gpu.main(["--cpu-smoke", "--only", "pretrain", "--objectives", "mlm", "--unpad-objectives", "",
                         "--out", str(tmp_path)])
    assert rc == 1
    record = json.loads((tmp_path / "bench_pretrain.json").read_text())
    assert [r["objective"] for r in record["rows"]] == ["mlm"] and "error" not in record["rows"][0]
    assert record["trainer_rows"] == [{"objective": "mlm", "error": "RuntimeError: boom",
                                       "path": "Trainer, 0 loader workers"}]
    # the GPU run's path: the row through run_one (a process of its own), its error kept as the row's
    monkeypatch.setattr(objective_runs, "run_one", lambda name, args: {"objective": name, "error": "boom"})
    args = SimpleNamespace(trainer_objectives="mlm", length_dist=ROOT / "experiments" / "results" / "padding_share.json",
                           trainer_workers=0, trainer_unpad="auto")
    rows = bench_gpu.bench_trainer(args, SimpleNamespace(), {"bf16_flops": 1e12}, [], smoke=False)
    assert rows == [{"objective": "mlm", "error": "boom", "path": "Trainer, 0 loader workers"}]
