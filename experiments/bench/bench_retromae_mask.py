"""Time RetroMAE's enhanced-decoding masks: vectorised (pretrain.objectives.retromae) vs a per-row Python loop.

The peer is a loop in the style of the reference RetroMAE collator (one random mask per
row, own position added, rows stacked); both draw the same kind of mask (per token, a
share ``ratio`` of the other content positions hidden). Prints ms per batch and the ratio.

    python experiments/bench/bench_retromae_mask.py --batch-size 64 --length 512 --repeats 3
"""
from __future__ import annotations

import argparse
import platform
import random
import time

import torch

from pretrain.objectives.retromae import retromae_decoder_mask


def loop_mask(lengths: list[int], L: int, ratio: float) -> torch.Tensor:
    """Per-row Python loop (the reference collator's approach), returning the same (B, L, L) visibility."""
    out = torch.zeros(len(lengths), L, L, dtype=torch.bool)
    for b, n in enumerate(lengths):
        content = list(range(1, n + 1))
        m = int(ratio * (n - 1) + 0.5)
        for i in range(n + 2):
            row = [1] * (n + 2) + [0] * (L - n - 2)
            others = [j for j in content if j != i]
            for j in random.sample(others, m):
                row[j] = 0
            row[i] = 0
            row[0] = 1
            out[b, i] = torch.tensor(row, dtype=torch.bool)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    B, L = a.batch_size, a.length
    lengths = [L - 2] * B
    am = torch.ones(B, L, dtype=torch.long)
    sp = torch.zeros(B, L, dtype=torch.long)
    sp[:, 0] = sp[:, L - 1] = 1
    am, sp = am.to(a.device), sp.to(a.device)
    retromae_decoder_mask(am, sp, a.ratio)  # warm-up

    def timed(fn):
        best = float("inf")
        for _ in range(a.repeats):
            if a.device.startswith("cuda"):
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if a.device.startswith("cuda"):
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return best

    t_vec = timed(lambda: retromae_decoder_mask(am, sp, a.ratio))
    t_loop = timed(lambda: loop_mask(lengths, L, a.ratio))
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads, device {a.device}")
    print(f"batch {B} x {L} tokens, ratio {a.ratio}, best of {a.repeats}")
    print(f"vectorised retromae_decoder_mask : {t_vec * 1e3:9.1f} ms/batch")
    print(f"per-row python loop (peer)       : {t_loop * 1e3:9.1f} ms/batch")
    print(f"speed-up vs loop                 : {t_loop / t_vec:9.1f}x")


if __name__ == "__main__":
    main()
