"""How a continued objective changes the geometry of [CLS] vectors, and how much of its zero-shot ranking is a
query-independent document bias.

Reads the dense indexes the paper pipeline keeps (``<work>/indices/<set>/<block>/<model>``: the vectors, and
``encoder_settings.json`` naming the model, corpus and query length), encodes the set's judged queries with each
model, and reports per model:

* documents: the mean pairwise cosine, the share of the mean vector in the mean squared norm
  (``||mean||² / mean ||x||²``: 1 when every vector is the same, ~0 when they are centred), the effective rank of the
  centred vectors (``exp`` of the entropy of the normalised eigenvalues; Roy & Vetterli 2007), the mean norm;
* queries: the share of their mean vector;
* retrieval by dot product as the tables score it (nDCG@10, RR@10), the same with the queries centred (their mean
  subtracted: label-free, from the evaluated queries themselves), and the *bias overlap*: the mean share of a
  query's top 10 that the mean query's top 10 also holds (1.0: every query gets the same ranking).

Why the query side: with the dot product, a common component ``m`` of the documents adds ``q·m`` to every score of a
query and never changes its ranking, but a common component ``μ`` of the queries adds ``μ·d`` to document ``d``'s
score for *every* query, a query-independent prior. Centring the queries removes exactly that term.

    python experiments/studies/cls_geometry.py --indices /work/paper-cpu/indices/marco_eval/zero-shot \\
        --out experiments/results/paper_cpu/cls_geometry.md

With ``--build-from WORK --corpus SPEC`` it first indexes (the paper pipeline's ``build_retrievers``, dot product,
[CLS]) every checkpoint of a pipeline work folder that has no index there yet: ``WORK/base`` as ``bert`` and each
``WORK/pretrain/<objective>``; an index already built with the same settings is reused. The lengths default to those
of the indexes already there (the tables' own, at any scale or ``--sizes``), else 256 and 32 as the tables at the
gpu scale. The GPU suite uses this after the pass that makes Tables 1-2 (their zero-shot indexes are read as built)
and after a lease that made only Tables 3-4 (no zero-shot indexes then).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

SETTINGS_FILE = "encoder_settings.json"


def geometry(vectors: np.ndarray) -> dict[str, float]:
    """Mean pairwise cosine, mean-vector share, effective rank (centred) and mean norm of the rows of ``vectors``."""
    x = np.asarray(vectors, dtype=np.float64)
    n = len(x)
    if n < 2:
        raise ValueError(f"geometry needs at least 2 vectors, got {n}")
    norms = np.linalg.norm(x, axis=1)
    if not np.all(np.isfinite(norms)) or np.any(norms == 0):
        raise ValueError("geometry: a vector is zero or not finite")
    unit_sum = (x / norms[:, None]).sum(0)
    mean = x.mean(0)
    centred = x - mean
    eig = np.clip(np.linalg.eigvalsh(centred.T @ centred), 0, None)
    p = eig[eig > 0] / eig.sum() if eig.sum() > 0 else np.ones(0)
    return {"mean_cos": float((unit_sum @ unit_sum - n) / (n * (n - 1))),  # sum over i != j of u_i . u_j
            "mean_share": float(mean @ mean / np.mean(norms ** 2)),
            "eff_rank": float(np.exp(-(p * np.log(p)).sum())) if len(p) else 0.0,  # identical vectors: rank 0
            "norm": float(norms.mean())}


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Row-wise indices of the k highest scores, best first; ties by the lower index (the stable order)."""
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]  # a full sort: a partition would cut ties arbitrarily


def bias_overlap(queries: np.ndarray, docs: np.ndarray, k: int = 10) -> float:
    """Mean share of each query's top k (dot product) that the mean query's top k also holds."""
    tops = top_k(queries @ docs.T, k)
    common = set(top_k((queries.mean(0) @ docs.T)[None, :], k)[0].tolist())
    return float(np.mean([len(common.intersection(t.tolist())) / k for t in tops]))


