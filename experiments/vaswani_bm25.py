"""BM25 (k1=0.9, b=0.4) with BM25Index on a test collection; by default Vaswani, whose MAP should
equal Anserini's published 0.2856.

Usage:
    python experiments/vaswani_bm25.py                       # trec:../shared/data/vaswani
    python experiments/vaswani_bm25.py --dataset sample      # the built-in sample collection
"""
from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import pyterrier as pt
from ir_measures import AP, R, P, nDCG, RR

from pyterrier_cpdae.bm25 import BM25Index
from pyterrier_cpdae.datasets import load_dataset

VASWANI = Path(__file__).resolve().parents[2] / "shared" / "data" / "vaswani"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default=f"trec:{VASWANI}", help="load_dataset spec")
    parser.add_argument("--index", default=None, help="index folder to reuse/build (default: a temporary folder)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    dataset = load_dataset(args.dataset)
    with tempfile.TemporaryDirectory() as tmp:
        index = BM25Index(args.index or Path(tmp) / "index.bm25")
        t0 = time.perf_counter()
        if not index.built():
            index.indexer(threads=args.threads).index(dataset.get_corpus_iter())
        t1 = time.perf_counter()
        topics, qrels = dataset.get_topics(), dataset.get_qrels()
        bm25 = index.bm25(k1=0.9, b=0.4, num_results=1000, threads=args.threads)
        res = pt.Experiment([bm25], topics, qrels, eval_metrics=[AP, nDCG @ 10, P @ 10, RR, R @ 1000],
                            names=["BM25 (k1=0.9, b=0.4)"])
        t2 = time.perf_counter()
        print(f"dataset: {args.dataset}")
        print(f"machine: {platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, "
              f"python {platform.python_version()}")
        print(f"documents indexed: {len(index)}; indexing {t1 - t0:.1f} s; "
              f"retrieval + evaluation of {len(topics)} topics {t2 - t1:.1f} s")
        print(res.round(4).to_string(index=False))


if __name__ == "__main__":
    main()
