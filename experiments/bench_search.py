"""Exact-search throughput: DenseIndex.np_retriever vs pyterrier-dr's FlexIndex.np_retriever.

Both indexes hold the same synthetic float32 vectors; both retrievers are full PyTerrier transformers
(query frame in, result frame out), timed end to end on the same queries in the same process.  The best
of ``--repeats`` runs is reported.  torch_retriever (CPU here) is shown for reference; on a CUDA machine
its GPU figure is measured too.

Usage:
    python experiments/bench_search.py [--docs 100000] [--dim 384] [--queries 1000] [--ks 10 1000]
"""
from __future__ import annotations

import argparse
import os
import platform
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


def best_time(fn, repeats: int) -> tuple[float, pd.DataFrame]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--ks", type=int, nargs="+", default=[10, 1000])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    import torch
    from pyterrier_dr import FlexIndex

    from pyterrier_cpdae.dense_index import DenseIndex

    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((args.docs, args.dim), dtype=np.float32)
    queries = rng.standard_normal((args.queries, args.dim), dtype=np.float32)
    topics = pd.DataFrame({"qid": [str(i) for i in range(args.queries)], "query_vec": list(queries)})

    print(f"machine: {machine()}")
    print(f"corpus: {args.docs} x {args.dim} float32 synthetic; {args.queries} queries; best of {args.repeats}")
    with tempfile.TemporaryDirectory() as tmp:
        docs = ({"docno": f"d{i}", "doc_vec": vecs[i]} for i in range(args.docs))
        ours = DenseIndex(Path(tmp) / "cpdae")
        ours.indexer().index(docs)
        flex = FlexIndex(str(Path(tmp) / "flex"), verbose=False)
        flex.index({"docno": f"d{i}", "doc_vec": vecs[i]} for i in range(args.docs))

        rows = []
        for k in args.ks:
            t_ours, r_ours = best_time(lambda: ours.np_retriever(num_results=k)(topics), args.repeats)
            t_flex, r_flex = best_time(lambda: flex.np_retriever(num_results=k)(topics), args.repeats)
            t_torch, _ = best_time(lambda: ours.torch_retriever(num_results=k, device="cpu")(topics), args.repeats)
            same = (r_ours.groupby("qid")["docno"].apply(set) == r_flex.groupby("qid")["docno"].apply(set)).mean()
            rows.append((k, "DenseIndex.np_retriever", args.queries / t_ours, t_flex / t_ours))
            rows.append((k, "pyterrier_dr FlexIndex.np_retriever", args.queries / t_flex, 1.0))
            rows.append((k, "DenseIndex.torch_retriever(cpu)", args.queries / t_torch, t_flex / t_torch))
            if torch.cuda.is_available():
                t_gpu, _ = best_time(lambda: ours.torch_retriever(num_results=k, device="cuda")(topics), args.repeats)
                rows.append((k, "DenseIndex.torch_retriever(cuda)", args.queries / t_gpu, t_flex / t_gpu))
            else:
                rows.append((k, "DenseIndex.torch_retriever(cuda)", float("nan"), float("nan")))
            print(f"k={k}: identical top-k docno sets for {same:.1%} of queries (ours vs FlexIndex)")

    print()
    print(f"{'k':>5}  {'retriever':<38} {'queries/s':>10}  {'speed-up vs FlexIndex.np_retriever':>34}")
    for k, name, qps, ratio in rows:
        if np.isnan(qps):
            print(f"{k:>5}  {name:<38} {'not run: no GPU lent':>10}")
        else:
            print(f"{k:>5}  {name:<38} {qps:>10.1f}  {ratio:>33.2f}x")


if __name__ == "__main__":
    main()
