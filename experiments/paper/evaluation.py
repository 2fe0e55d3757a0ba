"""Evaluation of the paper pipeline's models: dense retrieval ([CLS], dot product, exact search) of every
checkpoint on one evaluation set with BM25 beside it, through ``pt.Experiment`` (runs saved and reused).

``plan`` is a :class:`experiments.paper.pipeline.Plan` (its ``cfg`` and ``work``); this module does not import
the pipeline, so that the selection stages (:mod:`experiments.paper.select_tau`) can evaluate without a cycle.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

from .config import ROOT, under_work
from .data import set_key, set_spec

BM25 = "bm25"
#: the manifest of a folder of BM25 results computed on another machine (config key ``bm25_precomputed``)
PRECOMPUTED_MANIFEST = "manifest.json"


def digests_file(plan: Any) -> Path:
    """The cache of file digests behind the work directory's fingerprints (:mod:`experiments.paper.caches`)."""
    return Path(plan.work) / ".digests.json"


def bm25_index(plan: Any, name: str, ds: Any, spec: str):
    """The BM25 index ``<work>/bm25/<name>`` of ``ds`` (read from ``spec``), built unless it was built from the same
    documents (``<index>.built_from.json``); a rebuild of an index built from other documents says why."""
    from experiments.paper.caches import corpus_fingerprint, forget_built_from, record_built_from, stale_reason
    from pyterrier_cpdae import BM25Index

    index = BM25Index(str(under_work(plan, "bm25", name, what="a BM25 index")))
    fp = corpus_fingerprint(spec, digests_file(plan))
    why = stale_reason(index.path, index.built(), fp)
    if why is not None:
        if why != "not built yet":
            print(f"rebuilding the BM25 index {index.path}: {why}", flush=True)
        forget_built_from(index.path)
        index.indexer(mode="overwrite").index(ds.get_corpus_iter())
        record_built_from(index.path, fp)
    return index


def keep_saved_runs_for(save_dir: Path, key: dict[str, Any]) -> None:
    """Drop the runs ``pt.Experiment`` saved in ``save_dir`` (it reuses them by system name only) unless they were
    computed for ``key`` (the documents' fingerprint, the queries, the depth), recorded in ``save_dir/.runs_for.json``."""
    from pyterrier_cpdae._files import write_json_atomic

    record = save_dir / ".runs_for.json"
    try:
        have = json.loads(record.read_text())
    except (OSError, ValueError):
        have = None
    if have == key:
        return
    saved = sorted(save_dir.glob("*.res.gz"))
    if saved:
        what = "they record no collection or queries" if have is None else "they were computed for " + ", ".join(
            k for k in key if have.get(k) != key[k]) + " other than this run's"
        print(f"dropping {len(saved)} saved runs in {save_dir}: {what}", flush=True)
        for f in saved:
            f.unlink()
    write_json_atomic(record, key)


# ----------------------------------------------------------------------------- precomputed BM25
def precomputed_root(plan: Any) -> Optional[Path]:
    """The config's ``bm25_precomputed`` folder (relative paths: to the repository root), or None.

    A config with this key takes every BM25 result from that folder (negative pools of the fine-tuning sets, runs
    of the evaluation sets, written by :func:`export_bm25` where Java is) and never starts Java: a missing or
    mismatched entry is an error, not a silent fall back to Pyserini."""
    root = plan.cfg.get("bm25_precomputed")
    if not root:
        return None
    root = Path(root)
    return root if root.is_absolute() else ROOT / root


def set_data_digest(plan: Any, spec: str) -> str:
    """The fingerprint of a set's data as loaded from ``spec``: its documents, topics and qrels
    (:func:`~experiments.paper.caches.corpus_fingerprint` with ``everything=True``)."""
    from .caches import corpus_fingerprint
    return corpus_fingerprint(spec, digests_file(plan), everything=True)["digest"]


def _bm25_what(kind: str, entry: dict[str, Any], data: str, **params: Any) -> dict[str, Any]:
    """What a precomputed BM25 result depends on: the set's definition (spec, query split, size limits), the
    fingerprint of the data it was computed from (:func:`set_data_digest`) and the depth; compared exactly when it
    is used."""
    return {"kind": kind, "set": set_key(entry), "data": data, **params}


