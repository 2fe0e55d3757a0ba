"""Where the CPU encoder's time goes: OpenVINO's per-operation counters over the compiled float32 graph.

The default CPU encoder (``CPDAE`` with ``backend="openvino"``: the encoder and its pooling compiled as one float32
graph, ``pyterrier_cpdae/encoder/backends/openvino.py``) runs one batch per inference stream; this script compiles the
same graph with ``PERF_COUNT`` and runs full-length batches (no padding) of ``--batch-tokens`` tokens through every
stream at once, ``--repeats`` times after a warm-up, then prints per kind of operation (OpenVINO's node type and
the kernel it chose) the time per batch and its share, and two rates against the CPU's float32 bound measured in the
same run (``objective_runs.fp32_bound``): the fully connected layers' (``2 x (4H^2 + 2HF)`` FLOPs a token a layer)
and attention's (``2 x 2LH`` a token a layer: the scores and the context, softmax not counted), each over the time of
the operations that do it. It answers the question of what bounds the float32 forward on 2 cores.

Usage::

    python experiments/bench/profile_openvino_encoder.py [--model DIR] [--max-length 256] [--batch-tokens 2048]
        [--repeats 10] [--pooling mean]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # python experiments/bench/profile_openvino_encoder.py
    sys.path.insert(0, REPO)

from experiments.bench.objective_runs import default_model, encode_flops, fp32_bound  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="encoder checkpoint (default: the local all-MiniLM-L6-v2)")
    ap.add_argument("--max-length", type=int, default=256, help="tokens per text (all texts full length)")
    ap.add_argument("--batch-tokens", type=int, default=2048, help="tokens per batch (the CPU default's budget)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--pooling", default="mean", choices=["mean", "cls"])
    ap.add_argument("--bound-seconds", type=float, default=2.0)
    args = ap.parse_args(argv)

    from transformers import AutoModel

    from pyterrier_cpdae.encoder.backends.openvino import compile_encoder

    model = AutoModel.from_pretrained(args.model or default_model(), trust_remote_code=False).eval()
    enc = compile_encoder(model, args.pooling, True, profile=True)
    texts = max(1, args.batch_tokens // args.max_length)
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, model.config.vocab_size, size=(texts, args.max_length), dtype=np.int64)
    ids[:, 0], ids[:, -1] = 101, 102
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    requests = [enc.compiled.create_infer_request() for _ in range(enc.streams)]

    def run_all() -> None:
        for r in requests:
            r.start_async(feed)
        for r in requests:
            r.wait()

    run_all()
    bound = fp32_bound(2048, args.bound_seconds)
    times: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        run_all()
        for r in requests:
            for p in r.profiling_info:
                times[(p.node_type, p.exec_type)] += p.real_time.total_seconds()
                counts[(p.node_type, p.exec_type)] += 1
    wall = (time.perf_counter() - t0) / args.repeats
    bound = max(bound, fp32_bound(2048, args.bound_seconds))
    batches = args.repeats * len(requests)
    per_batch = {k: v / batches for k, v in times.items()}
    total = sum(per_batch.values())
    cfg = model.config
    H, F, layers, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, args.max_length
    tokens = texts * L
    fc_flops = 2 * tokens * (4 * H * H + 2 * H * F) * layers
    attn_flops = 2 * tokens * 2 * L * H * layers
    forward = encode_flops([L] * texts, cfg.to_dict())
    fc_s = sum(v for (node, _), v in per_batch.items() if node == "FullyConnected")
    attn_s = sum(v for (node, _), v in per_batch.items() if node in ("Subgraph", "ScaledDotProductAttention", "MatMul",
                                                                      "Softmax"))
    print(f"model {args.model or default_model()}: {layers} layers, width {H}, feed-forward {F}; {enc.streams} "
          f"streams, {torch.get_num_threads()} threads; batches of {texts} x {L} tokens, one per stream")
    print(f"float32 bound (2048 x 2048 torch matmul, before/after): {bound / 1e9:.0f} GFLOP/s")
    print(f"wall per round of {len(requests)} batches: {wall * 1000:.1f} ms; forward at "
          f"{forward * len(requests) / wall / 1e9:.0f} GFLOP/s = {forward * len(requests) / wall / bound:.0%} of the "
          f"bound; per batch the operations' own times sum to {total * 1000:.1f} ms (one stream's thread)\n")
    print("| operation (kernel) | ms per batch | share | calls per batch |")
    print("|---|---|---|---|")
    for key, v in sorted(per_batch.items(), key=lambda kv: -kv[1])[:14]:
        print(f"| {key[0]} ({key[1]}) | {v * 1000:.2f} | {v / total:.1%} | {counts[key] // batches} |")
    threads_per_stream = max(1, torch.get_num_threads() // len(requests))
    stream_bound = bound * threads_per_stream / torch.get_num_threads()
    fc_rate = fc_flops / fc_s if fc_s else float("nan")
    attn_rate = attn_flops / attn_s if attn_s else float("nan")
    print(f"\nfully connected layers: {fc_s / total:.0%} of the time at {fc_rate / 1e9:.0f} GFLOP/s a stream "
          f"= {fc_rate / stream_bound:.0%} of a stream's share of the bound; attention (scores + context, softmax "
          f"not counted): {attn_s / total:.0%} of the time at {attn_rate / 1e9:.0f} GFLOP/s = "
          f"{attn_rate / stream_bound:.0%}")
    return {"per_batch_s": {f"{a} ({b})": v for (a, b), v in per_batch.items()}, "fc_share_of_bound":
            fc_rate / stream_bound, "attention_share_of_bound": attn_rate / stream_bound, "wall_s": wall,
            "forward_share_of_bound": forward * len(requests) / wall / bound}


if __name__ == "__main__":
    main()
