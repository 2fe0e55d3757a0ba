"""The main job (``experiments/main.py``) on its built-in default, checked against independent references.

The default pre-trains in the same run (``python -m pretrain``, here cut to 2 steps to keep the test short):
* both dense systems' nDCG@10 are recomputed from sentence-transformers' own encoding of the sample
  collection with the starting and with the exported model (exhaustive cosine ranking, ir_measures);
* the significance tests are recomputed with scipy's paired t-test over per-query nDCG@10, and the Holm
  correction by hand;
* the pre-trained row must come from a model that this run trained: its run_config.json and weights.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from tests.helpers.warm_python import warm_python
from tests.helpers.main_job import load_main

BM25 = "BM25 (pyserini, k1=0.9 b=0.4)"
START = "dense (all-MiniLM-L6-v2, mean)"
PRETRAINED = "dense (all-MiniLM-L6-v2 + cpdae 2 steps, mean)"


def _load_main():
    return load_main("cpdae_main_job")


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, minilm_path):
    """One run of the built-in default (pre-training cut to 2 steps), shared by the tests below."""
    root = tmp_path_factory.mktemp("main-job")
    work, results = root / "work", root / "results"
    argv = ["--work-dir", str(work), "--results-dir", str(results), "--pretrain-steps", "2"]
    with pytest.MonkeyPatch.context() as mp:  # its `python -m pretrain` starts warm (tests/helpers/warm_python.py)
        mp.setattr(sys, "executable", warm_python())
        table = _load_main().main(argv)
    return SimpleNamespace(work=work, results=results, argv=argv, table=table)


def _per_query_ndcg(run: pd.DataFrame, qrels: pd.DataFrame) -> dict:
    from ir_measures import nDCG

    ir_qrels = qrels.rename(columns={"qid": "query_id", "docno": "doc_id", "label": "relevance"})
    return {m.query_id: m.value for m in (nDCG @ 10).iter_calc(ir_qrels, run)}


def _st_run(model_dir: str, docs: list, topics: pd.DataFrame) -> pd.DataFrame:
    """sentence-transformers encodes everything, numpy ranks exhaustively by cosine."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(model_dir, device="cpu")
    st.max_seq_length = 256
    d = st.encode([x["text"] for x in docs], normalize_embeddings=True, batch_size=32)
    q = st.encode(list(topics["query"]), normalize_embeddings=True, batch_size=32)
    scores = q @ d.T
    return pd.DataFrame([(qid, docs[j]["docno"], float(scores[i, j]))
                         for i, qid in enumerate(topics["qid"]) for j in range(len(docs))],
                        columns=["query_id", "doc_id", "score"])


def _holm(pvalues: list) -> list:
    """Holm's step-down correction, written out: the i-th smallest p times (m - i), made monotone, capped at 1."""
    order = np.argsort(pvalues)
    out, running = [0.0] * len(pvalues), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, pvalues[i] * (len(pvalues) - rank)))
        out[i] = running
    return out


