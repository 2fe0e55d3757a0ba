"""The GPU suite's Trainer row: ``experiments/bench/objective_runs.trainer_worker`` runs an objective's
steps through ``pretrain.training.trainer.Trainer`` and counts the work of the timed steps from the batches they consumed.
Checked by hand: full-length texts hold ``length`` real tokens each, so every count is known in advance (texts x
views x length tokens; ``forward_macs`` per sequence), and texts drawn from a length histogram hold fewer real than
padded tokens."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _warm_python import warm_python

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.bench.objective_runs import default_model, forward_macs  # noqa: E402

SCRIPT = ROOT / "experiments" / "bench" / "bench_objectives.py"


def trainer_row(objective: str, *extra: str) -> dict:
    cmd = [warm_python(), str(SCRIPT), "--worker", "--trainer", "--objective", objective, "--model", default_model(),
           "--device", "cpu", "--length", "16", "--sequences", "4", "--steps", "2", "--warmup", "1", "--threads", "1",
           *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("objective,views", [("mlm", 1), ("cpdae", 2)])
def test_trainer_row_counts_the_timed_steps_work_by_hand(objective, views):
    row = trainer_row(objective)
    texts = 4 // views
    assert row["loop"] == "Trainer" and row["texts"] == texts and row["sequences"] == 4
    assert row["forwards_counted"] == 2  # the two timed steps' forwards, not the warm-up's
    assert row["real_tokens_per_step"] == row["padded_tokens_per_step"] == views * texts * 16
    # the model is all-MiniLM-L6-v2: 6 layers of width 384, feed-forward 1536, the bert-base-uncased vocabulary
    macs = forward_macs(objective, 384, 1536, 6, 30522, 16)
    assert row["macs_per_seq"] == pytest.approx(macs)
    assert row["real_macs_per_step"] == pytest.approx(row["padded_macs_per_step"]) == pytest.approx(4 * macs)
    assert row["step_s"] > 0 and math.isfinite(row["final_loss"])


@pytest.mark.parametrize("unpad", ["auto", "on"])
def test_trainer_row_on_real_block_lengths_counts_less_real_than_padded_work(unpad):
    """At the option's default (``auto``: the padded path on the CPU) and on packed rows (``on``, the GPU suite's second
    Trainer row): the same work counted from the batches' attention masks, the path recorded."""
    row = trainer_row("mlm", "--length-dist", str(ROOT / "experiments" / "results" / "padding_share.json"), "--bf16",
                      "--unpad", unpad)
    assert row["unpad"] == row["unpad_option"] == unpad and row["unpad_probe_s_per_step"] is None
    assert row["forwards_counted"] == 2
    assert 0 < row["real_tokens_per_step"] < row["padded_tokens_per_step"] <= 4 * 16
    assert 0 < row["real_macs_per_step"] < row["padded_macs_per_step"]
    assert 2 <= row["mean_length"] <= 16


def test_a_failed_trainer_row_fails_the_benchmark_and_the_finished_rows_stay_on_disk(tmp_path, monkeypatch):
    """bench_gpu.py exits non-zero when a Trainer row failed (no quiet exit 0 with an error row), and its
    bench_pretrain.json holds the rows finished before it."""
    sys.path.insert(0, str(ROOT / "experiments" / "gpu"))
    import bench_gpu

    from experiments.bench import objective_runs

    monkeypatch.setattr(objective_runs, "run_one", lambda name, args: {"objective": name, "error": "boom"})
    rc = bench_gpu.main(["--cpu-smoke", "--only", "pretrain", "--objectives", "mlm", "--unpad-objectives", "",
                         "--out", str(tmp_path)])
    assert rc == 1
    record = json.loads((tmp_path / "bench_pretrain.json").read_text())
    assert [r["objective"] for r in record["rows"]] == ["mlm"] and "error" not in record["rows"][0]
    assert record["trainer_rows"] == [{"objective": "mlm", "error": "boom", "path": "Trainer, 0 loader workers"}]
