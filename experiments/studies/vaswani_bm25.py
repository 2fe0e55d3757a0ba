"""BM25 (k1=0.9, b=0.4) with BM25Index on a test collection; by default Vaswani, whose MAP should
equal Anserini's published 0.2856.

Usage:
    python experiments/studies/vaswani_bm25.py                       # trec:../shared/data/vaswani
    python experiments/studies/vaswani_bm25.py --dataset sample      # the built-in sample collection
    python experiments/studies/vaswani_bm25.py --index runs/vaswani.bm25   # build once; later runs reuse the index
                                                             # and the run pt.Experiment saved in runs/vaswani.bm25.runs
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import pyterrier as pt
from ir_measures import AP, R, P, nDCG, RR

from pyterrier_cpdae.bm25 import BM25Index
from pyterrier_cpdae.datasets import load_dataset

VASWANI = Path(__file__).resolve().parents[3] / "shared" / "data" / "vaswani"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default=f"trec:{VASWANI}", help="load_dataset spec")
    parser.add_argument("--index", default=None, help="index folder to reuse/build (default: a temporary folder); "
                        "pt.Experiment saves the run in <index>.runs and reuses it later")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    dataset = load_dataset(args.dataset)
    with tempfile.TemporaryDirectory() as tmp:
        index_path = Path(args.index or Path(tmp) / "index.bm25")
        index = BM25Index(index_path)
        save_dir = index_path.with_name(index_path.name + ".runs")
        t0 = time.perf_counter()
        if not index.built():
            shutil.rmtree(save_dir, ignore_errors=True)  # runs of an earlier index are stale
            index.indexer(threads=args.threads).index(dataset.get_corpus_iter())
        save_dir.mkdir(parents=True, exist_ok=True)
        t1 = time.perf_counter()
        topics, qrels = dataset.get_topics(), dataset.get_qrels()
        bm25 = index.bm25(k1=0.9, b=0.4, num_results=1000, threads=args.threads)
        res = pt.Experiment([bm25], topics, qrels, eval_metrics=[AP, nDCG @ 10, P @ 10, RR, R @ 1000],
                            names=["BM25 (k1=0.9, b=0.4)"], save_dir=str(save_dir), save_mode="reuse")
        t2 = time.perf_counter()
        print(f"dataset: {args.dataset}")
        print(f"machine: {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, "
              f"python {platform.python_version()}")
        print(f"documents indexed: {len(index)}; indexing {t1 - t0:.1f} s; "
              f"retrieval + evaluation of {len(topics)} topics {t2 - t1:.1f} s")
        print(res.round(4).to_string(index=False))


if __name__ == "__main__":
    main()
