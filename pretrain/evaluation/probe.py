"""The retrieval probe: nDCG@10 and RR@10 of an encoder on a small test collection, during training, equal to
``pt.Experiment``'s for the same weights: encoded by :class:`pyterrier_cpdae.CPDAE` around the model being trained,
ranked by exact dot product, scored with ``ir_measures`` (graded labels). :class:`ProbeEvaluator` is the
sentence-transformers evaluator over the same probe.
"""
from __future__ import annotations

from typing import Any, Optional

import ir_measures
import numpy as np
import pandas as pd
import torch
from pyterrier_cpdae import CPDAE, load_dataset
from sentence_transformers.evaluation import SentenceEvaluator


class RetrievalProbe:
    """A small retrieval test set held in memory, scored by exact search: the set ``spec`` of
    :func:`pyterrier_cpdae.load_dataset`, a sample (``seed``) of ``max_queries`` judged queries, at most ``max_docs``
    documents (the judged ones of the kept queries first), ``depth`` (>= 10) documents ranked per query; ``rel`` is
    the least label relevant for RR@10 (TREC DL: 2), nDCG@10 uses the graded labels."""

    def __init__(self, spec: str, max_queries: Optional[int] = None, max_docs: Optional[int] = None, *, seed: int = 0,
                 rel: int = 1, depth: int = 100):
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
        self.docnos, self.docs = [], []
        room = float("inf") if max_docs is None else max(max_docs - len(judged), 0)  # for the unjudged documents
        for doc in ds.get_corpus_iter():
            if doc["docno"] in judged or room > 0:
                room -= doc["docno"] not in judged
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
        rr = ir_measures.RR if self.rel == 1 else ir_measures.RR(rel=self.rel)
        return {"ndcg_cut_10": ir_measures.nDCG @ 10, "recip_rank_10": rr @ 10}

    def evaluate_vectors(self, query_vecs: Any, doc_vecs: Any) -> dict[str, float]:
        """The measures of ranking ``doc_vecs`` (rows in :attr:`docnos` order) by dot product with ``query_vecs``
        (rows in :attr:`qids` order)."""
        q, d = (torch.as_tensor(np.asarray(v.detach().float().cpu() if torch.is_tensor(v) else v, dtype=np.float32))
                for v in (query_vecs, doc_vecs))
        if q.shape[0] != len(self.qids) or d.shape[0] != len(self.docnos) or q.shape[1:] != d.shape[1:]:
            raise ValueError(f"{self!r}: got {tuple(q.shape)} query and {tuple(d.shape)} document vectors")
        if not (torch.isfinite(q).all() and torch.isfinite(d).all()):
            raise ValueError(f"{self!r}: the model gave non-finite vectors")
        top = [torch.topk(q[s:s + 256] @ d.T, min(self.depth, d.shape[0]), dim=1) for s in range(0, len(q), 256)]
        idx = torch.cat([t.indices for t in top]).numpy()
        run = pd.DataFrame({"query_id": np.repeat(self.qids, idx.shape[1]),
                            "doc_id": np.asarray(self.docnos)[idx].ravel(),
                            "score": torch.cat([t.values for t in top]).numpy().ravel().astype(np.float64)})
        qrels = pd.DataFrame({"query_id": self.qrels["qid"].astype(str), "doc_id": self.qrels["docno"].astype(str),
                              "relevance": self.qrels["label"].astype(int)})
        found = ir_measures.calc_aggregate(list(self.measures().values()), qrels, run)
        return {name: float(found[m]) for name, m in self.measures().items()}

    def evaluate(self, model: torch.nn.Module, tokenizer: Any, pooling: str = "cls", normalize: bool = False,
                 max_length: int = 256, batch_size: int = 32,
                 query_max_length: Optional[int] = None) -> dict[str, float]:
        """nDCG@10 and RR@10 of a HF encoder (its training mode is restored) encoding as :class:`pyterrier_cpdae.CPDAE`
        (``pooling`` ``cls`` or ``mean``): documents cut at ``max_length`` tokens, queries at ``query_max_length``."""
        enc = CPDAE(model, tokenizer, pooling=pooling, normalize=normalize, doc_max_length=max_length,
                    query_max_length=query_max_length or max_length, batch_size=batch_size, verbose=False)
        return self.evaluate_vectors(enc.encode_queries(self.queries), enc.encode_docs(self.docs))


class ProbeEvaluator(SentenceEvaluator):
    """A sentence-transformers evaluator over a :class:`RetrievalProbe` (the model's own ``encode_query`` /
    ``encode_document``): ``<name>_ndcg_cut_10`` (the primary metric) and ``<name>_recip_rank_10``."""

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