def precomputed_bm25(plan: Any, kind: str, set_name: str, entry: dict[str, Any], spec: str,
                     **params: Any) -> Optional[Path]:
    """The file of a precomputed BM25 result (``kind`` ``negatives`` or ``runs``) for this set, as loaded from
    ``spec``, or None when the config has no ``bm25_precomputed``.

    Raises:
        FileNotFoundError / ValueError: the folder, its manifest or the set's entry is absent, or the entry was
            computed for another definition of the set (named field by field) or from another version of its data
            (documents, topics or qrels edited since; a manifest that records no data fingerprint counts as such).
    """
    root = precomputed_root(plan)
    if root is None:
        return None
    manifest = root / PRECOMPUTED_MANIFEST
    if not manifest.exists():
        raise FileNotFoundError(f"bm25_precomputed: {manifest} is absent (write the folder with "
                                "experiments/gpu/build_bundle.py, where Java is)")
    rec = json.loads(manifest.read_text()).get(kind, {}).get(set_name)
    if rec is None:
        raise FileNotFoundError(f"bm25_precomputed: {manifest} holds no {kind} of the set {set_name!r}; rebuild it "
                                "with the same --scale/--sizes/--stand-ins as this run")
    want = _bm25_what(kind, entry, set_data_digest(plan, spec), **params)
    if rec["for"] != want:
        diff = sorted(k for k in set(want) | set(rec["for"]) if want.get(k) != rec["for"].get(k))
        if diff == ["data"]:
            stored = rec["for"].get("data")
            raise ValueError(f"bm25_precomputed: {manifest}: the {kind} of {set_name!r} were computed from another "
                             "version of the set's data (its documents, topics or qrels changed since: fingerprint "
                             f"{str(stored)[:12] + '...' if stored else 'not recorded'} there, {want['data'][:12]}... "
                             "now); rebuild the folder from this data (experiments/gpu/build_bundle.py, where Java "
                             "is), or drop bm25_precomputed to compute BM25 here")
        raise ValueError(f"bm25_precomputed: {manifest}: the {kind} of {set_name!r} were computed for another "
                         f"definition of the set (differs in {', '.join(diff)}: stored {rec['for']}, this run "
                         f"{want}); rebuild it with this run's config")
    path = root / rec["file"]
    if not path.exists():
        raise FileNotFoundError(f"bm25_precomputed: {path} (listed in {manifest}) is absent")
    return path


def eval_topics(ds: Any):
    """The queries an evaluation set is scored on (those with a judged positive)."""
    topics, qrels = ds.get_topics(), ds.get_qrels()
    return topics[topics["qid"].astype(str).isin({str(q) for q in qrels[qrels["label"] > 0]["qid"]})], qrels


def precomputed_run(path: Path, topics) -> Any:
    """A transformer answering each query with its rows of a saved BM25 run; refuses a run that lacks a query."""
    import pyterrier as pt

    run = pt.io.read_results(str(path))
    run = run.assign(qid=run["qid"].astype(str), docno=run["docno"].astype(str))
    missing = sorted(set(topics["qid"].astype(str)) - set(run["qid"]))
    if missing:
        raise ValueError(f"bm25_precomputed: {path} has no results for {len(missing)} of the set's queries "
                         f"(e.g. {missing[:3]}); rebuild it with this run's config")
    return pt.Transformer.from_df(run[["qid", "docno", "score", "rank"]])


def _measure(name: str):
    from ir_measures import parse_measure
    return parse_measure(name)


def record_in_cards(systems: dict[str, str], figures: dict[str, dict[str, float]], *, set_name: str, block: str,
                    spec: str, depth: int, num_queries: int, log: Callable[[str], None] = print) -> list[str]:
    """Write each system's figures into the model card of its checkpoint directory
    (:func:`pretrain.export.card.add_evaluation`; only directories the toolkit exported hold one, a base model's
    directory is left alone). The search is exact (brute force over every document vector). Returns the
    directories whose card was updated."""
    from pretrain.export.card import add_evaluation

    done = []
    for name, path in systems.items():
        if name in figures and add_evaluation(str(path), figures[name], name=set_name, collection=spec, depth=depth,
                                              exact=True, num_queries=num_queries,
                                              by=f"python -m experiments.paper ({block}, system {name})"):
            done.append(str(path))
    if done:
        log(f"[eval {set_name}/{block}] figures written into {len(done)} model card(s)")
    return done


