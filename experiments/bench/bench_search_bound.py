"""Exact search against the machine's compute bound: the numpy kernel over N x dim float32 vectors on disk.

The peer is the bound itself, measured in the same run: the BLAS matmul (numpy's ``np.matmul``, the one the
kernel calls) of the kernel's own shape -- ``query_batch_size x dim`` queries times one ``block_size x dim``
block, the block resident in memory -- repeated for ``--bound-seconds``, in the better of two arrangements: one
BLAS-threaded call, or ``--threads`` workers each multiplying its share of the block in L2-sized tiles with the BLAS
on one thread (how the kernel's fused path runs it).  Its FLOP rate is what the cores can do for this product;
exact search cannot do more than ``2 x queries x N x dim`` FLOPs at that rate.  The search
(``pyterrier_cpdae.dense.kernels.numpy_search``, what ``DenseIndex.np_retriever`` runs, without the docno lookup and
frame building that bench_search.py times) streams the vectors from a memmap, as an index's ``vectors.bin`` is
read; its fused path (the default: tiles scored and filtered in the cache) and its unfused one (each block's scores
in one matmul, then filtered) are timed in turn (``--paths``).  Each search is bracketed by two bound measurements
and reported as a share of their mean, so a machine whose speed drifts during the run (a shared host) is compared
with itself at that moment.  A matmul-only pass over the memmap (no top-k) shows what streaming the vectors costs
on its own.

Correctness: the top-k of ``--check-queries`` queries is compared with a float64 brute force over all N scores
(ties by ascending id, as the kernel documents): any difference must lie between documents whose float64 scores
are within float32 rounding of each other (a BLAS of another shape may round two near ties the other way).

The vectors are synthetic (seeded standard normal, like bench_search.py); ``--vectors PATH.npy`` keeps them in a
file (created at the first run with ``--docs`` rows, reused afterwards), so the 8.8M x 384 set (13.6 GB) is made
once.  Queries are seeded standard normal too.

Usage:
    python experiments/bench/bench_search_bound.py --vectors /tmp/msmarco_like.npy --docs 8841823 --dim 384 \\
        [--queries 1000] [--ks 1000 10] [--repeats 2] [--block-size 16384] [--threads N] [--paths fused unfused]
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from pyterrier_cpdae._checks import default_num_threads
from pyterrier_cpdae.dense.kernels import numpy_search


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()}-core CPU ({model or platform.machine()}), {mem:.0f} GB, numpy {np.__version__}"


def commit() -> str:
    """The source tree's commit (``pretrain.export.record.toolkit_info``, as model cards record it; imported here:
    the package registers its model types with transformers, seconds that a refused run need not spend)."""
    from pretrain.export.record import toolkit_info

    info = toolkit_info()
    return (info["commit"] or "unknown")[:7] + (" (uncommitted changes)" if info.get("dirty") else "")


def vectors(path, docs: int, dim: int) -> np.ndarray:
    """The N x dim float32 vectors: read from ``path`` (a .npy memmap), created there first if absent."""
    if path is None:
        return np.random.default_rng(0).standard_normal((docs, dim), dtype=np.float32)
    path = Path(path)
    if not path.exists():
        tmp = path.with_name(path.name + ".partial.npy")
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(docs, dim))
        rng = np.random.default_rng(0)
        for start in range(0, docs, 500_000):
            end = min(docs, start + 500_000)
            out[start:end] = rng.standard_normal((end - start, dim), dtype=np.float32)
        out.flush()
        del out
        os.replace(tmp, path)
    vecs = np.load(path, mmap_mode="r")
    if vecs.dtype != np.float32 or vecs.ndim != 2:
        raise SystemExit(f"{path}: expected a 2-d float32 .npy, found {vecs.dtype} with shape {vecs.shape}")
    if vecs.shape != (docs, dim):
        raise SystemExit(f"{path}: holds {vecs.shape[0]} x {vecs.shape[1]} vectors, the options ask for "
                         f"--docs {docs} --dim {dim}: give the same sizes or another --vectors path")
    return vecs


def bound(queries: np.ndarray, block: np.ndarray, seconds: float) -> float:
    """GFLOP/s of ``queries @ block.T`` into a reused buffer (one BLAS-threaded call), repeated for ``seconds``."""
    out = np.empty((len(queries), len(block)), dtype=np.float32)
    np.matmul(queries, block.T, out=out)
    flops = 2.0 * queries.shape[0] * queries.shape[1] * block.shape[0]
    reps, t0 = 0, time.perf_counter()
    while True:
        np.matmul(queries, block.T, out=out)
        reps += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return reps * flops / elapsed / 1e9


def bound_tiled(queries: np.ndarray, block: np.ndarray, seconds: float, threads: int) -> float:
    """GFLOP/s of the same product arranged as the fused kernel runs it: ``threads`` workers, each multiplying the
    queries by its share of ``block`` one L2-sized tile at a time, the BLAS on one thread per call (the kernel's own
    tile size and limit: ``kernels._TILE_SCORE_BYTES``, ``kernels.one_blas_thread``); repeated for ``seconds``."""
    from concurrent.futures import ThreadPoolExecutor

    from pyterrier_cpdae.dense import kernels

    q = len(queries)
    tile = max(64, kernels._TILE_SCORE_BYTES // (4 * q))
    edges = np.linspace(0, len(block), threads + 1).astype(int)

    def work(span):
        lo, hi = span
        out = np.empty(q * tile, dtype=np.float32)
        done, t0 = 0.0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for s in range(lo, hi, tile):
                rows = block[s:min(s + tile, hi)]
                np.matmul(queries, rows.T, out=out[:q * len(rows)].reshape(q, len(rows)))
                done += 2.0 * q * queries.shape[1] * len(rows)
        return done, time.perf_counter() - t0

    one = kernels.one_blas_thread()
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(threads) as pool:
        if one is not None:
            stack.enter_context(one)
        results = list(pool.map(work, zip(edges[:-1], edges[1:])))
    return sum(d for d, _ in results) / max(t for _, t in results) / 1e9


def measure_bound(queries: np.ndarray, block: np.ndarray, seconds: float, threads: int) -> tuple:
    """(bound, one call's GFLOP/s, tiled GFLOP/s): the bound is the better of the two arrangements of the product."""
    whole = bound(queries, block, seconds / 2)
    tiled = bound_tiled(queries, block, seconds / 2, threads)
    return max(whole, tiled), whole, tiled


def brute_force(vecs: np.ndarray, queries: np.ndarray, k: int, chunk: int = 262_144) -> np.ndarray:
    """Float64 scores of ``queries`` against all N vectors (the reference the kernel's ranking is checked on)."""
    q64 = queries.astype(np.float64)
    scores = np.empty((len(queries), len(vecs)), dtype=np.float64)
    for start in range(0, len(vecs), chunk):
        scores[:, start:start + chunk] = q64 @ np.asarray(vecs[start:start + chunk], dtype=np.float64).T
    return scores


def agrees(ids: np.ndarray, scores: np.ndarray, ref: np.ndarray, k: int, tol: float) -> tuple:
    """(identical, equivalent) for one query: the kernel's ``ids`` against the float64 ``ref`` scores.

    Identical: the same ids in the same order as the float64 ranking (ties by ascending id).  Equivalent: any
    difference is between documents whose float64 scores lie within ``tol`` of each other (float32 rounding
    of two nearly tied documents, which another BLAS block shape may round the other way), the kernel's scores
    are within ``tol`` of the float64 ones, and they descend.
    """
    kth = np.partition(ref, len(ref) - k)[len(ref) - k]
    cand = np.flatnonzero(ref >= kth - tol)
    order = cand[np.lexsort((cand, -ref[cand]))][:k]
    if np.array_equal(ids, order):
        return True, True
    ok = np.all(np.abs(scores - ref[ids]) <= tol) and np.all(np.diff(scores) <= 0)
    missing = np.setdiff1d(order, ids)
    extra = np.setdiff1d(ids, order)
    ok = ok and np.all(ref[missing] <= ref[ids].min() + 2 * tol) and np.all(ref[extra] >= kth - 2 * tol)
    ok = ok and np.all(np.diff(ref[ids]) <= 2 * tol)  # out of order only among near ties
    return False, bool(ok)


def main(argv: list | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vectors", default=None, help="a .npy file of float32 vectors (created if absent)")
    parser.add_argument("--docs", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--ks", type=int, nargs="+", default=[1000, 10])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=16384)
    parser.add_argument("--query-batch-size", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=None,
                        help="the kernel's filtering threads (when the installed kernel has the option)")
    parser.add_argument("--paths", nargs="+", choices=["fused", "unfused", "default"], default=None,
                        help="the kernel's paths timed in turn (default: fused and unfused where the kernel has "
                        "both; 'default': the kernel's own, for a tree before the fused path)")
    parser.add_argument("--bound-seconds", type=float, default=3.0)
    parser.add_argument("--check-queries", type=int, default=16)
    parser.add_argument("--json", default=None, help="also write the result table's rows to this JSON file")
    args = parser.parse_args(argv)

    print(f"machine: {machine()}; load average (1 min) at the start: {os.getloadavg()[0]:.1f}")
    print(f"code: {commit()}; kernel: pyterrier_cpdae.dense.kernels.numpy_search")
    vecs = vectors(args.vectors, args.docs, args.dim)
    n, dim = vecs.shape
    queries = np.random.default_rng(1).standard_normal((args.queries, dim), dtype=np.float32)
    kwargs = {"block_size": args.block_size, "query_batch_size": args.query_batch_size}
    if "threads" in inspect.signature(numpy_search).parameters:
        kwargs["threads"] = args.threads
    elif args.threads is not None:
        raise SystemExit("--threads: the installed numpy_search has no threads option")
    paths = args.paths or (["fused", "unfused"] if "fused" in inspect.signature(numpy_search).parameters
                           else ["default"])
    if any(p != "default" for p in paths) and "fused" not in inspect.signature(numpy_search).parameters:
        raise SystemExit("--paths: the installed numpy_search has no fused option; use --paths default")
    threads = args.threads or default_num_threads()
    if "fused" in paths:
        from pyterrier_cpdae.dense import kernels

        scores_mib = min(args.queries, args.query_batch_size) * args.block_size * 4 / 2**20
        applies = threads > 1 and scores_mib * 2**20 >= kernels._FUSED_MIN_SCORE_BYTES
        print(f"fused path: {'taken' if applies else 'NOT taken at this shape (the kernel scores whole blocks)'} "
              f"({threads} workers; {scores_mib:.1f} MiB of scores per block, fused from "
              f"{kernels._FUSED_MIN_SCORE_BYTES / 2**20:.0f} MiB with more than one worker)")
    qb = queries[:args.query_batch_size]
    block = np.ascontiguousarray(vecs[:args.block_size])
    flops = 2.0 * len(queries) * n * dim
    print(f"corpus: {n:,} x {dim} float32 ({vecs.nbytes / 2**30:.1f} GiB, "
          f"{'memmap ' + str(args.vectors) if args.vectors else 'in memory'}); {len(queries)} queries; "
          f"{flops / 1e12:.2f} TFLOP per search; kernel options {kwargs}; paths {paths}")

    # a matmul-only pass over the vectors: warms the page cache and shows what streaming them costs
    out = np.empty((len(qb), args.block_size), dtype=np.float32)
    b0 = measure_bound(qb, block, args.bound_seconds, threads)
    t0 = time.perf_counter()
    for start in range(0, n - args.block_size + 1, args.block_size):
        np.matmul(qb, np.asarray(vecs[start:start + args.block_size]).T, out=out)
    full = (n // args.block_size) * args.block_size
    mm = 2.0 * len(qb) * full * dim / (time.perf_counter() - t0) / 1e9
    b1 = measure_bound(qb, block, args.bound_seconds, threads)
    print(f"compute bound (resident {len(qb)} x {dim} @ {dim} x {args.block_size} sgemm, the better of one "
          f"BLAS-threaded call and {threads} single-threaded workers in L2-sized tiles): {b0[0]:.1f}, {b1[0]:.1f} "
          f"GFLOP/s (one call {b0[1]:.1f}, {b1[1]:.1f}; tiled {b0[2]:.1f}, {b1[2]:.1f}); matmul-only pass over the "
          f"memmap (one call per block): {mm:.1f} GFLOP/s = {mm / ((b0[0] + b1[0]) / 2):.1%} of the bound")

    rows = []
    check = np.random.default_rng(2).choice(len(queries), size=min(args.check_queries, len(queries)), replace=False)
    for k in args.ks:
        shares = {p: [] for p in paths}
        rates = {p: [] for p in paths}
        walls = {p: [] for p in paths}
        results = {}
        for _ in range(args.repeats):
            for path in paths:  # in turn within each repeat: a drifting machine reaches both alike
                extra = {} if path == "default" else {"fused": path == "fused"}
                before = measure_bound(qb, block, args.bound_seconds, threads)[0]
                t0 = time.perf_counter()
                scores, ids = numpy_search([(vecs, 0, 1)], queries, k, **kwargs, **extra)
                wall = time.perf_counter() - t0
                after = measure_bound(qb, block, args.bound_seconds, threads)[0]
                rate = flops / wall / 1e9
                walls[path].append(wall)
                rates[path].append(rate)
                shares[path].append(rate / ((before + after) / 2))
                if not np.isfinite(scores).all():
                    raise SystemExit(f"k={k} {path}: non-finite scores in the result")
                results[path] = (scores, ids)
        ref = brute_force(vecs, queries[check], min(k, n))
        tol = 1e-5 * float(np.abs(ref).max())
        for path in paths:
            scores, ids = results[path]
            verdicts = [agrees(ids[q], scores[q], ref[i], min(k, n), tol) for i, q in enumerate(check)]
            same = float(np.mean([v[0] for v in verdicts]))
            if not all(v[1] for v in verdicts):
                bad = [int(q) for q, v in zip(check, verdicts) if not v[1]]
                raise SystemExit(f"k={k} {path}: the kernel's ranking differs from the float64 brute force beyond "
                                 f"float32 rounding (tolerance {tol:.2g}) for queries {bad}")
            rows.append((k, path, statistics.median(walls[path]), statistics.median(rates[path]),
                         statistics.median(shares[path]), min(shares[path]), max(shares[path]), same))
            print(f"k={k} {path}: rankings equal to the float64 brute force's up to float32 rounding (tolerance "
                  f"{tol:.2g}) for all {len(check)} checked queries; identical ids in identical order for {same:.0%}")
        if len(paths) > 1:
            first = results[paths[0]]
            print(f"k={k}: {paths[0]} and {' / '.join(paths[1:])} return identical ids for "
                  + ", ".join(f"{np.mean(np.all(results[p][1] == first[1], axis=1)):.1%}" for p in paths[1:])
                  + " of the queries")

    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}")
    print()
    print("| k | path | search wall s (median) | queries/s | GFLOP/s | share of the compute bound (median, range) |")
    print("|---|---|---|---|---|---|")
    for k, path, wall, rate, share, lo, hi, _ in rows:
        print(f"| {k} | {path} | {wall:.1f} | {len(queries) / wall:.1f} | {rate:.1f} | **{share:.1%}** "
              f"({lo:.1%}-{hi:.1%}) |")
    for k in args.ks:
        mine = {path: wall for kk, path, wall, *_ in rows if kk == k}
        if "fused" in mine and "unfused" in mine:
            print(f"k={k}: fused is {mine['unfused'] / mine['fused']:.2f}x the unfused path's speed (same run)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"docs": n, "dim": dim, "queries": len(queries), "threads": threads, "bounds_gflops":
                       [b0[0], b1[0]], "rows": [dict(k=k, path=path, wall_s=wall, gflops=rate, share=share,
                                                    share_min=lo, share_max=hi, identical=same)
                                               for k, path, wall, rate, share, lo, hi, same in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
