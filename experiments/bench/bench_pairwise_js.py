"""Benchmark: memory-efficient pairwise JS divergence vs the naive broadcast reference.

Measures forward + backward of ``pairwise_js`` (chunked custom autograd function) and
``pairwise_js_naive`` (broadcast ``(N, N, |V|)`` with autograd) on the CPU at CPDAE's
shape: m texts -> N = 2m views over a |V| = 30522 vocabulary. The loss is InfoNCE-like
(``(JS * W).sum()`` with a fixed random ``W``) so the full backward runs.

Peak memory: every variant runs in a *fresh subprocess*; after imports and input creation
(and one warm-up iteration for timing, which also reaches the variant's peak) the worker
reads ``ru_maxrss`` (the process's resident high-water mark); the reported peak is
``ru_maxrss(after all iterations) − ru_maxrss(before the first iteration)``, i.e. the extra
resident memory the computation needed on top of the inputs.

Usage::

    python experiments/bench/bench_pairwise_js.py                       # m=64, |V|=30522, chunks 4/8/16
    python experiments/bench/bench_pairwise_js.py --m 16 --vocab 5000 --chunks 8 --out /tmp/x.md
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker(args: argparse.Namespace) -> None:
    import torch

    from pretrain.model.losses import pairwise_js, pairwise_js_naive

    torch.set_num_threads(args.threads) if args.threads else None
    n = 2 * args.m
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, args.vocab, generator=g) * 2
    w = torch.randn(n, n, generator=g)

    def step() -> float:
        z = logits.clone().requires_grad_()
        s = torch.sigmoid(z)
        p = s / s.sum(-1, keepdim=True)
        t0 = time.perf_counter()
        js = pairwise_js(p, chunk_size=args.chunk) if args.variant == "efficient" else pairwise_js_naive(p)
        (js * w).sum().backward()
        dt = time.perf_counter() - t0
        del js, z, s, p
        return dt

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = [step() for _ in range(args.warmup + args.repeats)][args.warmup:]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"variant": args.variant, "chunk": args.chunk, "median_s": statistics.median(times),
                      "times_s": times, "peak_mib": (peak - base) / 1024.0}))


def run_variant(variant: str, chunk: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--variant", variant, "--chunk", str(chunk),
           "--m", str(args.m), "--vocab", str(args.vocab), "--repeats", str(args.repeats),
           "--warmup", str(args.warmup), "--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, default=64, help="texts per batch (N = 2m views)")
    ap.add_argument("--vocab", type=int, default=30522)
    ap.add_argument("--chunks", default="4,8,16", help="chunk sizes of the efficient variant to measure")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--out", default=os.path.join(ROOT, "experiments", "results", "bench_pairwise_js.md"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="efficient", help=argparse.SUPPRESS)
    ap.add_argument("--chunk", type=int, default=8, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)

    n = 2 * args.m
    rows = [run_variant("naive", 0, args)]
    for c in [int(x) for x in args.chunks.split(",")]:
        rows.append(run_variant("efficient", c, args))
    naive = rows[0]
    lines = ["# pairwise JS: efficient (chunked autograd Function) vs naive broadcast",
             "",
             f"Command: `python experiments/bench/bench_pairwise_js.py --m {args.m} --vocab {args.vocab} --chunks {args.chunks}"
             f" --repeats {args.repeats}`",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()}-core CPU, {_ram_gb()} GB RAM, no GPU; "
             f"python {platform.python_version()}",
             f"Shape: N = 2m = {n} views, |V| = {args.vocab}; forward + backward; time = median of {args.repeats} "
             f"after {args.warmup} warm-up; peak = extra ru_maxrss in a fresh subprocess.",
             f"Naive (N, N, |V|) float32 tensor alone: {n * n * args.vocab * 4 / 2**20:.0f} MiB.",
             "",
             "| variant | chunk | time (s) | peak extra memory (MiB) | time / naive | memory / naive |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['chunk'] or '-'} | {r['median_s']:.3f} | {r['peak_mib']:.0f} | "
                     f"{r['median_s'] / naive['median_s']:.2f} | {r['peak_mib'] / naive['peak_mib']:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)



def _ram_gb() -> int:
    return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)


if __name__ == "__main__":
    main()
