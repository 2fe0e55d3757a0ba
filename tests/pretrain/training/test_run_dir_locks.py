"""A run's output directory is held by one run at a time.

``python -m pretrain`` launched twice into one ``--output`` used to run twice (duplicated metric rows, interleaved
checkpoints, both exit 0).  The second run must exit non-zero at once, naming the first (pid, host, since when),
whatever path it takes to the directory (fine-tuning's: tests/pretrain/finetune/test_finetune.py).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.warm_python import warm_python

from pyterrier_cpdae._locking import holder

REPO = Path(__file__).resolve().parents[3]
ENV = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
           TOKENIZERS_PARALLELISM="false")


@pytest.fixture
def corpus(tmp_path) -> str:
    words = "retrieval dense encoder corpus query document ranking vector token decoder".split()
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(40)) + "\n")
    return str(path)


def _args(model: str, corpus: str, output, cache, steps: int) -> list:
    return ["--objective", "cpdae", "--model", model, "--corpus", corpus, "--output_dir", str(output),
            "--cache-dir", str(cache), "--global_batch_size", "4", "--max-length", "32", "--max-steps", str(steps),
            "--save-steps", "100000", "--logging-steps", "1", "--use_cpu", "--report_to", "none"]


@pytest.mark.multiproc
def test_second_pretraining_run_into_the_same_output_is_refused(tmp_path, tiny_bert_dir, corpus):
    out, cache = tmp_path / "runs" / "cpdae", tmp_path / "cache"
    first = subprocess.Popen([sys.executable, "-m", "pretrain", *_args(tiny_bert_dir, corpus, out, cache, 100000)],
                             env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        metrics = out / "run_config.json"  # written when the run starts training
        deadline = time.time() + 240
        while not metrics.exists() and first.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert first.poll() is None, first.communicate()[1][-3000:]
        assert metrics.exists(), "the first run did not start training"
        (tmp_path / "link").symlink_to(tmp_path / "runs", target_is_directory=True)
        for spelling, extra in ((out, ["--resume_from_checkpoint", "true"]), (tmp_path / "link" / "cpdae", ["--overwrite_output_dir"])):
            second = subprocess.run([warm_python(), "-m", "pretrain",
                                     *_args(tiny_bert_dir, corpus, spelling, cache, 3), *extra],
                                    env=ENV, capture_output=True, text=True, timeout=300)
            assert second.returncode != 0, (spelling, extra)
            assert f"is being written by pid {first.pid} on host " in second.stderr, second.stderr[-2000:]
            assert "since " in second.stderr and "Traceback" not in second.stderr
        assert first.poll() is None  # untouched: still training
        assert holder(out)["pid"] == first.pid
    finally:
        first.kill()
        first.wait()
    assert holder(out) is None  # released by the OS when the run died
    assert not (out / "config.json").exists()