def test_main_job_pretrains_and_compares_three_systems(default_run, minilm_path):
    from scipy.stats import ttest_rel
    from transformers import AutoModel

    from pyterrier_cpdae import BM25Index, load_dataset

    table, work, results = default_run.table, default_run.work, default_run.results
    assert list(table["name"]) == [BM25, START, PRETRAINED]
    for column in ("nDCG@10", "RR@10", "R@1000", "AP", "nDCG@10 p-value", "nDCG@10 p-value corrected",
                   "nDCG@10 reject", "AP p-value"):
        assert column in table.columns
    assert table.iloc[0][["nDCG@10 p-value", "AP p-value"]].isna().all()  # the baseline
    for row in (1, 2):
        assert 0.0 <= table.iloc[row]["nDCG@10 p-value"] <= 1.0 and 0.0 <= table.iloc[row]["AP p-value"] <= 1.0
    written = pd.read_csv(results / "table.csv")
    assert list(written["name"]) == list(table["name"])
    vs_start = pd.read_csv(results / "table_vs_start.csv")
    assert list(vs_start["name"]) == [START, PRETRAINED]
    md = (results / "table.md").read_text()
    assert f"| {PRETRAINED}" in md and "## Baseline: the starting encoder" in md
    assert "cannot show a pre-training effect" in md and "python -m pretrain --objective cpdae" in md
    # the record names no path of this machine: the work directory as <work-dir>, the repository's paths relative
    assert str(work) not in md and str(results) not in md and "reused from <work-dir>/runs/" in md
    assert "Command: `python experiments/main.py --work-dir " in md and " `" not in md.split("Command: ", 1)[1].split("\n", 1)[0]

    # the third row is a model that `python -m pretrain` trained in this run, from MiniLM, for 2 steps
    (pt_dir,) = [p for p in (work / "pretrain").iterdir() if not p.name.startswith(".")]  # beside .token_cache
    run_config = json.loads((pt_dir / "run_config.json").read_text())["config"]
    assert (run_config["objective"], run_config["max_steps"], run_config["representation"]) == ("cpdae", 2, "mean")
    assert Path(run_config["model"]) == Path(minilm_path)
    # the Trainer's log history (kept in the output directory once the checkpoints go) ends at step 2 with a loss
    history = json.loads((pt_dir / "trainer_state.json").read_text())["log_history"]
    losses = [row for row in history if "loss" in row]
    assert losses and losses[-1]["step"] == 2 and all(math.isfinite(row["loss"]) for row in losses)
    assert not list(pt_dir.glob("checkpoint-*"))  # optimizer state removed once the model is exported
    start, trained = AutoModel.from_pretrained(minilm_path), AutoModel.from_pretrained(pt_dir)
    start_params = dict(start.named_parameters())
    diffs = [(p - start_params[n]).abs().max().item() for n, p in trained.named_parameters()]
    assert len(diffs) == len(start_params) and max(diffs) > 0

    ds = load_dataset("sample")
    topics, qrels = ds.get_topics(), ds.get_qrels()
    docs = list(ds.get_corpus_iter())
    ref_start = _per_query_ndcg(_st_run(minilm_path, docs, topics), qrels)
    ref_trained = _per_query_ndcg(_st_run(str(pt_dir), docs, topics), qrels)
    assert table.iloc[1]["nDCG@10"] == pytest.approx(np.mean(list(ref_start.values())), abs=1e-3)
    assert table.iloc[2]["nDCG@10"] == pytest.approx(np.mean(list(ref_trained.values())), abs=1e-3)

    bm25_run = BM25Index(str(work / "bm25")).bm25(num_results=1000)(topics)
    bm25_run = bm25_run.rename(columns={"qid": "query_id", "docno": "doc_id"})[["query_id", "doc_id", "score"]]
    ref_bm25 = _per_query_ndcg(bm25_run, qrels)
    qids = sorted(ref_start)
    a = [ref_bm25.get(x, 0.0) for x in qids]
    b, c = [ref_start[x] for x in qids], [ref_trained[x] for x in qids]
    assert table.iloc[0]["nDCG@10"] == pytest.approx(np.mean(a), abs=1e-3)
    p = [ttest_rel(a, b).pvalue, ttest_rel(a, c).pvalue]
    assert list(table["nDCG@10 p-value"].iloc[1:]) == pytest.approx(p, rel=0.05)
    assert list(table["nDCG@10 p-value corrected"].iloc[1:]) == pytest.approx(_holm(p), rel=0.05)
    # the pre-trained model against its starting encoder (a single comparison: Holm changes nothing)
    p_start = ttest_rel(b, c).pvalue  # nan when 2 steps left every query's nDCG@10 unchanged
    assert vs_start.iloc[1]["nDCG@10 p-value"] == pytest.approx(p_start, rel=0.05, nan_ok=True)


def _fail(*args, **kwargs):
    raise AssertionError("recomputed what an earlier run saved")


def test_main_job_second_run_reuses_model_indexes_and_saved_runs(default_run, monkeypatch):
    from pyterrier_cpdae import BM25Index, CPDAE, DenseIndex

    work, results, argv = default_run.work, default_run.results, default_run.argv
    runs = sorted((work / "runs").rglob("*.res.gz"))
    assert len(runs) == 3
    files = [p for p in work.rglob("*") if p.is_file() and "runs" not in p.parts]
    stamps = {p: p.stat().st_mtime_ns for p in files + runs}
    # a second run may neither pre-train nor index nor encode (the dense runs are saved) nor rewrite a run
    monkeypatch.setattr(subprocess, "run", _fail)
    monkeypatch.setattr(BM25Index, "indexer", _fail)
    monkeypatch.setattr(DenseIndex, "indexer", _fail)
    monkeypatch.setattr(CPDAE, "_encode", _fail)
    second = _load_main().main(argv)
    pd.testing.assert_frame_equal(default_run.table, second)
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    md = (results / "table.md").read_text()
    assert "3 of 3 reused" in md and "pretrain_s=reused" in md

    # --no-pretrain: BM25 against the encoder only, from the same indexes; another topic set is another run
    # directory, not a stale reuse
    monkeypatch.undo()  # queries of the new topic set are encoded; still nothing is pre-trained or indexed
    monkeypatch.setattr(subprocess, "run", _fail)
    monkeypatch.setattr(BM25Index, "indexer", _fail)
    monkeypatch.setattr(DenseIndex, "indexer", _fail)
    two = _load_main().main(argv + ["--no-pretrain", "--max-topics", "3"])
    assert list(two["name"]) == [BM25, START] and len(two) == 2
    assert not (results / "table_vs_start.csv").exists()  # no stale comparison left beside a table without it
    assert "dense (all-MiniLM-L6-v2 + cpdae" not in (results / "table.md").read_text()
    assert len(sorted((work / "runs").rglob("*.res.gz"))) == 5


