"""An MS MARCO-sized int8 index on one small machine: 8.8M x 768 (the passage count at BERT-base's width) built in
streaming, searched with the int8 codes in memory and the float32 copy on disk read only for rescoring.

Its float32 vectors alone (27 GB) exceed the memory of a 24 GB machine, so a float32 index streams them from disk
at every search; the int8 codes (6.8 GB) stay in memory (the page cache, through the index's memmap).

Stages (each in its own process, so that each one's peak memory is its own):

``build``
    ``--docs`` x ``--dim`` synthetic float32 vectors, generated in chunks of 65,536 (seeded), streamed as
    ``docno``/``doc_vec`` frames into ``DenseIndex(...).indexer(mode="resume", dtype="int8")`` -- the indexer's
    normal streaming and resumable path (a killed build continues where it stopped when run again). Records the
    build's wall time, its peak memory and the index's files.
``search``
    ``--queries`` synthetic queries through the normal retriever (``index.retriever(num_results=k)``: the int8
    scan with ``torch._int_mm`` and float32 rescoring from the float copy) at each ``--ks``, after one warm-up
    search that reads the codes into memory. Records q/s, the process's peak memory after the searches (VmHWM:
    the codes mapped from the page cache count in it), the float rows read per query (the store's ``vectors_of``,
    counted), and the int8 compute bound measured in the same process with the same kernel: ``torch._int_mm`` of
    the scan's query batch (the same int8 query rows, padded as the scan pads them) by one resident
    ``--block-size`` x dim int8 block, repeated for ``--bound-seconds`` before and after each search; a search
    cannot do more than one scan of ``2 x queries x N x dim`` integer operations at that rate, so the bound's time
    over the search's time is its share of the bound. The search's own stats split its time into the scan and the
    rescoring; ``--breakdown`` adds one pass of the scan's product alone (the scan's tiles and workers), and
    ``--cold-float-copy`` drops the float copy's pages from the page cache before each search. Then correctness: for ``--check-queries`` queries, an exact
    search over the float copy streamed in chunks (float64 products of the float32 values, each score rounded
    once to float32, ties by ascending id: the float32 index's ranking) must give the identical top-k ids.

The synthetic vectors (the shape of a BERT-base encoder's [CLS]/mean-pooled outputs; a choice, documented here):

* a shared mean direction carrying half of each vector's squared norm before normalisation (BERT's outputs are
  anisotropic: two unrelated passages have a cosine well above 0, so the scores are not all near 0);
* topical structure: 16,384 centres; a document is its centre plus noise, per-dimension widths log-normal
  (sigma 0.5) and two outlier dimensions 6x wider than the rest (as BERT-base has a few);
* the norm of each vector log-normal around 12 with a 5% spread (sigma 0.05), the order of BERT-base
  [CLS] vectors' norms;
* queries: a centre plus more noise (0.7 of the documents' spread) and the same mean direction, norms as the
  documents'.

Usage (from the repository root; PYTHONPATH=$PWD so that this tree's package is the one measured):
    PYTHONPATH=$PWD python experiments/bench/bench_int8_msmarco_scale.py --workdir $TMPDIR/msmarco_int8 \\
        [--docs 8841823] [--dim 768] [--queries 200] [--ks 10 1000] [--check-queries 8] [--json out.json] \\
        [--stage all|build|search] [--float-copy-random] [--cold-float-copy] [--breakdown] [--memory-limit-gib 4] \\
        [--no-lock-codes]
    python experiments/bench/bench_int8_msmarco_scale.py --workdir $TMPDIR/msmarco_int8 --clean   # delete its data

``--stage all`` (the default) builds (or reuses a complete build in ``--workdir``) and searches; ``--stage search``
searches an index built before. The summary is printed and, with ``--json``, written as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

CHUNK = 65536
CENTRES = 16384
MEAN_SHARE = 0.5  # share of the squared norm (before normalisation) on the shared mean direction
NORM_MEAN, NORM_SIGMA = 12.0, 0.05
DIM_SIGMA, OUTLIERS, OUTLIER_WIDTH = 0.5, 2, 6.0
QUERY_NOISE = 0.7


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    model = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        for line in text.splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        simd = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni") if f" {f}" in text]
    except OSError:
        simd = []
    return (f"{os.cpu_count()}-core CPU ({model or platform.machine()}; {', '.join(simd) or 'no SIMD flags read'}), "
            f"{mem:.0f} GB")


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def memory_status() -> dict:
    """The process's memory from /proc/self/status (GiB): VmHWM (peak resident), VmRSS, RssAnon, RssFile; plus
    getrusage's ru_maxrss (peak resident, the same figure where the kernel reports both)."""
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key + "_gib"] = int(value.split()[0]) / 2**20  # kB
    except OSError:
        pass
    out["ru_maxrss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux
    return out


def io_read_bytes() -> int:
    """Bytes this process caused to be read from storage (/proc/self/io ``read_bytes``; 0 where unavailable)."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


# -- synthetic vectors ---------------------------------------------------------------------------------------------
class Synthetic:
    """The seeded generator of the documents and queries (module docstring)."""

    def __init__(self, dim: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.dim = dim
        width = np.exp(rng.normal(0, DIM_SIGMA, dim))
        width[rng.choice(dim, min(OUTLIERS, dim), replace=False)] *= OUTLIER_WIDTH
        width /= np.sqrt(np.mean(width ** 2))  # a unit-variance vector's squared norm is about dim
        self.width = width.astype(np.float32)
        mean = rng.standard_normal(dim)
        # the mean direction's length: MEAN_SHARE of the expected squared norm (centre + noise, each about dim / 2)
        self.mean = (mean / np.linalg.norm(mean) * np.sqrt(dim * MEAN_SHARE / (1 - MEAN_SHARE))).astype(np.float32)
        self.centres = (rng.standard_normal((CENTRES, dim), dtype=np.float32) * np.float32(np.sqrt(0.5))) * self.width
        self.seed = seed

    def _finish(self, rng, vecs: np.ndarray) -> np.ndarray:
        vecs += self.mean
        norms = np.exp(rng.normal(np.log(NORM_MEAN), NORM_SIGMA, len(vecs)))
        vecs *= (norms / np.linalg.norm(vecs, axis=1)).astype(np.float32)[:, None]
        return vecs

    def documents(self, start: int, stop: int) -> np.ndarray:
        """The float32 vectors of documents ``start:stop`` (within one chunk of CHUNK rows: each chunk has its own
        seeded stream, so a chunk is made the same whichever run asks for it)."""
        chunk = start // CHUNK
        assert (stop - 1) // CHUNK == chunk
        rng = np.random.default_rng([self.seed, 1, chunk])
        n = CHUNK  # always the whole chunk (then sliced): the same rows whatever the number of documents
        which = rng.integers(0, CENTRES, n)
        vecs = rng.standard_normal((n, self.dim), dtype=np.float32)
        vecs *= np.float32(np.sqrt(0.5)) * self.width
        vecs += self.centres[which]
        vecs = self._finish(rng, vecs)
        return vecs[start - chunk * CHUNK:stop - chunk * CHUNK]

    def queries(self, num: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 2])
        which = rng.integers(0, CENTRES, num)
        vecs = rng.standard_normal((num, self.dim), dtype=np.float32) * np.float32(np.sqrt(0.5) * QUERY_NOISE)
        vecs *= self.width
        vecs += self.centres[which]
        return self._finish(rng, vecs)


def frames(gen: Synthetic, docs: int):
    import pandas as pd

    for start in range(0, docs, CHUNK):
        stop = min(docs, start + CHUNK)
        vecs = gen.documents(start, stop)
        yield pd.DataFrame({"docno": [f"d{i}" for i in range(start, stop)], "doc_vec": list(vecs)})


def file_sizes(path: Path) -> dict:
    return {p.name: p.stat().st_size for p in sorted(Path(path).iterdir()) if p.is_file()}


# -- build ---------------------------------------------------------------------------------------------------------
def stage_build(args) -> dict:
    from pyterrier_cpdae.dense import DenseIndex

    path = Path(args.workdir) / "index"
    index = DenseIndex(path)
    if index.built():
        meta = index.meta()
        if (int(meta["count"]), int(meta["dim"]), meta["dtype"]) != (args.docs, args.dim, "int8"):
            raise SystemExit(f"{path} holds a {meta['count']} x {meta['dim']} {meta['dtype']} index, not the "
                             f"{args.docs} x {args.dim} int8 one asked for: give another --workdir or --clean it")
        record = Path(args.workdir) / "build.json"
        if record.exists():
            return json.loads(record.read_text())
        return {"reused": True, "files": file_sizes(path)}
    gen = Synthetic(args.dim, args.seed)
    t0 = time.perf_counter()
    index.indexer(mode="resume", dtype="int8").index(frames(gen, args.docs))
    wall = time.perf_counter() - t0
    out = {"build_wall_s": wall, "docs": args.docs, "dim": args.dim, "files": file_sizes(path),
           "memory": memory_status(), "load_average_end": load_average()}
    (Path(args.workdir) / "build.json").write_text(json.dumps(out, indent=1))
    return out



# -- search --------------------------------------------------------------------------------------------------------
def int8_bound(query_rows: np.ndarray, block: np.ndarray, seconds: float) -> float:
    """Integer GOP/s (multiply + add = 2) of the scan's product, ``torch._int_mm`` of the int8 queries (padded to 17
    rows as the scan pads them) by one resident int8 block, repeated for ``seconds``; the operations counted are the
    real queries' (padding rows are the kernel's overhead, as in the search)."""
    import torch

    qt = torch.from_numpy(np.ascontiguousarray(query_rows, dtype=np.int8))
    pad = max(0, 17 - len(qt))
    if pad:
        qt = torch.cat([qt, torch.zeros((pad, qt.shape[1]), dtype=torch.int8)])
    bt = torch.from_numpy(np.ascontiguousarray(block, dtype=np.int8)).T
    torch._int_mm(qt, bt)
    ops = 2.0 * len(query_rows) * block.shape[1] * block.shape[0]
    reps, t0 = 0, time.perf_counter()
    while True:
        torch._int_mm(qt, bt)
        reps += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return reps * ops / elapsed / 1e9


def product_pass(codes: np.ndarray, query_rows: np.ndarray, tile: int, workers: int) -> float:
    """Seconds of one pass of the scan's own product over all the codes, with nothing else: the scan's
    ``int_products`` (``torch._int_mm``, document-major) of each ``tile``-row block of the memmap by the int8 query
    rows, the tiles shared by ``workers`` threads of one torch thread each, as the scan shares them; no filter, no
    candidates."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from pyterrier_cpdae.dense import int8 as int8_search

    operand = int8_search.product_operand(np.asarray(query_rows, dtype=np.int8), "torch")
    before = torch.get_num_threads()
    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(workers, initializer=torch.set_num_threads, initargs=(1,)) as pool:
            list(pool.map(lambda start: int8_search.int_products(np.array(codes[start:start + tile]), operand, "torch"),
                          range(0, len(codes), tile)))
        return time.perf_counter() - t0
    finally:
        torch.set_num_threads(before)


