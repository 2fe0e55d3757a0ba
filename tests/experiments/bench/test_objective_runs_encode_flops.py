"""The FLOP count behind the encoding benchmarks' MFU and compute-bound shares:
``experiments/bench/objective_runs.encode_flops`` against torch's own FLOP counter over a real BERT forward, text by
text at its own length, and ``bench_encode.py``'s bound section end to end at a tiny size."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import BertConfig, BertModel

from tests.helpers.warm_python import warm_python

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from experiments.bench.objective_runs import encode_flops  # noqa: E402


@pytest.mark.parametrize("shape", [dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2),
                                   dict(hidden_size=48, intermediate_size=80, num_hidden_layers=3)])
def test_encode_flops_equals_torchs_count_of_an_unpadded_forward(shape):
    config = BertConfig(vocab_size=100, num_attention_heads=4, max_position_embeddings=64,
                        attn_implementation="eager", **shape)
    model = BertModel(config, add_pooling_layer=False).eval()
    lengths = [5, 17, 17, 30]
    counted = 0
    with torch.no_grad():
        for n in lengths:  # each text alone: no padding, attention over its own tokens
            with FlopCounterMode(display=False) as fc:
                model(input_ids=torch.randint(0, 100, (1, n)))
            counted += fc.get_total_flops()
    assert encode_flops(np.array(lengths), config.to_dict()) == counted


def test_encode_flops_by_hand():
    # one layer, H=2, F=3, one text of 4 tokens: per token 4*4 + 2*2*3 + 2*4*2 = 44 multiply-adds; x4 tokens, x2
    assert encode_flops([4], dict(hidden_size=2, intermediate_size=3, num_hidden_layers=1)) == 2 * 4 * 44


def test_bench_encode_prints_the_compute_bound(tiny_bert_dir, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(f'{{"_id": "d{i}", "title": "t{i}", "text": "{" ".join(["word"] * (5 + 3 * i))}"}}\n'
                              for i in range(12)))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    res = subprocess.run([warm_python(), str(ROOT / "experiments" / "bench" / "bench_encode.py"), "--corpus",
                          str(corpus), "--model", tiny_bert_dir, "--docs", "12", "--repeats", "1", "--max-lengths",
                          "32", "--queries", "", "--skip", "SBertBiEncoder,HgfBiEncoder", "--bound-seconds", "0.05",
                          "--bound-n", "64", "--target", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    m = re.search(r"forward is ([\d.]+) GFLOP", res.stdout)
    assert m, res.stdout
    rows = re.findall(r"^\| (sentence-transformers encode|CPDAE[^|]*) \| (\d+) \| (\d+)% \|$", res.stdout, re.M)
    assert {r[0] for r in rows} >= {"sentence-transformers encode", "CPDAE backend='torch' (float32)"}, res.stdout
    assert re.search(r"^2x sentence-transformers \(wall\) needs \d+ GFLOP/s = \d+% of the fp32 bound", res.stdout,
                     re.M), res.stdout


def test_profile_openvino_encoder_accounts_for_the_forward(tiny_bert_dir):
    """experiments/bench/profile_openvino_encoder.py at a tiny size: OpenVINO's per-operation times are read, the
    fully connected layers and the attention operations are found among them, and their rates come out as shares of
    the float32 bound (the FLOP counts are encode_flops' parts, tested above)."""
    pytest.importorskip("openvino")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    res = subprocess.run([warm_python(), str(ROOT / "experiments" / "bench" / "profile_openvino_encoder.py"),
                          "--model", tiny_bert_dir, "--max-length", "32", "--batch-tokens", "128", "--repeats", "2",
                          "--bound-seconds", "0.05"], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert re.search(r"^\| FullyConnected \(\w+\) \| [\d.]+ \| [\d.]+% \| \d+ \|$", res.stdout, re.M), res.stdout
    m = re.search(r"fully connected layers: (\d+)% of the time at [\d.]+ GFLOP/s a stream = (\d+)% .*attention "
                  r"\(scores \+ context, softmax not counted\): (\d+)% of the time", res.stdout)
    assert m and 0 < int(m.group(1)) <= 100 and int(m.group(2)) > 0 and int(m.group(3)) > 0, res.stdout
