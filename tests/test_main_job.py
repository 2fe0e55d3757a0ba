"""The main job (``experiments/main.py``) on its built-in default, checked against independent references.

* The dense system's nDCG@10 is recomputed from sentence-transformers' own encoding of the sample
  collection (exhaustive cosine ranking, ir_measures), not from anything of ours.
* The significance test is recomputed with scipy's paired t-test over per-query nDCG@10 of the two runs.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[1]


def _load_main():
    spec = importlib.util.spec_from_file_location("cpdae_main_job", REPO / "experiments" / "main.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_main_job_on_the_builtin_sample(tmp_path, minilm_path):
    from ir_measures import nDCG
    from scipy.stats import ttest_rel
    from sentence_transformers import SentenceTransformer

    from pyterrier_cpdae import BM25Index, load_dataset

    work, results = tmp_path / "work", tmp_path / "results"
    table = _load_main().main(["--work-dir", str(work), "--results-dir", str(results)])

    assert list(table["name"]) == ["BM25 (pyserini, k1=0.9 b=0.4)", "dense (all-MiniLM-L6-v2, mean)"]
    for column in ("nDCG@10", "RR@10", "R@1000", "AP", "nDCG@10 p-value", "nDCG@10 p-value corrected",
                   "nDCG@10 reject"):
        assert column in table.columns
    written = pd.read_csv(results / "table.csv")
    assert list(written["name"]) == list(table["name"])
    assert "| dense (all-MiniLM-L6-v2, mean)" in (results / "table.md").read_text()

    ds = load_dataset("sample")
    topics, qrels = ds.get_topics(), ds.get_qrels()
    docs = list(ds.get_corpus_iter())

    # independent dense reference: sentence-transformers encodes everything, numpy ranks exhaustively
    st = SentenceTransformer(minilm_path, device="cpu")
    st.max_seq_length = 256
    d = st.encode([x["text"] for x in docs], normalize_embeddings=True, batch_size=32)
    q = st.encode(list(topics["query"]), normalize_embeddings=True, batch_size=32)
    scores = q @ d.T
    ref_run = pd.DataFrame([(qid, docs[j]["docno"], float(scores[i, j]))
                            for i, qid in enumerate(topics["qid"]) for j in range(len(docs))],
                           columns=["query_id", "doc_id", "score"])
    ir_qrels = qrels.rename(columns={"qid": "query_id", "docno": "doc_id", "label": "relevance"})
    ref_dense = {m.query_id: m.value for m in (nDCG @ 10).iter_calc(ir_qrels, ref_run)}
    dense_row = table.iloc[1]
    assert dense_row["nDCG@10"] == pytest.approx(np.mean(list(ref_dense.values())), abs=1e-3)

    # independent significance test: scipy's paired t-test on the per-query values of both runs
    bm25_run = BM25Index(str(work / "bm25")).bm25(num_results=1000)(topics)
    bm25_run = bm25_run.rename(columns={"qid": "query_id", "docno": "doc_id"})[["query_id", "doc_id", "score"]]
    ref_bm25 = {m.query_id: m.value for m in (nDCG @ 10).iter_calc(ir_qrels, bm25_run)}
    qids = sorted(ref_dense)
    a = [ref_bm25.get(x, 0.0) for x in qids]
    b = [ref_dense[x] for x in qids]
    assert table.iloc[0]["nDCG@10"] == pytest.approx(np.mean(a), abs=1e-3)
    assert dense_row["nDCG@10 p-value"] == pytest.approx(ttest_rel(a, b).pvalue, rel=0.05)


def _fail(*args, **kwargs):
    raise AssertionError("recomputed what an earlier run saved")


def test_main_job_second_run_reuses_indexes_and_saved_runs(tmp_path, minilm_path, monkeypatch):
    from pyterrier_cpdae import BM25Index, CPDAE, DenseIndex

    work, results = tmp_path / "work", tmp_path / "results"
    argv = ["--work-dir", str(work), "--results-dir", str(results), "--max-topics", "5"]
    main = _load_main().main
    first = main(argv)
    runs = sorted((work / "runs").rglob("*.res.gz"))
    assert len(runs) == 2
    files = [p for p in work.rglob("*") if p.is_file() and "runs" not in p.parts]
    stamps = {p: p.stat().st_mtime_ns for p in files + runs}
    # a second run may neither index nor encode (the dense run and the dense index are saved) nor rewrite a run
    monkeypatch.setattr(BM25Index, "indexer", _fail)
    monkeypatch.setattr(DenseIndex, "indexer", _fail)
    monkeypatch.setattr(CPDAE, "_encode", _fail)
    second = main(argv)
    pd.testing.assert_frame_equal(first, second)
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert "2 of 2 reused" in (results / "table.md").read_text()
    # another topic set is another run directory, not a stale reuse
    monkeypatch.undo()
    main(argv[:-1] + ["3"])
    assert len(sorted((work / "runs").rglob("*.res.gz"))) == 4