def _measures(qids: Sequence[str], docnos: np.ndarray, scores: np.ndarray, qrels: Any, depth: int) -> dict[str, float]:
    import ir_measures
    from ir_measures import RR, nDCG

    tops = top_k(scores, depth)
    run = [ir_measures.ScoredDoc(q, str(docnos[j]), float(scores[i, j]))
           for i, q in enumerate(qids) for j in tops[i]]
    got = ir_measures.calc_aggregate([nDCG @ 10, RR @ 10], qrels, run)
    return {"nDCG@10": float(got[nDCG @ 10]), "RR@10": float(got[RR @ 10])}


def study_index(index_dir: Path, depth: int = 100) -> dict[str, Any]:
    """Every figure of one model's index (see the module doc)."""
    import ir_measures

    from pyterrier_cpdae import CPDAE, load_dataset
    from pyterrier_cpdae.dense import DenseIndex

    settings_path = index_dir / SETTINGS_FILE
    if not settings_path.is_file():
        raise FileNotFoundError(f"{settings_path}: no {SETTINGS_FILE}; is {index_dir} an index the paper pipeline built?")
    settings = json.loads(settings_path.read_text())
    built, run = settings["index"], settings["run"]
    index = DenseIndex(index_dir)
    docs = np.asarray(index.vectors(), dtype=np.float32)
    docnos = np.asarray(index.docnos.fwd[np.arange(len(docs))]).astype(str)
    ds = load_dataset(built["corpus"])
    qrels = ds.get_qrels()
    qrels = qrels.assign(qid=qrels["qid"].astype(str), docno=qrels["docno"].astype(str))
    judged = set(qrels.loc[qrels["label"] > 0, "qid"])
    topics = ds.get_topics()
    topics = topics[topics["qid"].astype(str).isin(judged)]
    qids = topics["qid"].astype(str).tolist()
    enc = CPDAE.from_pretrained(built["model"], pooling=built["pooling"], normalize=built["normalize"],
                                query_max_length=int(run["query_max_length"]),
                                doc_max_length=int(built["doc_max_length"]))
    queries = np.asarray(enc.encode_queries(topics["query"].tolist()), dtype=np.float32)
    ir_qrels = [ir_measures.Qrel(q, d, int(l)) for q, d, l in qrels[["qid", "docno", "label"]].itertuples(index=False)]
    q_geo = geometry(queries)
    return {"model": built["model"], "corpus": built["corpus"], "num_docs": len(docs), "num_queries": len(qids),
            "docs": geometry(docs), "query_mean_share": q_geo["mean_share"],
            "raw": _measures(qids, docnos, queries @ docs.T, ir_qrels, depth),
            "centred_queries": _measures(qids, docnos, (queries - queries.mean(0)) @ docs.T, ir_qrels, depth),
            "bias_overlap": bias_overlap(queries, docs)}


