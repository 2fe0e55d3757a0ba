"""What the compressed-index benchmarks (``bench_int8.py``, ``bench_binary.py``) share, in one place (a library
module): seeded synthetic document vectors and queries, the real sets of ``../shared/data`` as texts, a dense index
built from vectors, recall and nDCG@10 against a reference, sentence-transformers' binary search (a peer of both),
the machine's description and a timer.

The synthetic vectors have the shape of a BERT encoder's outputs: 4,096 cluster centres, per-dimension scales
log-normal (a few dimensions several times wider), norms spread by a log-normal factor; queries lie near the
centres. The same ``(docs, dim, batch, seed)`` give the same vectors in every benchmark.
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pandas as pd

from pyterrier_cpdae.dense import DenseIndex

__all__ = ["DATA", "synthetic_batches", "synthetic_queries", "build", "recall", "ndcg10", "load_set", "st_index",
           "st_search", "machine", "timed"]

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


def ndcg10(qids, doc_ids, ids: np.ndarray, qrels, scores: np.ndarray = None) -> float:
    """nDCG@10 (ir_measures) of the rankings ``ids`` (``(q, w)`` rows into ``doc_ids``), scored by ``scores`` (their
    order when not given)."""
    import ir_measures
    from ir_measures import nDCG

    scores = np.tile(-np.arange(ids.shape[1], dtype=float), len(ids)) if scores is None else scores.reshape(-1)
    run = pd.DataFrame({"query_id": np.repeat(qids, ids.shape[1]), "doc_id": np.asarray(doc_ids)[ids.reshape(-1)],
                        "score": scores.astype(float)})
    return float(ir_measures.calc_aggregate([nDCG @ 10], qrels, run)[nDCG @ 10])


def st_index(vectors, queries: np.ndarray):
    """sentence-transformers' FAISS binary index of ``quantize_embeddings(vectors, "ubinary")``."""
    from sentence_transformers.util.quantization import quantize_embeddings, semantic_search_faiss

    _, _, index = semantic_search_faiss(queries[:2], corpus_embeddings=quantize_embeddings(
        np.asarray(vectors[:1]), precision="ubinary"), corpus_precision="ubinary", top_k=1, output_index=True)
    index.reset()
    for s in range(0, len(vectors), 262144):
        index.add(quantize_embeddings(np.asarray(vectors[s:s + 262144]), precision="ubinary"))
    return index


def st_search(index, queries: np.ndarray, k: int, m: int) -> np.ndarray:
    """sentence-transformers' binary search of :func:`st_index` with its own rescoring (``rescore_multiplier`` m)."""
    from sentence_transformers.util.quantization import semantic_search_faiss

    results, _ = semantic_search_faiss(queries, corpus_index=index, corpus_precision="ubinary", top_k=k,
                                       rescore=True, rescore_multiplier=m)
    return np.array([[r["corpus_id"] for r in res] for res in results])


def machine() -> str:
    """The CPU (model, the SIMD flags the scans use), its cores and memory."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    info = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                 platform.machine())
    simd = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_vpopcntdq") if f" {f}" in info]
    return f"{os.cpu_count()}-core CPU ({model}; {', '.join(simd)}), {mem:.0f} GB"


def timed(fn, repeats: int = 1):
    """``(seconds, fn())``: the best of ``repeats`` calls and the last call's result."""
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out
