"""What settling exact ties costs: ``DenseIndex.search`` (numpy backend) against its kernel alone.

``DenseIndex.search`` asks the kernel for ``k + extra`` candidates and re-scores those near a tie in a
position-free float64 arithmetic (``pyterrier_cpdae.dense.ties``); the peer is the kernel itself
(``pyterrier_cpdae.dense.kernels.numpy_search`` on the index's own memmap, top ``k``, no settling), timed in the same
run: within each repeat the two rows are timed in turn, so a shared machine's drift touches both alike.  The
vectors and queries are seeded standard normal float32 (the index is built in a temporary folder); the figure is the
median over ``--repeats`` after one warm-up, and the ratio is settled / kernel of the medians.

Usage:
    python experiments/bench/bench_ties.py [--docs 100000] [--dim 384] [--queries 300] [--ks 10 100 1000]
        [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()}-core CPU ({model or platform.machine()}), numpy {np.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--ks", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from pyterrier_cpdae.dense import DenseIndex
    from pyterrier_cpdae.dense.kernels import numpy_search

    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((args.docs, args.dim), dtype=np.float32)
    queries = rng.standard_normal((args.queries, args.dim), dtype=np.float32)
    print("$ python " + " ".join(sys.argv))
    print(f"machine: {machine()}; load average (1 min) at the start: {os.getloadavg()[0]:.1f}")
    print(f"corpus: {args.docs} x {args.dim} float32 seeded normal; {args.queries} queries; {args.repeats} repeats "
          "after one warm-up (median; range in brackets)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        index = DenseIndex(Path(tmp) / "index")
        index.indexer().index({"docno": f"d{i}", "doc_vec": vecs[i]} for i in range(args.docs))
        store = index.store
        _, parts, _ = store.open()
        for k in args.ks:
            fns = {"settled": lambda: index.search(queries, k, backend="numpy"),
                   "kernel": lambda: numpy_search(parts, queries, k)}
            outs = {name: fn() for name, fn in fns.items()}  # warm-up (and the memmap's pages)
            times: dict = {name: [] for name in fns}
            for _ in range(args.repeats):
                for name, fn in fns.items():
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            same = float(np.mean([set(a) == set(b) for a, b in zip(outs["settled"][1], outs["kernel"][1])]))
            rows.append((k, times, same))
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}")
    print()
    print("| k | kernel alone (s) | DenseIndex.search, settled (s) | settled / kernel | overhead per query (ms) "
          "| same top-k id sets |")
    print("|---|---|---|---|---|---|")
    for k, times, same in rows:
        kern, sett = (statistics.median(times[n]) for n in ("kernel", "settled"))
        ratios = [s / t for s, t in zip(times["settled"], times["kernel"])]
        print(f"| {k} | {kern:.3f} ({min(times['kernel']):.3f}-{max(times['kernel']):.3f}) | {sett:.3f} "
              f"({min(times['settled']):.3f}-{max(times['settled']):.3f}) | {sett / kern:.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}) | {1000 * (sett - kern) / args.queries:.2f} | {same:.1%} |")


if __name__ == "__main__":
    main()