class _EvalSet:
    """One evaluation set of a block as :func:`evaluate` and :func:`index_block` read it: its settings (the config's
    ``evaluation``, the set's own on top), its data (materialised subset, judged queries), the folder of its indexes
    and saved runs (stale runs dropped: :func:`keep_saved_runs_for`), and the dense retrievers over it."""

    def __init__(self, plan: Any, set_name: str, block: str, entry: Optional[dict[str, Any]] = None) -> None:
        from experiments.paper.caches import corpus_fingerprint, topics_digest
        from pyterrier_cpdae import load_dataset

        self.plan = plan
        self.entry = entry if entry is not None else plan.cfg["eval_sets"][set_name]
        self.ev = {**plan.cfg["evaluation"], **self.entry.get("evaluation", {})}  # e.g. longer documents for one set
        self.spec = set_spec(set_name, self.entry, plan.work)
        self.ds = load_dataset(self.spec)
        self.topics, self.qrels = eval_topics(self.ds)
        self.index_root = under_work(plan, "indices", set_name, block, what=f"the indexes of the set {set_name!r}")
        self.save_dir = self.index_root / "runs"
        self.save_dir.mkdir(parents=True, exist_ok=True)
        # (before the indexes: build_retrievers saves the runs it retrieves where pt.Experiment reads them)
        keep_saved_runs_for(self.save_dir, {"corpus": corpus_fingerprint(self.spec, digests_file(plan))["digest"],
                                            "topics": topics_digest(self.topics),
                                            "num_results": int(self.ev["num_results"])})

    def build_retrievers(self, systems: dict[str, str], encoders: Optional[dict[tuple, Any]] = None):
        """:func:`~experiments.paper.retrievers.build_retrievers` of ``systems`` (name -> checkpoint) on this set,
        each system's run retrieved and saved where ``pt.Experiment`` reads it."""
        from .retrievers import build_retrievers

        ev = self.ev
        return build_retrievers({k: (v, ev.get("pooling", "cls")) for k, v in systems.items()}, self.spec,
                                doc_max_length=int(ev["doc_max_length"]), query_max_length=int(ev["query_max_length"]),
                                index_root=self.index_root, num_results=int(ev["num_results"]),
                                batch_size=int(ev["batch_size"]),
                                # the protocol's similarity is the dot product of [CLS] vectors for every row, also
                                # for a model directory that ships a Normalize module (all-MiniLM-L6-v2)
                                normalize=bool(ev.get("normalize", False)),
                                digests_file=digests_file(self.plan), topics=self.topics, encoders=encoders)


def index_block(plan: Any, block: str, sets: dict[str, dict[str, str]]) -> None:
    """Index every set of a block with each of its systems and save their runs, model by model: a checkpoint evaluated
    on several sets (a block's models on each of its collections) is loaded once, and its encoder indexes and
    retrieves every set whose encoder settings are the same, instead of once per set. :func:`evaluate` then finds
    each index built and each run saved (what is reused or rebuilt is decided as there, by
    :func:`~experiments.paper.retrievers.build_retrievers`). ``sets``: set name -> {system name: checkpoint}."""
    evsets = {s: _EvalSet(plan, s, block) for s in sets}
    for path in dict.fromkeys(p for systems in sets.values() for p in systems.values()):
        encoders: dict[tuple, Any] = {}  # this checkpoint's encoder(s), dropped before the next one is loaded
        for s, systems in sets.items():
            mine = {name: p for name, p in systems.items() if p == path}
            if mine:
                evsets[s].build_retrievers(mine, encoders=encoders)
        encoders.clear()


