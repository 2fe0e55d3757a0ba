"""Tiny collections in the layouts ``load_dataset`` reads, shared by the tests: a BEIR folder and a TREC folder
written from their texts or records (:func:`write_beir`, :func:`write_trec`), ir_datasets' MS MARCO passage cache
read offline in a fresh process (:func:`offline_msmarco`), the paper pipeline's and the exports' BEIR sets
(:func:`tiny_beir`, :func:`photon_beir`) and training groups (:func:`topic_groups`)."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterable, Union

REPO = Path(__file__).resolve().parents[2]

#: the first line of a BEIR qrels file
BEIR_QRELS_HEADER = "query-id\tcorpus-id\tscore\n"


def _jsonl(records: Union[str, Iterable[dict]]) -> str:
    return records if isinstance(records, str) else "".join(json.dumps(r) + "\n" for r in records)


def write_beir(root: Path, corpus: Union[str, Iterable[dict]], queries: Union[str, Iterable[dict]],
               qrels: Union[str, Iterable[tuple]], split: str = "test") -> Path:
    """A BEIR folder at ``root`` (made): ``corpus.jsonl`` and ``queries.jsonl`` (each the file's text, or its records,
    one JSON object a line) and ``qrels/<split>.tsv`` (its text, or ``(query, doc, score)`` rows under
    :data:`BEIR_QRELS_HEADER`); returns ``root``."""
    (root / "qrels").mkdir(parents=True, exist_ok=True)
    (root / "corpus.jsonl").write_text(_jsonl(corpus), encoding="utf-8")
    (root / "queries.jsonl").write_text(_jsonl(queries), encoding="utf-8")
    if not isinstance(qrels, str):
        qrels = BEIR_QRELS_HEADER + "".join(f"{q}\t{d}\t{score}\n" for q, d, score in qrels)
    (root / "qrels" / f"{split}.tsv").write_text(qrels, encoding="utf-8")
    return root


def write_trec(folder: Path, docs: str, topics: str, qrels: str) -> Path:
    """A TREC folder: ``docs.trec`` (``<DOC>`` records), ``topics.trec`` (``<top>`` records) and ``qrels``, from
    their texts; returns ``folder``."""
    (folder / "docs.trec").write_text(docs, encoding="utf-8")
    (folder / "topics.trec").write_text(topics, encoding="utf-8")
    (folder / "qrels").write_text(qrels, encoding="utf-8")
    return folder


def random_word_docs(n: int = 3000) -> list[dict]:
    """``n`` documents of 200 random seven-letter words each (seeded; 3,000 make about 5 MB of text)."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij") for _ in range(7)) for _ in range(5000)]
    return [{"docno": f"d{i}", "text": " ".join(rng.choice(words) for _ in range(200))} for i in range(n)]


#: the passages of :func:`offline_msmarco`'s collection, by docno
MSMARCO_PASSAGES = {"0": "The capital of France is Paris.", "1": "Bananas are yellow.", "2": "Pandas."}


def offline_msmarco(home: Path, queries: str, qrels: str, code: str, timeout: float) -> dict:
    """Runs ``code`` (Python, dedented) in a fresh interpreter whose ir_datasets home is ``home``, holding
    ``msmarco-passage`` (:data:`MSMARCO_PASSAGES`, and ``dev/small``'s ``queries`` and ``qrels`` texts) as
    ir_datasets leaves it after a download, with every network connection refused; returns the JSON object that
    ``code`` prints last."""
    base = home / "msmarco-passage"
    (base / "dev" / "small").mkdir(parents=True)
    (base / "irds_version.txt").write_text("v2")  # exactly, or the migrator deletes collection.tsv
    (base / "collection.tsv").write_text("".join(f"{d}\t{t}\n" for d, t in MSMARCO_PASSAGES.items()))
    (base / "dev" / "small" / "queries.tsv").write_text(queries)
    (base / "dev" / "small" / "qrels").write_text(qrels)
    guard = """
        import socket
        def no_network(*args, **kwargs):
            raise RuntimeError("network access attempted")
        socket.socket.connect = no_network
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(guard) + textwrap.dedent(code)], cwd=REPO,
                         capture_output=True, text=True, env={**os.environ, "IR_DATASETS_HOME": str(home)},
                         timeout=timeout)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa"]


def tiny_beir(root: Path, docs: int = 40, queries: int = 6, extra: str = "") -> Path:
    """``docs`` passages of words from :data:`WORDS`, ``queries`` training queries with one judged passage each;
    ``extra`` is appended to every third passage (from the second), to edit a collection so that BM25 ranks it
    otherwise."""
    return write_beir(
        root,
        [{"_id": f"d{i}", "title": "",
          "text": " ".join(WORDS[(i * k) % len(WORDS)] for k in range(1, 6)) + f" doc{i}" + (extra * (i % 3 == 1))}
         for i in range(docs)],
        [{"_id": f"q{q}", "text": f"{WORDS[q]} {WORDS[q + 1]} doc{q * 3}"} for q in range(queries)],
        [(f"q{q}", f"d{q * 3}", 1) for q in range(queries)], split="train")


def photon_beir(root: Path) -> Path:
    """Three passages (physics, Rome, a photon's energy) and one training query, "photon energy", judging the third."""
    texts = ["particle physics in a magnetic field", "the history of rome", "energy of a photon"]
    return write_beir(root, [{"_id": f"d{i}", "title": "", "text": t} for i, t in enumerate(texts)],
                      [{"_id": "q0", "text": "photon energy"}], [("q0", "d2", 1)], split="train")


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
