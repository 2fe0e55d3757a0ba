"""The retrieval probe: nDCG@10 and RR@10 of an encoder on a small test collection, during training.

:class:`RetrievalProbe` loads a set once (:func:`pyterrier_cpdae.load_dataset`, optionally cut to ``max_queries``
judged queries and ``max_docs`` documents, every judged document of the kept queries included), ranks every document
by exact dot product and scores the ranking with ``ir_measures`` as ``pt.Experiment`` does (graded labels; a judged
query missing from the ranking counts 0), so that its figures are ``pt.Experiment``'s for the same weights.
:meth:`RetrievalProbe.evaluate` encodes with a Hugging Face encoder pooled by
:func:`pyterrier_cpdae.encoder.pooling.pool` (what ``CPDAE`` uses); :class:`ProbeEvaluator` is the
sentence-transformers evaluator over the same probe.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

__all__ = ["RetrievalProbe", "ProbeEvaluator", "METRICS"]

#: The probe's figures, by the names it returns them under.
METRICS = ("ndcg_cut_10", "recip_rank_10")


class RetrievalProbe:
    """A small retrieval test set held in memory, scored by exact search.

    Args:
        spec: A dataset spec for :func:`pyterrier_cpdae.load_dataset` (``sample``, ``trec:<folder>``, ``irds:<id>``, ...).
        max_queries: Keep a seeded sample of this many judged queries (``None``: all judged queries).
        max_docs: Keep at most this many documents: the judged ones of the kept queries, then others in corpus order.
        seed: The seed of the query sample.
        rel: The least label that counts as relevant for RR@10 (TREC DL: 2); nDCG@10 uses the graded labels.
        depth: How many documents of each query are ranked for the measures (at least 10).
    """

    def __init__(self, spec: str, max_queries: Optional[int] = None, max_docs: Optional[int] = None, *, seed: int = 0,
                 rel: int = 1, depth: int = 100):
        from pyterrier_cpdae import load_dataset

        for name, value in (("max_queries", max_queries), ("max_docs", max_docs)):
            if value is not None and value < 1:
                raise ValueError(f"RetrievalProbe({spec!r}): {name} must be >= 1, got {value}")
        if depth < 10:
            raise ValueError(f"RetrievalProbe({spec!r}): depth must be >= 10 (the measures are @10), got {depth}")
        ds = load_dataset(spec)
        qrels, topics = ds.get_qrels(), ds.get_topics()
        topics = topics[topics["qid"].isin(set(qrels["qid"]))].drop_duplicates("qid")
        if topics.empty:
            raise ValueError(f"RetrievalProbe({spec!r}): no query of the set has a judgement")
        if max_queries is not None and max_queries < len(topics):
            topics = topics.iloc[np.sort(np.random.default_rng(seed).permutation(len(topics))[:max_queries])]
        self.qrels = qrels[qrels["qid"].isin(set(topics["qid"]))].reset_index(drop=True)
        judged = set(self.qrels["docno"])
        self.docnos: list[str] = []
        self.docs: list[str] = []
        room = None if max_docs is None else max(max_docs - len(judged), 0)
        for doc in ds.get_corpus_iter():
            if doc["docno"] not in judged:
                if room is not None and room <= 0:
                    continue
                room = None if room is None else room - 1
            self.docnos.append(doc["docno"])
            self.docs.append(doc["text"])
        if not self.docnos:
            raise ValueError(f"RetrievalProbe({spec!r}): the set has no documents")
        self.spec, self.rel, self.depth = spec, int(rel), int(depth)
        self.qids: list[str] = [str(q) for q in topics["qid"]]
        self.queries: list[str] = [str(q) for q in topics["query"]]

    def __repr__(self) -> str:
        return f"RetrievalProbe({self.spec!r}, {len(self.qids)} queries, {len(self.docnos)} documents)"

    def measures(self) -> dict[str, Any]:
        """The ``ir_measures`` measure behind each returned name."""
        from ir_measures import RR, nDCG

        return {"ndcg_cut_10": nDCG @ 10, "recip_rank_10": (RR @ 10) if self.rel == 1 else RR(rel=self.rel) @ 10}

    def evaluate_vectors(self, query_vecs: Any, doc_vecs: Any) -> dict[str, float]:
        """The measures of ranking ``doc_vecs`` (rows in :attr:`docnos` order) by dot product with ``query_vecs``
        (rows in :attr:`qids` order)."""
        import ir_measures

        q, d = (v.detach().float().cpu() if torch.is_tensor(v) else torch.as_tensor(np.asarray(v, dtype=np.float32))
                for v in (query_vecs, doc_vecs))
        if q.shape[0] != len(self.qids) or d.shape[0] != len(self.docnos) or q.shape[1:] != d.shape[1:]:
            raise ValueError(f"{self!r}: got {tuple(q.shape)} query and {tuple(d.shape)} document vectors")
        if not (torch.isfinite(q).all() and torch.isfinite(d).all()):
            raise ValueError(f"{self!r}: the model gave non-finite vectors")
        run = []
        for start in range(0, q.shape[0], 256):
            scores, idx = torch.topk(q[start:start + 256] @ d.T, min(self.depth, d.shape[0]), dim=1)
            for row, (s, i) in enumerate(zip(scores.tolist(), idx.tolist())):
                run.extend(ir_measures.ScoredDoc(self.qids[start + row], self.docnos[j], float(v)) for v, j in zip(s, i))
        qrels = [ir_measures.Qrel(str(r.qid), str(r.docno), int(r.label)) for r in self.qrels.itertuples()]
        measures = self.measures()
        names = {m: n for n, m in measures.items()}
        sums = dict.fromkeys(measures, 0.0)
        for m in ir_measures.iter_calc(list(measures.values()), qrels, run):
            sums[names[m.measure]] += float(m.value)
        nq = self.qrels["qid"].nunique()  # every judged query counts (pt.Experiment: a missing one scores 0)
        return {name: sums[name] / nq for name in METRICS}

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, tokenizer: Any, pooling: str = "cls", normalize: bool = False,
                 max_length: int = 256, batch_size: int = 32,
                 query_max_length: Optional[int] = None) -> dict[str, float]:
        """nDCG@10 and RR@10 of a HF encoder (its output has ``last_hidden_state``; its training mode is restored),
        ``pooling`` ``cls`` or ``mean``, documents cut at ``max_length`` tokens, queries at ``query_max_length``."""
        from pyterrier_cpdae.encoder.pooling import pool

        was_training = model.training
        model.eval()
        device = next(model.parameters()).device

        def encode(texts: Sequence[str], length: int) -> torch.Tensor:
            order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))  # batches of similar length
            parts = []
            for s in range(0, len(order), batch_size):
                enc = tokenizer([texts[i] for i in order[s:s + batch_size]], max_length=length, truncation=True,
                                padding=True, return_tensors="pt").to(device)
                out = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
                parts.append(pool(out.last_hidden_state, enc["attention_mask"], pooling, normalize).cpu())
            vecs = torch.cat(parts)
            back = torch.empty_like(vecs)
            back[torch.as_tensor(order)] = vecs  # rows back in the texts' order
            return back

        try:
            q, d = encode(self.queries, query_max_length or max_length), encode(self.docs, max_length)
        finally:
            model.train(was_training)
        return self.evaluate_vectors(q, d)


def _evaluator_base() -> type:
    from sentence_transformers.evaluation import SentenceEvaluator

    return SentenceEvaluator


class ProbeEvaluator(_evaluator_base()):
    """A sentence-transformers evaluator over a :class:`RetrievalProbe`: the model encodes the probe's queries and
    documents with its own pipeline (``encode_query`` / ``encode_document``); the figures are
    :meth:`RetrievalProbe.evaluate_vectors`', returned as ``<name>_ndcg_cut_10`` (the primary metric) and
    ``<name>_recip_rank_10``."""

    def __init__(self, probe: RetrievalProbe, name: str = "probe", batch_size: int = 32):
        super().__init__()
        self.probe, self.name, self.batch_size = probe, name, batch_size
        self.primary_metric = "ndcg_cut_10"
        self.greater_is_better = True

    def __call__(self, model: Any, output_path: Optional[str] = None, epoch: int = -1,
                 steps: int = -1) -> dict[str, float]:
        kw = {"batch_size": self.batch_size, "convert_to_tensor": True, "show_progress_bar": False}
        q, d = model.encode_query(self.probe.queries, **kw), model.encode_document(self.probe.docs, **kw)
        metrics = self.prefix_name_to_metrics(self.probe.evaluate_vectors(q, d), self.name)
        self.store_metrics_in_model_card_data(model, metrics, epoch, steps)
        return metrics

    def get_config_dict(self) -> dict[str, Any]:
        return {"set": self.probe.spec, "queries": len(self.probe.qids), "documents": len(self.probe.docnos),
                "rel": self.probe.rel}
