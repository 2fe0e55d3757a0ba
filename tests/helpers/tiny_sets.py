"""Tiny BEIR folders and training groups shared by the paper pipeline's and the exports' tests (tests/experiments/paper/test_pipeline_bm25_precomputed.py,
tests/experiments/paper/test_stages_reliability.py)."""
from __future__ import annotations

import json
from pathlib import Path

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa"]


def tiny_beir(root: Path, docs: int = 40, queries: int = 6, extra: str = "") -> Path:
    """``docs`` passages of words from :data:`WORDS`, ``queries`` training queries with one judged passage each;
    ``extra`` is appended to every third passage (from the second), to edit a collection so that BM25 ranks it
    otherwise."""
    (root / "qrels").mkdir(parents=True, exist_ok=True)
    with open(root / "corpus.jsonl", "w") as f:
        for i in range(docs):
            text = " ".join(WORDS[(i * k) % len(WORDS)] for k in range(1, 6)) + f" doc{i}" + (extra * (i % 3 == 1))
            f.write(json.dumps({"_id": f"d{i}", "title": "", "text": text}) + "\n")
    with open(root / "queries.jsonl", "w") as f:
        for q in range(queries):
            f.write(json.dumps({"_id": f"q{q}", "text": f"{WORDS[q]} {WORDS[q + 1]} doc{q * 3}"}) + "\n")
    with open(root / "qrels" / "train.tsv", "w") as f:
        f.write("query-id\tcorpus-id\tscore\n")
        for q in range(queries):
            f.write(f"q{q}\td{q * 3}\t1\n")
    return root


def photon_beir(root: Path) -> Path:
    """Three passages (physics, Rome, a photon's energy) and one training query, "photon energy", judging the third."""
    (root / "qrels").mkdir(parents=True)
    with open(root / "corpus.jsonl", "w") as f:
        for i, t in enumerate(["particle physics in a magnetic field", "the history of rome", "energy of a photon"]):
            f.write(json.dumps({"_id": f"d{i}", "title": "", "text": t}) + "\n")
    (root / "queries.jsonl").write_text(json.dumps({"_id": "q0", "text": "photon energy"}) + "\n")
    (root / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq0\td2\t1\n")
    return root


#: fifteen unrelated topic words: the fine-tuning groups' queries and passages
TOPIC_WORDS = "paris france capital river bridge music piano ocean whale coral desert camel sand physics energy".split()


def topic_groups(path: Path) -> str:
    """A training-groups file of four queries (``<word> question``), each with its passage and three negatives; returns
    its ``groups:`` spec."""
    with open(path, "w") as f:
        for i in range(4):
            f.write(json.dumps({"qid": f"q{i}", "query": f"{TOPIC_WORDS[i]} question",
                                "pos": [{"text": f"{TOPIC_WORDS[i]} answer"}],
                                "negs": [{"text": f"{w} other"} for w in TOPIC_WORDS[10:13]]}) + "\n")
    return f"groups:{path}"
