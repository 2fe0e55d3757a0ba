"""The paper config (`--scale paper`) through the pipeline on tiny stand-ins (split from tests/experiments/paper/test_pipeline.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from tests.helpers.paper_run import TABLE1_ROWS
from tests.helpers.paper_run import run_paper as _run


WORDS = ("paris france capital banana yellow fruit physics quantum energy wing aircraft lift protein cell "
         "gene river bridge music piano violin ocean whale coral desert camel sand").split()


def _paper_stand_ins(root: Path, tiny_bert_dir: str) -> Path:
    """Tiny stand-ins for the paper config: overrides.json + msmarco-passage in ir_datasets' cache layout."""
    import random

    rng = random.Random(0)
    base = root / "irds" / "msmarco-passage"
    for sub in ("train", "dev/small", "trec-dl-2019"):
        (base / sub).mkdir(parents=True)
    (base / "irds_version.txt").write_text("v2")  # exactly, or the migrator deletes collection.tsv
    docs = [" ".join(rng.sample(WORDS, 6)) for _ in range(40)]
    (base / "collection.tsv").write_text("".join(f"{i}\t{d}\n" for i, d in enumerate(docs)))

    def queries(path: Path, qids: range) -> None:
        path.write_text("".join(f"{q}\t{' '.join(docs[q % 40].split()[:2])}\n" for q in qids))

    queries(base / "train" / "queries.tsv", range(100, 112))
    (base / "train" / "qrels").write_text("".join(f"{q} 0 {q % 40} 1\n" for q in range(100, 112)))
    (base / "train" / "small.triples.qidpid.tsv").write_text(
        "".join(f"{q}\t{q % 40}\t{(q + k) % 40}\n" for q in range(100, 112) for k in (3, 7, 11)))
    queries(base / "dev" / "small" / "queries.tsv", range(200, 206))
    (base / "dev" / "small" / "qrels").write_text("".join(f"{q} 0 {q % 40} 1\n" for q in range(200, 206)))
    queries(base / "trec-dl-2019" / "queries.tsv", range(300, 305))
    (base / "trec-dl-2019" / "qrels").write_text("".join(f"{q} Q0 {q % 40} {1 + q % 3}\n{q} Q0 {(q + 1) % 40} 0\n"
                                                          for q in range(300, 305)))
    corpus = root / "wiki.txt"
    corpus.write_text("".join(" ".join(rng.choices(WORDS, k=40)) + ". " + " ".join(rng.choices(WORDS, k=30)) + "\n"
                              for _ in range(40)))
    keep = {"mlm", "cpdae", "seed", "ict"}
    drop = {o: None for o in ("bow", "retromae", "simcse", "prop", "cpdae_r", "cpdae_nocl", "cpdae_idfrec",
                              "cpdae_clsum")}
    assert not keep & set(drop)
    overrides = {
        # stages in-process, as the smoke scale runs them (same argument parsing and code, without a ~7 s interpreter
        # start-up per stage); the subprocess runner is tested by tests/experiments/paper/test_main_parallel_stages.py and tests/experiments/gpu/test_build_bundle.py
        "runner": "inprocess",
        "corpus": str(corpus),
        "pretrain": {"base_model": tiny_bert_dir,
                     "continue": {"max_docs": 20, "max_length": 64, "global_batch_size": 4, "num_train_epochs": None,
                                  "max_steps": 2, "save_steps": 1000, "report_to": "none"}},
        "objectives": drop,
        "finetune": {"args": {"per_device_train_batch_size": 4, "max_steps": 2, "num_negatives": 2, "max_seq_length": 64,
                              "save_steps": 1000}},
        "finetune_sets": {"marco_doc": None, "marco": {"seeds": [1]}},  # one seed here: the smoke tests run two
        "selection": {"cl": {"max_steps": 2, "candidates": [{"temperature": 1.0}, {"temperature": 0.05}],
                             "held_aside": {"max_queries": 4, "max_docs": 30}}},
        "eval_sets": {"marco_doc_dev": None, "dl19_doc": None, "vaswani": None, "cranfield": None},
        "evaluation": {"doc_max_length": 64, "batch_size": 16, "num_results": 50},
        "tables": {"table3": {"sizes": [4], "seeds": [1]}, "table4": {"num_texts": 2, "frequent_from_docs": 5, "top_frequent": 10},
                   "coverage": {"num_texts": 2}},
    }
    (root / "overrides.json").write_text(json.dumps(overrides))
    return root


@pytest.mark.slow
def test_paper_config_runs_with_tiny_stand_ins(tmp_path, tiny_bert_dir):
    """The paper config, unchanged but for the stand-ins overlay, through the same code path (its stage commands,
    irds:msmarco-passage/train with the triples-small BM25 negatives, dev/small and TREC DL 2019; the stages run
    in-process)."""
    stand = _paper_stand_ins(tmp_path / "stand", tiny_bert_dir)
    out = tmp_path / "out"
    run = _run(["--scale", "paper", "--stand-ins", str(stand), "--work-dir", str(tmp_path / "work"), "--out", str(out)])
    assert run.returncode == 0, run.stderr[-4000:]
    # the stage commands the run logged as it started each stage (those a dry run prints): no base stage (the paper
    # scale starts from the model itself), the continuations from the stand-in model and corpus, the fine-tunings
    # on the triples-small BM25 negatives
    records = {json.loads(p.read_text())["stage"] for p in (tmp_path / "work" / "stages").glob("*.json")}
    assert "base" not in records and "continue:cpdae" in records
    assert not [line for line in run.stdout.splitlines() if line.startswith("[base]")]
    # (the paper configs pin the [CLS] vector: --representation cls between the model and the corpus)
    assert f"--model {tiny_bert_dir} --representation cls --corpus {stand / 'wiki.txt'}" in run.stdout
    assert "--negatives file:irds:msmarco-passage/train/triples-small" in run.stdout
    t1 = pd.read_csv(out / "table1.csv")
    assert list(t1[t1["block"] == "zero-shot"]["model"]) == TABLE1_ROWS
    ok = set(t1[(t1["block"] == "fine-tuned") & (t1["status"] == "ok")]["model"])
    assert ok == {"BM25", "BERT", "MLM", "ICT", "SEED", "CPDAE"}     # the dropped objectives read "not run"
    assert {"MARCO Dev MRR@10", "MARCO Dev R@1000", "DL19 passage nDCG@10"} <= set(t1.columns)
    t3 = pd.read_csv(out / "table3.csv")
    assert list(t3["runs"]) == [1] * 3
