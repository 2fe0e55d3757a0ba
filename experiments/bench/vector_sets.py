"""The vectors the compressed-index benchmarks (``bench_int8.py``, ``bench_binary.py``) search, in one place (a
library module): seeded synthetic document vectors and queries, the real sets of ``../shared/data`` as texts, a
dense index built from vectors, and recall against a reference ranking.

The synthetic vectors have the shape of a BERT encoder's outputs: 4,096 cluster centres, per-dimension scales
log-normal (a few dimensions several times wider), norms spread by a log-normal factor; queries lie near the
centres. The same ``(docs, dim, batch, seed)`` give the same vectors in every benchmark.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np
import pandas as pd

from pyterrier_cpdae.dense import DenseIndex

__all__ = ["DATA", "synthetic_batches", "synthetic_queries", "build", "recall", "load_set"]

#: the real data (``../shared/data`` beside the checkout)
DATA = Path(__file__).resolve().parents[3] / "shared" / "data"

#: cluster centres of the synthetic vectors
CENTRES = 4096


def _centres(rng: np.random.Generator, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The per-dimension scales and the cluster centres, the first draws of ``rng``."""
    dim_scale = np.exp(rng.normal(0, 0.5, dim)).astype(np.float32)
    return dim_scale, rng.standard_normal((CENTRES, dim)).astype(np.float32) * dim_scale


def synthetic_batches(docs: int, dim: int, batch: int = 65536, seed: int = 0) -> Iterator[pd.DataFrame]:
    """``docs`` clustered vectors of ``dim`` dimensions (module docstring) as ``docno``/``doc_vec`` frames of
    ``batch`` rows (``d0``, ``d1``, ...)."""
    rng = np.random.default_rng(seed)
    dim_scale, centres = _centres(rng, dim)
    for start in range(0, docs, batch):
        n = min(batch, docs - start)
        vecs = centres[rng.integers(0, len(centres), n)] + rng.standard_normal((n, dim)).astype(np.float32) * dim_scale
        vecs *= np.exp(rng.normal(0, 0.15, (n, 1))).astype(np.float32) / np.sqrt(dim)
        yield pd.DataFrame({"docno": [f"d{i}" for i in range(start, start + n)], "doc_vec": list(vecs)})


def synthetic_queries(num: int, dim: int, seed: int = 0) -> np.ndarray:
    """``(num, dim)`` float32 queries near the centres of :func:`synthetic_batches` of the same ``seed``."""
    rng = np.random.default_rng(seed)
    dim_scale, centres = _centres(rng, dim)
    q = centres[rng.integers(0, CENTRES, num)] + 0.7 * rng.standard_normal((num, dim)).astype(np.float32) * dim_scale
    return (q / np.sqrt(dim)).astype(np.float32)


def build(path: Path, batches, dtype: str) -> DenseIndex:
    """The dense index at ``path`` of ``batches`` stored as ``dtype``, built unless it is built already."""
    index = DenseIndex(path)
    if not index.built():
        index.indexer(dtype=dtype, mode="overwrite").index(batches)
    return index


def recall(ids: np.ndarray, ref: np.ndarray) -> float:
    """Mean recall@k of the rankings ``ids`` (``(q, >=k)``) against the reference rankings ``ref`` (``(q, k)``)."""
    k = ref.shape[1]
    return float(np.mean([len(set(a[:k]) & set(b)) / k for a, b in zip(ids, ref)]))


def load_set(name: str):
    """``(doc_ids, doc_texts, query_ids, query_texts, qrels frame)`` of a set in ../shared/data: ``scifact`` (train
    qrels), ``marco`` (the MS MARCO dev sample) or ``dl19`` (the DL19 judged pool); only judged queries."""
    if name == "scifact":
        root = DATA / "scifact"
        docs = [json.loads(line) for line in open(root / "corpus.jsonl", encoding="utf8")]
        qrels = pd.read_csv(root / "qrels" / "train.tsv", sep="\t", dtype=str)
        qrels = pd.DataFrame({"query_id": qrels["query-id"], "doc_id": qrels["corpus-id"],
                              "relevance": qrels["score"].astype(int)})
        queries = {q["_id"]: q["text"] for q in map(json.loads, open(root / "queries.jsonl", encoding="utf8"))}
        qids = sorted(set(qrels["query_id"]))
        return ([d["_id"] for d in docs], [(d.get("title", "") + " " + d["text"]).strip() for d in docs],
                qids, [queries[q] for q in qids], qrels)
    sub = {"marco": ("msmarco-dev-sample", "dev/small"), "dl19": ("msmarco-dl19-judged", "trec-dl-2019")}[name]
    root = DATA / sub[0] / "irds" / "msmarco-passage"
    coll = pd.read_csv(root / "collection.tsv", sep="\t", header=None, names=["id", "text"], dtype=str,
                       quoting=3, keep_default_na=False)
    queries = pd.read_csv(root / sub[1] / "queries.tsv", sep="\t", header=None, names=["id", "text"], dtype=str,
                          quoting=3, keep_default_na=False)
    qrels = pd.read_csv(root / sub[1] / "qrels", sep=r"\s+", header=None, names=["query_id", "it", "doc_id", "rel"],
                        dtype=str)
    qrels = pd.DataFrame({"query_id": qrels["query_id"], "doc_id": qrels["doc_id"],
                          "relevance": qrels["rel"].astype(int)})
    queries = queries[queries["id"].isin(set(qrels["query_id"]))]
    return list(coll["id"]), list(coll["text"]), list(queries["id"]), list(queries["text"]), qrels