def evict(path: Path) -> None:
    """Drops the float copy's pages (``vectors.bin``) from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``:
    clean pages, no privilege needed), so that a search reads every rescored row from storage, as it does when the
    float copy is far larger than the memory."""
    fd = os.open(Path(path) / "vectors.bin", os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def product_share(codes: np.ndarray, query_rows: np.ndarray, num_queries: int, block_size: int, rate: float) -> dict:
    """One pass of the scan's product alone with the scan's tiles and workers (:func:`product_pass`), and its share
    of the bound (``rate``: the bound's integer GOP/s): what the scan's int8 products cost without their filter and
    candidates."""
    from pyterrier_cpdae._checks import default_num_threads
    from pyterrier_cpdae.dense import int8 as int8_search

    digits = len(query_rows) // num_queries
    tile = int8_search.tile_rows(num_queries, digits, block_size)
    seconds = product_pass(codes, query_rows, tile, max(1, min(default_num_threads(), len(codes) // tile)))
    bound_s = 2.0 * len(query_rows) * codes.shape[0] * codes.shape[1] / rate / 1e9
    return {"product_pass_s": seconds, "tile_rows": tile, "product_pass_share_of_bound": bound_s / seconds}


def lock_in_memory(array: np.ndarray) -> bool:
    """``mlock`` of the pages behind ``array`` (a memmap: its file's pages in the page cache, read in first): they
    stay in memory until the process ends. False where the system refuses (no privilege, or over the limit)."""
    import ctypes

    if not array.nbytes:
        return True
    page = os.sysconf("SC_PAGE_SIZE")
    addr = array.ctypes.data
    start = addr - addr % page
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.mlock(ctypes.c_void_p(start), ctypes.c_size_t(array.nbytes + addr - start)) == 0


def exact_reference(vectors: np.ndarray, queries: np.ndarray, k: int, chunk: int = CHUNK) -> np.ndarray:
    """The float32 index's top-``k`` ids of ``queries``, computed independently: every score is the float64 sum of
    the exact products of the float32 values, rounded once to float32; ties by ascending id. The float copy
    (``vectors``, a memmap) is streamed in chunks; per query, the running top ``k`` (with every document tied with
    its last entry) is merged with each chunk's."""
    q64 = queries.astype(np.float64)
    best_s = [np.empty(0, np.float32) for _ in queries]
    best_i = [np.empty(0, np.int64) for _ in queries]
    for start in range(0, len(vectors), chunk):
        rows = np.asarray(vectors[start:start + chunk], dtype=np.float64)
        scores = (rows @ q64.T).astype(np.float32).T  # (q, rows)
        for j in range(len(queries)):
            s = np.concatenate([best_s[j], scores[j]])
            i = np.concatenate([best_i[j], np.arange(start, start + len(rows), dtype=np.int64)])
            if len(s) > k:
                kth = np.partition(s, len(s) - k)[len(s) - k]
                keep = np.flatnonzero(s >= kth)  # every document tied with the k-th stays
                s, i = s[keep], i[keep]
            order = np.lexsort((i, -s))[:k]
            best_s[j], best_i[j] = s[order], i[order]
    return np.stack(best_i)


def stage_search(args) -> dict:
    import pandas as pd
    import torch

    from pyterrier_cpdae.dense import DenseIndex
    from pyterrier_cpdae.dense import int8 as int8_search

    path = Path(args.workdir) / "index"
    index = DenseIndex(path)
    if not index.built():
        raise SystemExit(f"{path} holds no built index: run --stage build (or all) first")
    meta = index.meta()
    if meta["dtype"] != "int8" or (int(meta["count"]), int(meta["dim"])) != (args.docs, args.dim):
        raise SystemExit(f"{path} holds a {meta['count']} x {meta['dim']} {meta['dtype']} index, not the "
                         f"{args.docs} x {args.dim} int8 one asked for")
    count, dim = int(meta["count"]), int(meta["dim"])
    queries = Synthetic(dim, args.seed).queries(args.queries)
    frame = pd.DataFrame({"qid": [f"q{i}" for i in range(len(queries))], "query_vec": list(queries)})
    codes_part = index.store.code_parts()[0][0]
    one_digit = int8_search.quantise_queries(queries, codes_part.scales)[0]
    two_digits_from = getattr(int8_search, "TWO_DIGITS_FROM", None)  # (a kernel whose queries have one digit: None)

    def scan_rows(k: int) -> np.ndarray:
        """The int8 query rows the scan multiplies the codes by at ``k``: one row per query, or two (digits)."""
        if hasattr(int8_search, "query_digits"):  # (the scan's own choice; a package before it: by k alone)
            two = int8_search.query_digits(index.store.code_parts(), queries, k) == 2
        else:
            two = two_digits_from is not None and k >= two_digits_from
        if two:
            p1, _, p2 = int8_search.split_queries(queries, codes_part.scales)[:3]
            return np.concatenate([p1, p2])
        return one_digit
    block = np.array(codes_part.codes[:args.block_size])
    out = {"docs": count, "dim": dim, "queries": len(queries), "torch": torch.__version__,
           "torch_threads": torch.get_num_threads(), "numpy": np.__version__, "block_size": args.block_size,
           "load_average_start": load_average(), "files": file_sizes(path), "memory_start": memory_status()}
    import pyterrier_cpdae

    out["package"] = str(Path(pyterrier_cpdae.__file__).resolve().parent)
    print(f"machine: {machine()}; load average (1 min): {out['load_average_start']:.1f}; pyterrier_cpdae from "
          f"{out['package']}", flush=True)
    watchdog = _Watchdog(args.memory_limit_gib, Path(args.workdir) / "search.json", out)

    # the codes in memory: their pages (the page cache behind the index's own memmap) locked there, so that other
    # work on the machine cannot evict them between the searches; then a one-query search (first-call costs)
    read0 = io_read_bytes()
    out["codes_lock_s"], out["codes_locked"] = _timed(lambda: lock_in_memory(codes_part.codes)) if args.lock_codes \
        else (0.0, False)
    out["codes_lock_read_gib"] = (io_read_bytes() - read0) / 2**30
    print(f"codes ({codes_part.codes.nbytes / 2**30:.2f} GiB) locked in memory: {out['codes_locked']} "
          f"({out['codes_lock_s']:.1f} s, {out['codes_lock_read_gib']:.2f} GiB read from storage)", flush=True)
    if args.float_copy_random:  # the float copy's pages read one by one (no readahead around each rescored row)
        import mmap

        vectors = index.store.open()[1][0][0]
        vectors._mmap.madvise(mmap.MADV_RANDOM)
    out["float_copy_madvise_random"] = bool(args.float_copy_random)
    out["cold_float_copy"] = bool(args.cold_float_copy)
    out["warmup_search_s"] = _timed(lambda: index.retriever(num_results=min(args.ks))(frame.iloc[:1]))[0]
    print(f"warm-up: 1-query search {out['warmup_search_s']:.1f} s", flush=True)

    # the float rows read (the float copy is read through the store's vectors_of, only to rescore)
    store = index.store
    counted = {"rows": 0, "calls": 0}
    original = store.vectors_of

    def counting_vectors_of(ids):
        counted["rows"] += len(ids)
        counted["calls"] += 1
        return original(ids)

    store.vectors_of = counting_vectors_of
    # the int8 search's stats (its scan's and its rescoring's time), taken from the search the retriever runs
    searched: dict = {}
    int8_run = int8_search.search

    def search_with_stats(*a, **kw):
        kw["stats"] = searched
        return int8_run(*a, **kw)

    int8_search.search = search_with_stats
    ops = 2.0 * len(queries) * count * dim
    results, runs = {}, []
    out["runs"] = runs
    try:
        for k in args.ks:
            query_rows = scan_rows(k)
            watchdog.doing = f"the k={k} search"
            before = int8_bound(query_rows, block, args.bound_seconds)
            if args.cold_float_copy:
                evict(index.path)
            counted.update(rows=0, calls=0)
            searched.clear()
            read0 = io_read_bytes()
            wall, res = _timed(lambda: index.retriever(num_results=k)(frame))
            read = io_read_bytes() - read0
            after = int8_bound(query_rows, block, args.bound_seconds)
            rate = (before + after) / 2  # integer GOP/s counted on the real queries' rows (digits x queries)
            digits = len(query_rows) // len(queries)
            scan_ops = ops * digits
            bound_s = scan_ops / rate / 1e9
            res = res.sort_values(["qid", "rank"], key=lambda c: c.str[1:].astype(int) if c.name == "qid" else c)
            results[k] = res["docid"].to_numpy().reshape(len(queries), -1)
            run = {"k": k, "search_wall_s": wall, "queries_per_s": len(queries) / wall,
                   "bound_gops_before": before, "bound_gops_after": after, "bound_s": bound_s,
                   "share_of_bound": bound_s / wall, "achieved_gops": scan_ops / wall / 1e9, "digits": digits,
                   "share_of_one_digit_bound": bound_s / digits / wall,
                   "float_rows_read_per_query": counted["rows"] / len(queries),
                   "storage_read_gib": read / 2**30, "memory": memory_status()}
            if "scan_s" in searched:  # where the search's time went (the int8 search's stats over its batches; a
                # package before them has none)
                run.update(scan_s=searched["scan_s"], rescore_s=searched["rescore_s"], search_digits=searched["digits"],
                           other_s=wall - searched["scan_s"] - searched["rescore_s"],
                           scan_share_of_bound=bound_s / searched["scan_s"],
                           candidates_per_query=searched["candidates"] / len(queries))
            runs.append(run)
            print(f"k={k} ({digits} query digit{'s' if digits > 1 else ''}): {wall:.1f} s, {run['queries_per_s']:.2f} "
                  f"q/s; bound {before:.1f}/{after:.1f} GOP/s -> "
                  f"{bound_s:.1f} s: {100 * run['share_of_bound']:.1f}% of the bound; float rows read per query "
                  f"{run['float_rows_read_per_query']:.0f}; {run['storage_read_gib']:.2f} GiB read from storage",
                  flush=True)
            if "scan_s" in run:
                print(f"  of which the scan {run['scan_s']:.2f} s ({100 * run['scan_share_of_bound']:.1f}% of the "
                      f"bound; {run['candidates_per_query']:.0f} candidates a query), the rescoring "
                      f"{run['rescore_s']:.2f} s, the rest {run['other_s']:.2f} s", flush=True)
            if args.breakdown:
                watchdog.doing = f"the k={k} product pass"
                run.update(product_share(codes_part.codes, query_rows, len(queries), args.block_size, rate))
                print(f"  the scan's product alone (its tiles of {run['tile_rows']} rows): {run['product_pass_s']:.2f} "
                      f"s, {100 * run['product_pass_share_of_bound']:.1f}% of the bound", flush=True)
    finally:
        store.vectors_of = original
        int8_search.search = int8_run
    watchdog.doing = "the exact float check"
    out["memory_after_searches"] = memory_status()

    # correctness: the identical top-k ids as an exact float search over the float copy, for a sample of queries
    if args.float_copy_random:  # the check streams the float copy: readahead again
        vectors._mmap.madvise(mmap.MADV_NORMAL)
    sample = np.linspace(0, len(queries) - 1, args.check_queries).astype(int)
    t0 = time.perf_counter()
    ref = exact_reference(index.vectors(), queries[sample], max(args.ks))
    out["check_wall_s"] = time.perf_counter() - t0
    checks = []
    for k in args.ks:
        got = results[k][sample]
        kk = min(k, count)
        same = [bool(np.array_equal(got[j], ref[j, :kk])) for j in range(len(sample))]
        checks.append({"k": k, "queries": len(sample), "identical": int(sum(same))})
        print(f"k={k}: top-{kk} ids identical to the exact float search for {sum(same)} of {len(sample)} queries",
              flush=True)
    out["check"] = checks
    out["check_ok"] = all(c["identical"] == c["queries"] for c in checks)
    out["load_average_end"] = load_average()
    watchdog.stop()
    (Path(args.workdir) / "search.json").write_text(json.dumps(out, indent=1))
    if not out["check_ok"]:
        raise SystemExit("the int8 search's ranking differs from the exact float search's (above)")
    return out


class _Watchdog:
    """Stops the process (exit status 3, one line on stderr, the figures so far in ``record``) when its anonymous
    memory passes ``limit_gib``: a search whose candidates outgrow the machine must not take the memory of the
    other work on it (the locked codes are file-backed and not counted)."""

    def __init__(self, limit_gib: float, record: Path, out: dict):
        import threading

        self.limit, self.record, self.out, self.doing, self.peak = limit_gib, record, out, "the search", 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.2):
            anon = memory_status().get("RssAnon_gib", 0.0)
            self.peak = max(self.peak, anon)
            if anon > self.limit:
                self.out["aborted"] = (f"anonymous memory {anon:.1f} GiB passed --memory-limit-gib {self.limit:g} "
                                       f"during {self.doing}")
                self.out["memory_at_abort"] = memory_status()
                self.record.write_text(json.dumps(self.out, indent=1))
                print(f"stopped: {self.out['aborted']}", file=sys.stderr, flush=True)
                os._exit(3)

    def stop(self):
        self._stop.set()
        self._thread.join()
        self.out["peak_anonymous_gib_sampled"] = self.peak


def _timed(fn):
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


def report(summary: dict) -> None:
    b = summary["build"]
    print(f"machine: {summary['machine']}")
    print(f"command: {summary['command']}")
    print(f"index: {summary['docs']:,} x {summary['dim']} int8; files: " +
          ", ".join(f"{n} {s / 2**30:.2f} GiB" for n, s in summary["files"].items() if s > 2**20))
    if "build_wall_s" in b:
        print(f"build: {b['build_wall_s'] / 60:.1f} min, peak memory {b['memory']['VmHWM_gib']:.2f} GiB")
    m = summary["memory_after_searches"]
    print(f"search process peak memory (VmHWM) {m.get('VmHWM_gib', float('nan')):.2f} GiB "
          f"(now: anonymous {m.get('RssAnon_gib', float('nan')):.2f} GiB, file-backed "
          f"{m.get('RssFile_gib', float('nan')):.2f} GiB); ru_maxrss {m['ru_maxrss_gib']:.2f} GiB")
    print("| k | queries | search s | q/s | int8 bound GOP/s (before/after) | share of the bound | float rows read "
          "per query | identical to exact float |")
    print("|---|---|---|---|---|---|---|---|")
    checks = {c["k"]: c for c in summary["check"]}
    for r in summary["runs"]:
        c = checks[r["k"]]
        print(f"| {r['k']} | {summary['queries']} | {r['search_wall_s']:.1f} | {r['queries_per_s']:.2f} | "
              f"{r['bound_gops_before']:.1f} / {r['bound_gops_after']:.1f} | {100 * r['share_of_bound']:.1f}% | "
              f"{r['float_rows_read_per_query']:.0f} | {c['identical']}/{c['queries']} |")
    print("\n| k | search s | its scan s (share of the bound) | the scan's product alone s (share) | rescoring s "
          "| rest s | candidates / rescored per query |")
    print("|---|---|---|---|---|---|---|")
    for r in (r for r in summary["runs"] if "scan_s" in r):
        product = (f"{r['product_pass_s']:.2f} ({100 * r['product_pass_share_of_bound']:.1f}%)"
                   if "product_pass_s" in r else "-")
        print(f"| {r['k']} | {r['search_wall_s']:.2f} | {r['scan_s']:.2f} ({100 * r['scan_share_of_bound']:.1f}%) | "
              f"{product} | {r['rescore_s']:.2f} | {r['other_s']:.2f} | "
              f"{r['candidates_per_query']:.0f} / {r['float_rows_read_per_query']:.0f} |")


# -- driver --------------------------------------------------------------------------------------------------------
def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True, help="where the index (and the stages' records) are written")
    p.add_argument("--docs", type=int, default=8_841_823, help="documents (default: MS MARCO passage's 8,841,823)")
    p.add_argument("--dim", type=int, default=768, help="dimensions (default: BERT-base's 768)")
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--ks", type=int, nargs="+", default=[10, 1000])
    p.add_argument("--check-queries", type=int, default=8, help="queries checked against the exact float search")
    p.add_argument("--block-size", type=int, default=16384, help="the scan's block (the retriever's default)")
    p.add_argument("--bound-seconds", type=float, default=3.0, help="each measurement of the compute bound")
    p.add_argument("--no-lock-codes", dest="lock_codes", action="store_false",
                   help="leave the codes' pages to the page cache (default: locked in memory with mlock)")
    p.add_argument("--memory-limit-gib", type=float, default=4.0,
                   help="stop the search when the process's anonymous memory passes this (default 4)")
    p.add_argument("--float-copy-random", action="store_true",
                   help="madvise(MADV_RANDOM) on the float copy's memmap: no readahead around each rescored row")
    p.add_argument("--cold-float-copy", action="store_true",
                   help="drop the float copy's pages from the page cache before each search (every rescored row is "
                        "then read from storage: the case of a float copy larger than the memory)")
    p.add_argument("--breakdown", action="store_true",
                   help="after each search, time one pass of the scan's product alone (its tiles and workers, no "
                        "filter, no candidates): how much of the scan's time the products take")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stage", choices=("all", "build", "search"), default="all")
    p.add_argument("--json", help="write the summary here (with --stage search: the search's, with the build's record)")
    p.add_argument("--clean", action="store_true", help="delete --workdir's index and records, then stop")
    args = p.parse_args(argv)
    for name in ("docs", "dim", "queries", "check_queries", "block_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(k < 1 for k in args.ks):
        p.error(f"--ks must be >= 1, got {args.ks}")
    if args.check_queries > args.queries:
        p.error(f"--check-queries ({args.check_queries}) must be at most --queries ({args.queries})")
    return args


def _summary(workdir: Path, argv, search: dict) -> dict:
    """The run's summary: machine, command, the build's record (when ``workdir`` holds one) and ``search``."""
    build = workdir / "build.json"
    return {"machine": machine(), "command": " ".join(["python", "experiments/bench/" + Path(__file__).name] +
                                                      (argv if argv is not None else sys.argv[1:])),
            **({"build": json.loads(build.read_text())} if build.is_file() else {}), **search}


def main(argv=None) -> dict:
    args = parse(argv)
    workdir = Path(args.workdir)
    if args.clean:
        for name in ("index", ".index.lock", "build.json", "search.json"):  # (.index.lock: the indexer's)
            target = workdir / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
        if workdir.exists() and not any(workdir.iterdir()):
            workdir.rmdir()
        return {}
    workdir.mkdir(parents=True, exist_ok=True)
    if args.stage == "build":
        out = stage_build(args)
        print(json.dumps(out), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        return out
    if args.stage == "search":
        out = stage_search(args)
        print(json.dumps(out), flush=True)
        if args.json:  # the summary of this search, with the build's record when the workdir holds one
            Path(args.json).write_text(json.dumps(_summary(workdir, argv, out), indent=1) + "\n")
        return out
    # all: each stage in its own process (its own peak memory)
    base = [sys.executable, os.path.abspath(__file__)] + [a for a in (argv if argv is not None else sys.argv[1:])]
    base = _without(base, "--stage", 1)
    base = _without(base, "--json", 1)
    for stage in ("build", "search"):
        print(f"== stage {stage}", flush=True)
        subprocess.run(base + ["--stage", stage], check=True)
    summary = _summary(workdir, argv, json.loads((workdir / "search.json").read_text()))
    report(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _without(argv: list, flag: str, values: int) -> list:
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        if a == flag:
            skip = values
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    main()
