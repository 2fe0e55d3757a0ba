"""Peak memory while indexing: is DenseIndex.indexer() bounded by the batch, not the corpus?

Indexes N synthetic vectors (generated lazily, one record at a time) in a fresh subprocess per N and
reports each child's peak RSS (``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss`` measured around that
child alone) together with the RSS just before indexing started (imports + interpreter).

Usage:
    python experiments/bench/bench_index_memory.py [--sizes 10000 200000] [--dim 384]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
import numpy as np
from pyterrier_cpdae.dense import DenseIndex
n, dim, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
def docs():
    rng = np.random.default_rng(0)
    for i in range(n):
        yield {"docno": f"doc-{i}", "doc_vec": rng.standard_normal(dim, dtype=np.float32)}
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
index = DenseIndex(path)
index.indexer().index(docs())
print(json.dumps({"before_kb": before, "seconds": time.perf_counter() - t0, "count": len(index)}))
"""


def run_child(n: int, dim: int, path: Path) -> dict:
    import resource

    out = subprocess.run([sys.executable, "-c", CHILD, str(n), str(dim), str(path)], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    info = json.loads(out.stdout.strip().splitlines()[-1])
    # ru_maxrss of RUSAGE_CHILDREN is the max over all waited-for children; children run in increasing size
    # order, so we run each size in its own intermediate process to isolate it
    info["peak_kb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 200_000])
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.one is not None:  # intermediate process: runs exactly one indexing child, so RUSAGE_CHILDREN is its own
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(run_child(args.one, args.dim, Path(tmp) / "index")))
        return

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    print(f"machine: {os.cpu_count()}-core CPU ({platform.machine()}), {mem:.0f} GB, no GPU needed")
    results = {}
    for n in args.sizes:
        out = subprocess.run([sys.executable, __file__, "--one", str(n), "--dim", str(args.dim)], capture_output=True,
                             text=True, check=True)
        results[n] = json.loads(out.stdout.strip().splitlines()[-1])
        r = results[n]
        corpus_mb = n * args.dim * 4 / 2**20
        print(f"N={n:>8} dim={args.dim}: vectors {corpus_mb:7.1f} MiB on disk; peak RSS {r['peak_kb'] / 1024:7.1f} MiB "
              f"(before indexing {r['before_kb'] / 1024:6.1f} MiB); {n / r['seconds']:,.0f} docs/s")
    lo, hi = min(args.sizes), max(args.sizes)
    ratio = results[hi]["peak_kb"] / results[lo]["peak_kb"]
    growth = (results[hi]["peak_kb"] - results[hi]["before_kb"]) / max(1, results[lo]["peak_kb"] - results[lo]["before_kb"])
    print(f"peak RSS ratio N={hi} / N={lo}: {ratio:.3f}x (target <= 1.2x; corpus is {hi / lo:.0f}x larger); "
          f"growth over the pre-indexing baseline: {growth:.2f}x")


if __name__ == "__main__":
    main()