def evaluate(plan: Any, set_name: str, block: str, systems: dict[str, str], baselines: dict[str, str],
             with_bm25: bool = True, log: Callable[[str], None] = print, entry: Optional[dict[str, Any]] = None,
             groups: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """Dense retrieval ([CLS], dot product, exact search) of every system on one evaluation set, BM25 beside
    them, through ``pt.Experiment`` (runs saved and reused), once per significance baseline.

    Args:
        systems: name -> checkpoint directory (only finished ones).
        baselines: mark -> system name (paired two-tailed t-test against that system).
        entry: the set's entry (default: ``cfg["eval_sets"][set_name]``), e.g. a held-aside training set.
        groups: run name -> model for systems that are several runs (fine-tuning seeds) of one model: rows are
            then the models, mean and ``std`` over their runs, p-values from paired tests on the per-query scores
            averaged over each model's runs (:mod:`experiments.paper.seeds`); ``seeds`` holds the run counts.

    Returns:
        ``{"means": {system: {metric: value}}, "pvalues": {mark: {system: {metric: p}}}, "experiments":
        [(baseline, DataFrame)], "num_queries": n, "index_s": {...}}``
    """
    import pandas as pd
    import pyterrier as pt

    c = _EvalSet(plan, set_name, block, entry)
    ev, spec, ds, topics, qrels = c.ev, c.spec, c.ds, c.topics, c.qrels
    pipelines: dict[str, Any] = {}
    if with_bm25:
        pre = precomputed_bm25(plan, "runs", set_name, c.entry, spec, num_results=int(ev["num_results"]))
        pipelines[BM25] = (precomputed_run(pre, topics) if pre is not None else
                           bm25_index(plan, f"eval_{set_name}", ds, spec).bm25(num_results=int(ev["num_results"])))
    dense, index_s = c.build_retrievers(systems)
    pipelines.update(dense)
    save_dir = c.save_dir
    names = list(pipelines)
    metrics = [_measure(m) for m in c.entry["metrics"]]
    result: dict[str, Any] = {"means": {}, "pvalues": {}, "experiments": [], "num_queries": len(topics),
                              "index_s": index_s, "spec": spec}
    if groups is not None:  # several runs (seeds) per model: one perquery experiment, rows over seeds
        from .seeds import seed_summary

        groups = {**{n: n for n in names if n not in groups}, **groups}
        res = pt.Experiment([pipelines[n] for n in names], topics, qrels, eval_metrics=metrics, names=names,
                            save_dir=str(save_dir), save_mode="reuse", verbose=False, perquery=True)
        res = res.assign(measure=res["measure"].astype(str))
        summary = seed_summary(res, groups, [str(m) for m in metrics], baselines)
        result.update({k: summary[k] for k in ("means", "std", "seeds", "pvalues")})
        rows = [{"name": model, "seeds": summary["seeds"][model],
                 **{f"{m} mean": summary["means"][model][m] for m in map(str, metrics)},
                 **{f"{m} std": summary["std"][model][m] for m in map(str, metrics)},
                 **{f"{m} p-value vs {b}": summary["pvalues"].get(mark, {}).get(model, {}).get(m)
                    for mark, b in baselines.items() for m in map(str, metrics)}} for model in summary["means"]]
        result["experiments"].append(("seed-averaged", pd.DataFrame(rows)))
        per_run = res.groupby(["name", "measure"])["value"].mean()  # each run's own figures, for its card
        record_in_cards(systems, {n: {m: float(v) for m, v in per_run[n].items()} for n in systems
                                  if n in per_run.index.get_level_values(0)}, set_name=set_name, block=block,
                        spec=spec, depth=int(ev["num_results"]), num_queries=len(topics), log=log)
        log(f"[eval {set_name}/{block}] {len(topics)} queries, {len(names)} runs of {len(summary['means'])} systems")
        return result
    todo = [(mark, b) for mark, b in baselines.items() if b in names] or [(None, None)]
    for mark, b in todo:
        res = pt.Experiment([pipelines[n] for n in names], topics, qrels, eval_metrics=metrics, names=names,
                            baseline=None if b is None else names.index(b), save_dir=str(save_dir),
                            save_mode="reuse", verbose=False)
        result["experiments"].append((b, res))
        for _, row in res.iterrows():
            result["means"][row["name"]] = {str(m): float(row[str(m)]) for m in metrics}
            if mark is not None:
                result["pvalues"].setdefault(mark, {})[row["name"]] = {
                    str(m): (None if row["name"] == b else float(row[f"{m} p-value"])) for m in metrics}
    record_in_cards(systems, result["means"], set_name=set_name, block=block, spec=spec, depth=int(ev["num_results"]),
                    num_queries=len(topics), log=log)
    log(f"[eval {set_name}/{block}] {len(topics)} queries, {len(names)} systems")
    return result