def test_pretraining_is_on_by_default_only_for_the_builtin_default():
    parse = _load_main().parse_args
    assert parse([]).pretrain
    assert parse(["--no-pretrain"]).pretrain is False
    assert parse(["--model", "runs/x"]).pretrain is False
    assert parse(["--dataset", "trec:../shared/data/vaswani"]).pretrain is False
    assert parse(["--model", "runs/x", "--pretrain"]).pretrain is True
    with pytest.raises(SystemExit):
        parse(["--pretrain-steps", "0"])


def test_failed_pretraining_names_the_run_and_the_way_out(tmp_path, minilm_path, warm_children):
    work = tmp_path / "work"
    with pytest.raises(SystemExit, match=r"pre-training run failed.*--no-pretrain") as e:
        _load_main().main(["--work-dir", str(work), "--results-dir", str(tmp_path / "results"),
                           "--pretrain-steps", "2", "--pretrain-objective", "no-such-objective"])
    assert str(work / "pretrain") in str(e.value)
    assert not (work / "bm25").exists()  # nothing was indexed after the failure


def test_a_model_directory_retrained_in_place_is_indexed_and_evaluated_again(tmp_path, tiny_bert_dir):
    """A second run after ``--model`` was re-trained in place reused the dense index and the saved
    runs of the old weights (RR@10 0.048 reported where a rebuild gives 0.015).  Reference: a fresh run of the
    re-trained model in an empty work directory."""
    import shutil

    import torch
    from transformers import BertForMaskedLM

    model = tmp_path / "model"
    shutil.copytree(tiny_bert_dir, model)
    common = ["--model", str(model), "--no-pretrain", "--max-topics", "8", "--pooling", "mean",
              "--doc-max-length", "64", "--num-results", "50"]

    def run(work: str):
        return _load_main().main(common + ["--work-dir", str(tmp_path / work), "--results-dir",
                                           str(tmp_path / f"results-{work}")])

    first = run("work")
    torch.manual_seed(1)  # re-train in place: the same files, new weights
    BertForMaskedLM(BertForMaskedLM.from_pretrained(model).config).save_pretrained(model)
    second = run("work")
    fresh = run("fresh")
    pd.testing.assert_frame_equal(second, fresh)
    assert not first.iloc[1][["RR@10", "nDCG@10", "AP"]].equals(second.iloc[1][["RR@10", "nDCG@10", "AP"]])
    assert "0 of 2 reused" in (tmp_path / "results-work" / "table.md").read_text()  # no run of the old weights
    third = run("work")  # unchanged weights: everything is reused again
    pd.testing.assert_frame_equal(second, third)
    assert "2 of 2 reused" in (tmp_path / "results-work" / "table.md").read_text()


def test_holm_corrections_walk_only_the_objects_made_inside_the_experiment():
    """statsmodels' Holm correction runs a full gc.collect() per measure; inside the main job's block the objects made
    before it are frozen, so such a collection does not walk them, and they are collected as usual after it (a cycle
    that became garbage before the block: kept inside, freed after; reference: the collector's own answer)."""
    import gc
    import weakref

    block = _load_main()._collections_walk_new_objects_only

    class Node:
        pass

    enabled = gc.isenabled()
    gc.disable()  # no automatic collection between the steps below
    try:
        before = Node()
        before.me = before
        gone_before = weakref.ref(before)
        del before
        with block():
            assert gc.get_freeze_count() > 0
            inside = Node()
            inside.me = inside
            gone_inside = weakref.ref(inside)
            del inside
            gc.collect()
            assert gone_inside() is None and gone_before() is not None   # only the block's own objects walked
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert gone_before() is None
    finally:
        if enabled:
            gc.enable()
