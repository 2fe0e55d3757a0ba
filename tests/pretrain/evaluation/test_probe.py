"""The retrieval probe's figures are pt.Experiment's (CPDAE + DenseIndex, exact search) for the same weights."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from pretrain.evaluation.probe import ProbeEvaluator, RetrievalProbe


def _experiment(probe: RetrievalProbe, model_dir: str, tmp_path, **encoder) -> dict[str, float]:
    """nDCG@10 and RR@10 of the probe's queries and documents through CPDAE, DenseIndex and pt.Experiment."""
    import pyterrier as pt
    from pyterrier_cpdae import CPDAE, DenseIndex

    enc = CPDAE.from_pretrained(model_dir, **encoder)
    index = DenseIndex(str(tmp_path / "probe.dense"))
    (enc.doc_encoder() >> index.indexer()).index(
        [{"docno": n, "text": t} for n, t in zip(probe.docnos, probe.docs)])
    topics = pd.DataFrame({"qid": probe.qids, "query": probe.queries})
    measures = probe.measures()
    res = pt.Experiment([enc.query_encoder() >> index.retriever()], topics, probe.qrels,
                        eval_metrics=list(measures.values()), names=["dense"])
    row = res.iloc[0]
    return {name: float(row[str(m)]) for name, m in measures.items()}


@pytest.mark.parametrize("pooling,normalize", [("mean", True), ("cls", False)])
def test_probe_equals_pt_experiment_on_the_sample_set(minilm_path, tmp_path, pooling, normalize):
    from transformers import AutoModel, AutoTokenizer

    probe = RetrievalProbe("sample")
    assert len(probe.qids) == 38 and len(probe.docnos) == 160
    assert set(probe.qrels["label"]) >= {1, 2}  # graded labels: nDCG uses the gains
    model, tok = AutoModel.from_pretrained(minilm_path), AutoTokenizer.from_pretrained(minilm_path)
    model.train()
    got = probe.evaluate(model, tok, pooling=pooling, normalize=normalize, max_length=256, query_max_length=32,
                         batch_size=16)
    assert model.training  # its mode is restored
    want = _experiment(probe, minilm_path, tmp_path, pooling=pooling, normalize=normalize, query_max_length=32,
                       doc_max_length=256)
    assert set(got) == {"ndcg_cut_10", "recip_rank_10"}
    for name in got:
        assert got[name] == pytest.approx(want[name], abs=5e-5), name
    assert 0.3 < got["ndcg_cut_10"] < 1.0  # a real encoder on a real set, not a degenerate ranking


def test_probe_measures_by_hand():
    """A probe of one query scored on hand-made vectors: graded nDCG@10 and RR@10 computed by hand."""
    probe = RetrievalProbe("sample", max_queries=1, seed=3)
    qid = probe.qids[0]
    labels = {r.docno: r.label for r in probe.qrels.itertuples()}
    judged = sorted(labels, key=labels.get)  # lowest label first
    # the document ranked first is the judged document with the lowest label, then three unjudged ones, then the
    # others of the judged (highest label last); every other document scores 0
    first, rest = judged[0], judged[1:]
    unjudged = [d for d in probe.docnos if d not in labels][:3]
    ranking = [first] + unjudged + rest
    import numpy as np

    d = np.zeros((len(probe.docnos), 1), dtype=np.float32)
    for pos, docno in enumerate(ranking):
        d[probe.docnos.index(docno), 0] = 100.0 - pos
    got = probe.evaluate_vectors(np.ones((1, 1), dtype=np.float32), d)
    gains = [labels.get(doc, 0) for doc in ranking[:10]]
    dcg = sum(g / math.log2(i + 2) for i, g in enumerate(gains))
    ideal = sorted(labels.values(), reverse=True)[:10]
    idcg = sum(g / math.log2(i + 2) for i, g in enumerate(ideal))
    assert qid in set(probe.qrels["qid"])
    assert got["ndcg_cut_10"] == pytest.approx(dcg / idcg, abs=1e-9)
    first_rel = next(i for i, g in enumerate(gains) if g >= 1)
    assert got["recip_rank_10"] == pytest.approx(1 / (first_rel + 1), abs=1e-9)


def test_probe_evaluator_is_the_probe_for_a_sentence_transformer(minilm_path, tmp_path):
    """The trainer's evaluator on an all-MiniLM SentenceTransformer (mean pooling + Normalize) gives pt.Experiment's
    figures for CPDAE.from_pretrained of the same folder (its pipeline read from modules.json)."""
    from sentence_transformers import SentenceTransformer

    probe = RetrievalProbe("sample", max_queries=20, seed=1)
    evaluator = ProbeEvaluator(probe, name="probe")
    got = evaluator(SentenceTransformer(minilm_path, device="cpu"))
    assert evaluator.primary_metric == "probe_ndcg_cut_10"
    want = _experiment(probe, minilm_path, tmp_path, query_max_length=256, doc_max_length=256)
    assert got["probe_ndcg_cut_10"] == pytest.approx(want["ndcg_cut_10"], abs=5e-5)
    assert got["probe_recip_rank_10"] == pytest.approx(want["recip_rank_10"], abs=5e-5)


def test_probe_on_a_real_set_equals_pt_experiment(vaswani_dir, minilm_path, tmp_path):
    """Vaswani (real queries and judgements), a seeded cut: 25 queries, 1,500 documents (all judged ones kept)."""
    from transformers import AutoModel, AutoTokenizer

    probe = RetrievalProbe(f"trec:{vaswani_dir}", max_queries=25, max_docs=1500, seed=0)
    assert len(probe.qids) == 25 and len(probe.docnos) == 1500
    assert set(probe.qrels["docno"]) <= set(probe.docnos)
    model, tok = AutoModel.from_pretrained(minilm_path), AutoTokenizer.from_pretrained(minilm_path)
    got = probe.evaluate(model, tok, pooling="mean", normalize=True, max_length=128, query_max_length=32,
                         batch_size=32)
    want = _experiment(probe, minilm_path, tmp_path, pooling="mean", normalize=True, query_max_length=32,
                       doc_max_length=128)
    for name in got:
        assert got[name] == pytest.approx(want[name], abs=5e-5), name


def test_probe_refuses_bad_options():
    with pytest.raises(ValueError, match="max_queries must be >= 1"):
        RetrievalProbe("sample", max_queries=0)
    with pytest.raises(ValueError, match="depth must be >= 10"):
        RetrievalProbe("sample", depth=5)