def report(rows: dict[str, dict[str, Any]], command: str, seconds: float) -> str:
    first = next(iter(rows.values()))
    lines = [f"# [CLS] geometry and the query-independent bias ({first['corpus']})", "",
             f"Command: `{command}`", "",
             f"Machine: {platform.platform()}, {platform.machine()}, Python {platform.python_version()}. "
             f"Wall time {seconds:.0f} s. {first['num_docs']} documents, {first['num_queries']} judged queries; "
             "dot product of the indexed [CLS] vectors as in the tables, exact search, depth 100.", "",
             "| model | docs: mean cos | docs: mean share | docs: eff. rank (centred) | docs: mean norm | "
             "queries: mean share | nDCG@10 | RR@10 | nDCG@10, centred queries | RR@10, centred queries | "
             "bias overlap@10 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        d = r["docs"]
        lines.append(f"| {name} | {d['mean_cos']:.3f} | {d['mean_share']:.3f} | {d['eff_rank']:.1f} | {d['norm']:.2f} | "
                     f"{r['query_mean_share']:.3f} | {r['raw']['nDCG@10']:.4f} | {r['raw']['RR@10']:.4f} | "
                     f"{r['centred_queries']['nDCG@10']:.4f} | {r['centred_queries']['RR@10']:.4f} | "
                     f"{r['bias_overlap']:.3f} |")
    lines += ["", "Mean share: ||mean||² / mean ||x||². Bias overlap@10: the mean share of a query's top 10 that the "
              "mean query's top 10 also holds. Centred queries: the evaluated queries' mean vector subtracted "
              "(label-free); centring the documents would change no ranking. See the study's docstring "
              "(`experiments/studies/cls_geometry.py`)."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cls_geometry", description=__doc__.split("\n\n")[0])
    p.add_argument("--indices", required=True, type=Path,
                   help="a folder with one pipeline index per model, e.g. <work>/indices/marco_eval/zero-shot")
    p.add_argument("--models", default=None, help="comma-separated subfolders to read (default: every index there)")
    p.add_argument("--out", required=True, type=Path, help="the Markdown report; a .json beside it holds every figure")
    p.add_argument("--build-from", type=Path, default=None,
                   help="a paper pipeline work folder: index its base (as bert) and every pretrain/<objective> first")
    p.add_argument("--corpus", default=None, help="with --build-from: the dataset spec to index")
    p.add_argument("--doc-max-length", type=int, default=None,
                   help="with --build-from (default: as the indexes already under --indices, else 256, as the tables)")
    p.add_argument("--query-max-length", type=int, default=None,
                   help="with --build-from (default: as the indexes already under --indices, else 32, as the tables)")
    return p


def built_lengths(indices: Path) -> tuple[Optional[int], Optional[int]]:
    """``(doc_max_length, query_max_length)`` of the pipeline indexes already under ``indices`` when they all agree
    (``(None, None)`` when there are none or they differ): what ``--build-from`` builds the missing ones with, so that
    the indexes the tables built are read as they are, not rebuilt at other lengths."""
    found = set()
    for settings in sorted(Path(indices).glob(f"*/{SETTINGS_FILE}")) if Path(indices).is_dir() else []:
        try:
            s = json.loads(settings.read_text())
            found.add((int(s["index"]["doc_max_length"]), int(s["run"]["query_max_length"])))
        except (OSError, ValueError, KeyError, TypeError):
            return None, None  # unreadable: build at the defaults (the pipeline then rebuilds what does not match)
    return next(iter(found)) if len(found) == 1 else (None, None)


def build_indices(work: Path, corpus: str, indices: Path, doc_max_length: int, query_max_length: int) -> list[str]:
    """Index every finished checkpoint of a pipeline work folder under ``indices`` (reusing matching indexes)."""
    from experiments.paper.retrievers import build_retrievers

    found = {"bert": work / "base"} if (work / "base" / "config.json").is_file() else {}
    pre = work / "pretrain"
    found.update({d.name: d for d in sorted(pre.iterdir()) if (d / "config.json").is_file()} if pre.is_dir() else {})
    if not found:
        raise SystemExit(f"cls_geometry: --build-from {work} holds no base/ or pretrain/<objective>/ checkpoint")
    build_retrievers({n: (str(d), "cls") for n, d in found.items()}, corpus, index_root=indices, normalize=False,
                     doc_max_length=doc_max_length, query_max_length=query_max_length)
    return list(found)


def main(argv: Optional[Sequence[str]] = None) -> dict[str, dict[str, Any]]:
    args = build_parser().parse_args(argv)
    if (args.build_from is None) != (args.corpus is None):
        raise SystemExit("cls_geometry: --build-from and --corpus go together")
    if args.build_from is not None:
        doc_len, query_len = built_lengths(args.indices)
        build_indices(args.build_from, args.corpus, args.indices, args.doc_max_length or doc_len or 256,
                      args.query_max_length or query_len or 32)
    if not args.indices.is_dir():
        raise SystemExit(f"cls_geometry: --indices {args.indices} is not a folder")
    found = sorted(p.name for p in args.indices.iterdir() if (p / SETTINGS_FILE).is_file())
    names = args.models.split(",") if args.models else found
    missing = [n for n in names if n not in found]
    if missing or not names:
        raise SystemExit(f"cls_geometry: --models {missing or names} not indexed under {args.indices} "
                         f"(found: {found or 'none'})")
    t0 = time.time()
    rows = {}
    for name in names:
        rows[name] = study_index(args.indices / name)
        print(f"{name}: nDCG@10 {rows[name]['raw']['nDCG@10']:.4f}, centred queries "
              f"{rows[name]['centred_queries']['nDCG@10']:.4f}", file=sys.stderr)
    command = "python experiments/studies/cls_geometry.py " + " ".join(sys.argv[1:] if argv is None else argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report(rows, command, time.time() - t0))
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
