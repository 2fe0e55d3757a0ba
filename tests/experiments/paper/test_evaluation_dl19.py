"""TREC DL 2019 in the paper's Table 1: the ``dl19`` evaluation set, its measures, seeds and marks.

- the set loads offline through ``ir_datasets.load`` (the pipeline's dataset loader, in a child process whose
  ``IR_DATASETS_HOME`` is a temporary copy of ``../shared/data/msmarco-dl19-judged/irds``): 43 queries, 9,260
  graded qrels, the 9,139 judged passages;
- its measures on a hand-built run equal hand-computed values (graded nDCG@10, RR@10 and R@1000 with label >= 2);
- every scale's Table 1 rows have the same >= 3 fine-tuning seeds, and no significance mark is printed between rows
  of unequal seed counts;
- the smoke-scale pipeline writes Table 1 with the DL19 columns (tests/experiments/paper/test_paper_smoke.py, on the shared smoke run).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from experiments.paper.config import SCALES, load_config

REPO = Path(__file__).resolve().parents[3]
SHARED = REPO.parent / "shared" / "data"
DL19 = SHARED / "msmarco-dl19-judged"
METRICS = ["nDCG@10", "RR(rel=2)@10", "R(rel=2)@1000"]


def _need(*subs: str) -> None:
    for sub in subs:
        if not (SHARED / sub).exists():
            pytest.skip(f"real data not available: {SHARED / sub} is absent (it lives in ../shared/data)")


# ----------------------------------------------------------------------------- configs (no data needed)
@pytest.mark.parametrize("scale", SCALES)
def test_every_scale_evaluates_dl19_and_gives_every_table1_row_the_same_seeds(scale, tmp_path):
    """Three fine-tuning seeds per row in every protocol; the smoke sizes run two, the fewest a mean ± std needs."""
    from experiments.paper.pipeline import BM25, Plan

    cfg = load_config(scale, work_dir=tmp_path / "work")
    dl19 = cfg["eval_sets"]["dl19"]
    assert dl19["spec"] == "irds:msmarco-passage/trec-dl-2019/judged"
    assert dl19["metrics"] == METRICS and dl19["seeds"] == "all"
    assert "fine-tuned" in dl19.get("blocks", ["fine-tuned"]) and int(dl19["evaluation"]["num_results"]) >= 1000
    plan = Plan(cfg)
    rows = [k for _, k in cfg["tables"]["table1"]["rows"] if k != BM25]
    assert set(rows) <= set(plan.models)
    fine_tuned_sets = {e["finetuned_on"] for e in cfg["eval_sets"].values() if "fine-tuned" in e.get("blocks", ["fine-tuned"])}
    for set_name in fine_tuned_sets:
        seeds = {k: [s for s, _ in plan.finetuned_seeds[set_name][k]] for k in rows}
        first = seeds[rows[0]]
        assert len(first) >= (2 if scale == "smoke" else 3) and all(v == first for v in seeds.values()), (set_name,
                                                                                                       seeds)
        assert all(cfg["eval_sets"][s].get("seeds") == "all" for s, e in cfg["eval_sets"].items()
                   if e.get("finetuned_on") == set_name and "fine-tuned" in e.get("blocks", ["fine-tuned"]))
    # the MARCO sample and DL19 share ir_datasets' msmarco-passage folder name: DL19 must bring its own copy where
    # the scale reads the sample from a copy (the cpu family), and read the one home where it is the real dataset
    assert bool(dl19.get("irds_copy_from")) == bool(cfg.get("irds_copy_from"))


def test_bundle_overlay_moves_dl19s_own_ir_datasets_folder():
    sys.path.insert(0, str(REPO / "experiments" / "gpu"))
    try:
        from build_bundle import COLLECTIONS, make_overlay
    finally:
        sys.path.pop(0)
    raw = load_config("gpu")
    over = make_overlay(json.loads(json.dumps(raw)), ".gpu_bundle/data", ".gpu_bundle/model", ".gpu_bundle/bm25")
    assert over["eval_sets"]["dl19"]["irds_copy_from"] == ".gpu_bundle/data/msmarco-dl19-judged/irds"
    assert "msmarco-dl19-judged" in COLLECTIONS


# ----------------------------------------------------------------------------- measures on a hand-built run
def test_dl19_measures_on_a_hand_built_run_equal_hand_computed_values():
    """The config's DL19 measures through ``pt.Experiment`` (the pipeline's evaluation) on a 2-query run."""
    import pyterrier as pt

    from experiments.paper.evaluation import _measure

    qrels = pd.DataFrame([("q1", "d1", 3), ("q1", "d2", 1), ("q1", "d3", 2), ("q1", "d4", 0),
                          ("q2", "e1", 1), ("q2", "e2", 2)], columns=["qid", "docno", "label"])
    # q1 ranks d4 (0), d2 (1), d3 (2); d1 (3) is not retrieved. q2 ranks e2 (2), e1 (1)
    run = pd.DataFrame([("q1", "d4", 3.0, 0), ("q1", "d2", 2.0, 1), ("q1", "d3", 1.0, 2),
                        ("q2", "e2", 2.0, 0), ("q2", "e1", 1.0, 1)], columns=["qid", "docno", "score", "rank"])
    topics = pd.DataFrame({"qid": ["q1", "q2"], "query": ["a", "b"]})
    metrics = [_measure(m) for m in load_config("cpu")["eval_sets"]["dl19"]["metrics"]]
    res = pt.Experiment([pt.Transformer.from_df(run)], topics, qrels, eval_metrics=metrics, names=["run"],
                        perquery=True)
    got = {(r.qid, str(r.measure)): r.value for r in res.itertuples()}
    log2 = math.log2
    # graded gains (trec_eval's: the label itself), discount log2(rank + 1)
    ndcg_q1 = (0 / log2(2) + 1 / log2(3) + 2 / log2(4)) / (3 / log2(2) + 2 / log2(3) + 1 / log2(4))
    ndcg_q2 = (2 / log2(2) + 1 / log2(3)) / (2 / log2(2) + 1 / log2(3))
    assert got[("q1", "nDCG@10")] == pytest.approx(ndcg_q1, abs=1e-9)
    assert got[("q2", "nDCG@10")] == pytest.approx(ndcg_q2, abs=1e-9)
    # label >= 2 relevant: q1's first is d3 at rank 3 (label 1's d2 at rank 2 does not count); q2's e2 at rank 1
    assert got[("q1", "RR(rel=2)@10")] == pytest.approx(1 / 3)
    assert got[("q2", "RR(rel=2)@10")] == pytest.approx(1.0)
    # q1's label >= 2 documents are d1 and d3, one retrieved; q2's is e2 (e1, label 1, is not counted)
    assert got[("q1", "R(rel=2)@1000")] == pytest.approx(0.5)
    assert got[("q2", "R(rel=2)@1000")] == pytest.approx(1.0)


def test_metric_labels_say_label_two_is_relevant():
    from experiments.paper.tables import _metric_label

    assert [_metric_label(m) for m in METRICS] == ["nDCG@10", "MRR@10 (rel>=2)", "R@1000 (rel>=2)"]
    assert _metric_label("RR@10") == "MRR@10" and _metric_label("AP") == "MAP"


# ----------------------------------------------------------------------------- marks and seed counts
def _perquery(scores: dict[str, list[float]]) -> pd.DataFrame:
    return pd.DataFrame([{"name": n, "qid": str(q), "measure": "nDCG@10", "value": v}
                         for n, vals in scores.items() for q, v in enumerate(vals)])


def _fake_tables(res: dict, rows: list[list[str]]):
    from experiments.paper.tables import Tables

    cfg = {"eval_sets": {"dl19": {"label": "DL19", "metrics": ["nDCG@10"], "finetuned_on": "marco",
                                  "blocks": ["fine-tuned"], "seeds": "all"}},
           "finetune_sets": {"marco": {"seeds": [1, 2, 3]}}, "tables": {"table1": {"rows": rows}}}
    t = Tables(SimpleNamespace(cfg=cfg), writer=None, records=[])
    t.results[("dl19", "fine-tuned")] = res
    return t


def test_no_significance_mark_between_rows_of_unequal_seed_counts():
    """ICT with one seed and CPDAE with three both beat BERT's three seeds on every query (p < 0.05): CPDAE is marked,
    ICT is not (its p-value is still computed and kept); BM25, deterministic, is compared as before."""
    from experiments.paper.seeds import seed_summary
    from experiments.paper.tables import ALPHA, _marks

    n = 12
    base = [0.2 + 0.01 * q for q in range(n)]
    scores = {f"bert@s{s}": [v + 0.001 * s for v in base] for s in (1, 2, 3)}
    scores.update({f"cpdae@s{s}": [v + 0.1 + 0.002 * ((q + s) % 3) for q, v in enumerate(base)] for s in (1, 2, 3)})
    scores["ict@s1"] = [v + 0.1 + 0.003 * (q % 2) for q, v in enumerate(base)]
    scores["bm25"] = [v + 0.2 + 0.001 * (q % 4) for q, v in enumerate(base)]
    groups = {k: k.split("@")[0] for k in scores}
    res = seed_summary(_perquery(scores), groups, ["nDCG@10"], {"*": "bert"})
    p = res["pvalues"]["*"]
    assert res["seeds"] == {"bert": 3, "cpdae": 3, "ict": 1, "bm25": 1}
    assert p["ict"]["nDCG@10"] < ALPHA and p["cpdae"]["nDCG@10"] < ALPHA and p["bm25"]["nDCG@10"] < ALPHA
    assert _marks(res, "cpdae", "nDCG@10", {"*": "bert"}) == "*"
    assert _marks(res, "ict", "nDCG@10", {"*": "bert"}) == ""          # 1 seed against 3: no mark
    assert _marks(res, "bm25", "nDCG@10", {"*": "bert"}) == "*"        # no fine-tuning seeds: compared as before
    # the rendered table: ICT's cell says it has one seed and carries no mark; the notes say why
    t = _fake_tables(res, [["BM25", "bm25"], ["BERT", "bert"], ["ICT", "ict"], ["CPDAE", "cpdae"]])
    (_, df), = t._grid(t.cfg["tables"]["table1"]["rows"], {"*": "bert"})[0]
    cells = dict(zip(df["Model"], df["DL19 nDCG@10"]))
    assert cells["ICT"].endswith(" (1 seed)") and "*" not in cells["ICT"]
    assert cells["CPDAE"].endswith("*") and " ± " in cells["CPDAE"] and cells["BM25"].endswith("*")
    # three seeds each: ICT is marked like CPDAE
    scores.update({f"ict@s{s}": [v + 0.1 + 0.003 * ((q + s) % 2) for q, v in enumerate(base)] for s in (2, 3)})
    groups = {k: k.split("@")[0] for k in scores}
    res3 = seed_summary(_perquery(scores), groups, ["nDCG@10"], {"*": "bert"})
    assert res3["seeds"]["ict"] == 3 and _marks(res3, "ict", "nDCG@10", {"*": "bert"}) == "*"


def test_marks_without_seeds_are_unchanged():
    """A block evaluated without seeds (zero-shot) marks as before."""
    from experiments.paper.tables import _marks

    res = {"means": {"bert": {"m": 0.2}, "ict": {"m": 0.3}}, "pvalues": {"*": {"ict": {"m": 0.01}, "bert": {"m": None}}}}
    assert _marks(res, "ict", "m", {"*": "bert"}) == "*"


# ----------------------------------------------------------------------------- real data
@pytest.mark.real_data
def test_dl19_set_loads_offline_through_ir_datasets_from_a_temp_copy(tmp_path):
    """The cpu config's dl19 set, materialised by the pipeline (a child process reading a copy of the shared folder
    through ``load_dataset('irds:...')``, i.e. ``ir_datasets.load``), holds every judged query, judgement and passage
    of the shared folder, compared with its raw files read here by hand."""
    _need("msmarco-dl19-judged")
    from experiments.paper.data import set_spec
    from experiments.paper.evaluation import eval_topics
    from pyterrier_cpdae import load_dataset

    entry = load_config("cpu", work_dir=tmp_path / "work")["eval_sets"]["dl19"]
    work = tmp_path / "work"
    spec = set_spec("dl19", entry, work)
    assert spec == f"beir:{work / 'data' / 'dl19'}:train"
    assert (work / "irds_sets" / "dl19" / "msmarco-passage" / "collection.tsv").exists()   # the copy ir_datasets read
    done = json.loads((work / "data" / "dl19" / "materialised.json").read_text())
    assert (done["num_queries"], done["num_qrels"], done["num_docs"]) == (43, 9260, 9139)
    ds = load_dataset(spec)
    topics, qrels = eval_topics(ds)
    assert len(topics) == 43 and len(qrels) == 9260
    raw = DL19 / "irds" / "msmarco-passage" / "trec-dl-2019"
    want = {tuple(line.split()[i] for i in (0, 2, 3)) for line in (raw / "qrels").read_text().splitlines() if line.strip()}
    got = set(zip(qrels["qid"], qrels["docno"], qrels["label"].astype(str)))
    assert got == want and len(want) == 9260
    assert sorted(qrels["label"].unique()) == [0, 1, 2, 3]                              # graded, kept as is
    queries = dict(line.split("\t", 1) for line in (raw / "queries.tsv").read_text().splitlines())
    assert all(queries[q] == text for q, text in zip(topics["qid"], topics["query"]))
    # materialised once: a second call reuses the folder (no child process, no copy)
    stamp = (work / "data" / "dl19" / "materialised.json").stat().st_mtime_ns
    assert set_spec("dl19", entry, work) == spec
    assert (work / "data" / "dl19" / "materialised.json").stat().st_mtime_ns == stamp


def test_a_missing_dl19_folder_is_a_clear_error(tmp_path):
    from experiments.paper.data import set_spec

    entry = {**load_config("cpu")["eval_sets"]["dl19"], "irds_copy_from": str(tmp_path / "absent")}
    with pytest.raises(FileNotFoundError, match=r"eval/train set dl19: irds_copy_from: .*absent"):
        set_spec("dl19", entry, tmp_path / "work")
