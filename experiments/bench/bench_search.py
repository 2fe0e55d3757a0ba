"""Exact-search throughput: DenseIndex.np_retriever vs pyterrier-dr's FlexIndex.np_retriever.

Both indexes hold the same synthetic float32 vectors; both retrievers are full PyTerrier transformers
(query frame in, result frame out), timed end to end on the same queries in the same process, interleaved,
``--repeats`` times each (after one warm-up): the median and range of the wall time and of the process CPU time
are reported (on a busy machine the CPU-time ratio is the steadier one).  torch_retriever (CPU here) is shown for reference; on a CUDA machine
its GPU figure is measured too.

Usage:
    python experiments/bench/bench_search.py [--docs 100000] [--dim 384] [--queries 1000] [--ks 10 1000] [--repeats 3]
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
import pandas as pd


def machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()}), {mem:.0f} GB, {gpu}"


def timed(fns: dict, repeats: int) -> tuple[dict, dict, dict]:
    """Runs each of ``fns`` once (warm-up) then ``repeats`` times interleaved: wall and CPU seconds, last outputs."""
    outs = {name: fn() for name, fn in fns.items()}
    wall: dict = {name: [] for name in fns}
    cpu: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            outs[name] = fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return wall, cpu, outs


def summary(ref: list, ours: list) -> str:
    """Median speed-up of ``ours`` over ``ref`` (ratio of median times) and its range over the repeats."""
    ratios = [r / o for r, o in zip(ref, ours)]
    return f"{statistics.median(ref) / statistics.median(ours):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--ks", type=int, nargs="+", default=[10, 1000])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch
    from pyterrier_dr import FlexIndex

    from pyterrier_cpdae.dense import DenseIndex

    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((args.docs, args.dim), dtype=np.float32)
    queries = rng.standard_normal((args.queries, args.dim), dtype=np.float32)
    topics = pd.DataFrame({"qid": [str(i) for i in range(args.queries)], "query_vec": list(queries)})

    print("$ python " + " ".join(sys.argv))
    print(f"machine: {machine()}; load average (1 min) at the start: {os.getloadavg()[0]:.1f}")
    print(f"corpus: {args.docs} x {args.dim} float32 synthetic; {args.queries} queries; {args.repeats} repeats "
          "(median, range in brackets)")
    with tempfile.TemporaryDirectory() as tmp:
        docs = ({"docno": f"d{i}", "doc_vec": vecs[i]} for i in range(args.docs))
        ours = DenseIndex(Path(tmp) / "cpdae")
        ours.indexer().index(docs)
        flex = FlexIndex(str(Path(tmp) / "flex"), verbose=False)
        flex.index({"docno": f"d{i}", "doc_vec": vecs[i]} for i in range(args.docs))

        rows = []
        for k in args.ks:
            fns = {"pyterrier_dr FlexIndex.np_retriever": lambda: flex.np_retriever(num_results=k)(topics),
                   "DenseIndex.np_retriever": lambda: ours.np_retriever(num_results=k)(topics),
                   "DenseIndex.torch_retriever(cpu)": lambda: ours.torch_retriever(num_results=k, device="cpu")(topics)}
            if torch.cuda.is_available():
                fns["DenseIndex.torch_retriever(cuda)"] = lambda: ours.torch_retriever(num_results=k,
                                                                                       device="cuda")(topics)
            wall, cpu, outs = timed(fns, args.repeats)
            r_ours, r_flex = outs["DenseIndex.np_retriever"], outs["pyterrier_dr FlexIndex.np_retriever"]
            same = (r_ours.groupby("qid")["docno"].apply(set) == r_flex.groupby("qid")["docno"].apply(set)).mean()
            print(f"k={k}: identical top-k docno sets for {same:.1%} of queries (ours vs FlexIndex)")
            ref = "pyterrier_dr FlexIndex.np_retriever"
            for name in fns:
                rows.append((k, name, args.queries / statistics.median(wall[name]), summary(wall[ref], wall[name]),
                             summary(cpu[ref], cpu[name])))
            if not torch.cuda.is_available():
                rows.append((k, "DenseIndex.torch_retriever(cuda)", None, "not run: no GPU lent", ""))

    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}")
    print()
    print("| k | retriever | queries/s (wall, median) | speed-up vs FlexIndex (wall) | speed-up vs FlexIndex (CPU time) |")
    print("|---|---|---|---|---|")
    for k, name, qps, ratio_wall, ratio_cpu in rows:
        print(f"| {k} | {name} | {'' if qps is None else f'{qps:.1f}'} | {ratio_wall} | {ratio_cpu} |")

if __name__ == "__main__":
    main()
