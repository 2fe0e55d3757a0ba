"""experiments/bench/bench_finetune_speed.py's padding count (``--padding-only``) against a count written out by hand:
each step's passages padded together, and in chunks of 16 sorted by length, each cut to its longest."""
from __future__ import annotations

import argparse
import json

from experiments.bench import bench_finetune_speed as bench


def test_padding_counts_tokens_padded_and_chunked_positions(tmp_path, minilm_path):
    from transformers import AutoTokenizer

    words = ["alpha", "beta gamma", "delta " * 9, "epsilon zeta eta", "theta " * 30, "iota kappa"]
    groups = tmp_path / "groups.jsonl"
    with open(groups, "w", encoding="utf8") as f:  # 12 groups x (1 positive + 3 negatives) of unequal lengths
        for q in range(12):
            texts = [words[(q + j) % len(words)] * (1 + (q + j) % 3) for j in range(4)]
            f.write(json.dumps({"qid": str(q), "query": "q", "pos": [{"docno": f"{q}p", "text": texts[0]}],
                                "negs": [{"docno": f"{q}n{j}", "text": t} for j, t in enumerate(texts[1:])]}) + "\n")
    a = argparse.Namespace(warmup=1, steps=1, batch=6, negatives=3, length=32)
    got = bench.padding(groups, minilm_path, a)

    tok = AutoTokenizer.from_pretrained(minilm_path)
    want = {"steps": 2, "tokens": 0, "padded_positions": 0, "chunked_positions": 0}
    lines = groups.read_text(encoding="utf8").splitlines()
    for step in (lines[:6], lines[6:]):
        texts = [t for g in map(json.loads, step) for t in [g["pos"][0]["text"]] + [d["text"] for d in g["negs"]]]
        lengths = [len(tok(t, truncation=True, max_length=32)["input_ids"]) for t in texts]
        want["tokens"] += sum(lengths)
        want["padded_positions"] += len(texts) * max(lengths)
        ordered = sorted(lengths, reverse=True)
        chunked = sum(len(ordered[i:i + 16]) * ordered[i] for i in range(0, len(ordered), 16))
        want["chunked_positions"] += chunked if chunked <= 0.9 * len(texts) * max(lengths) else len(texts) * max(lengths)
    assert {k: got[k] for k in want} == want
    assert got["padding_share"] == round(1 - want["tokens"] / want["padded_positions"], 4)
