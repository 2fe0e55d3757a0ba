"""The smoke scale's collections: tiny synthetic stand-ins for every collection of the paper pipeline, in the layout
of ``../shared/data`` (``experiments/smoke_data/``, shipped with the project).

The smoke scale proves the pipeline end to end (every stage, every objective, every table) where the real data is
absent, e.g. in a fresh clone, so it reads only these files: an enwiki-sample in WikiExtractor's layout, the MS MARCO
sample and TREC DL 2019's judged pool in ir_datasets' cache layout, SciFact in BEIR's, Vaswani in TREC's, Cranfield
in SMART's (with its quirk: queries numbered by position in the qrels), and the query splits the configs name. The
texts are random sentences over a few topics of English words (on the bert-base-uncased vocabulary), each query a
few words of its relevant documents, so BM25 and the encoders find something; the numbers mean nothing.

The files are made by this module from a fixed seed; ``tests/experiments/paper/test_smoke_data.py`` checks that the shipped
files are exactly what it makes. To make them again (after changing this module)::

    python -m experiments.paper.smoke_data            # writes experiments/smoke_data/
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path
from typing import Optional

from .config import ROOT

OUT = ROOT / "experiments" / "smoke_data"
SEED = 0

TOPICS = {
    "astronomy": "star planet orbit moon telescope galaxy solar light comet gravity space earth sky mass",
    "medicine": "patient doctor disease heart blood cancer treatment hospital drug brain cell virus health pain",
    "music": "piano violin song band guitar concert album singer orchestra rhythm melody jazz opera sound",
    "cooking": "bread butter flour sugar oven salt cheese soup recipe meat garlic onion rice kitchen",
    "football": "goal team player match league coach ball season club stadium score cup referee fans",
    "aircraft": "wing flight pilot engine airport lift speed jet aircraft wind pressure altitude landing fuel",
    "ocean": "sea fish whale coral island coast wave ship water tide beach salt harbor storm",
    "computing": "computer software data memory program network code internet user file system chip digital server",
    "history": "king war empire army castle battle century queen church revolution kingdom treaty emperor city",
    "farming": "farm cattle wheat crop soil horse field harvest corn sheep grain tractor seed barn",
    "physics": "energy electron atom quantum particle force field magnetic wave heat temperature laser nuclear charge",
    "geography": "river mountain valley desert lake forest bridge town road island border climate rain snow",
}
FILLER = "the of and in a to is was for on with as by at from that which it are".split()


class Writer:
    """Texts of the collections: each document is about one topic (mostly its words, some filler)."""

    def __init__(self, seed: int = SEED):
        self.rng = random.Random(seed)
        self.topics = {t: ws.split() for t, ws in TOPICS.items()}
        self.names = sorted(self.topics)

    def topic(self) -> str:
        return self.rng.choice(self.names)

    def sentence(self, topic: str, n: int) -> str:
        words = [self.rng.choice(self.topics[topic]) if self.rng.random() < 0.65 else self.rng.choice(FILLER)
                 for _ in range(n)]
        return " ".join(words).capitalize() + "."

    def text(self, topic: str, sentences: int) -> str:
        return " ".join(self.sentence(topic, self.rng.randint(7, 12)) for _ in range(sentences))

    def query(self, doc: str, topic: str) -> str:
        """A few of the topic's words that the document holds."""
        own = sorted({w.strip(".").lower() for w in doc.split()} & set(self.topics[topic])) or self.topics[topic][:3]
        return " ".join(self.rng.sample(own, min(len(own), self.rng.randint(2, 4))))

    def collection(self, n: int, sentences: int = 3) -> list[tuple[str, str]]:
        """``n`` (topic, text) documents."""
        out = []
        for _ in range(n):
            t = self.topic()
            out.append((t, self.text(t, sentences)))
        return out

    def ids(self, n: int, low: int, high: int) -> list[int]:
        return sorted(self.rng.sample(range(low, high), n))


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _split(qids: list[str], seed: int, first: str, second: str, first_fraction: float) -> dict[str, list[str]]:
    """The method of the real splits: a seeded shuffle of the sorted ids; the first part comes first."""
    ids = sorted(qids, key=lambda q: (len(q), q))
    shuffled = ids[:]
    random.Random(seed).shuffle(shuffled)
    n = int(len(ids) * first_fraction)
    return {first: sorted(shuffled[:n], key=int), second: sorted(shuffled[n:], key=int)}


def enwiki(w: Writer, out: Path, n: int = 48) -> None:
    """WikiExtractor output (``AA/wiki_00``, not compressed): ``n`` articles of a few paragraphs."""
    docs = []
    for i, (t, _) in enumerate(w.collection(n), start=1):
        title = " ".join(x.capitalize() for x in w.rng.sample(w.topics[t], 2))
        paragraphs = "\n".join(w.text(t, w.rng.randint(3, 5)) for _ in range(3))
        docs.append(f'<doc id="{i}" url="https://en.wikipedia.org/wiki?curid={i}" title="{title}">\n{title}\n\n'
                    f"{paragraphs}\n</doc>\n")
    _write(out / "enwiki-sample" / "AA" / "wiki_00", "".join(docs))


def msmarco_sample(w: Writer, out: Path, n_docs: int = 160, n_queries: int = 40) -> None:
    """MS MARCO passage dev/small in ir_datasets' cache layout, and its query split (halves, seed 0)."""
    base = out / "msmarco-dev-sample" / "irds" / "msmarco-passage"
    docs = w.collection(n_docs, 2)
    docnos = w.ids(n_docs, 1000, 9_000_000)
    _write(base / "irds_version.txt", "v2")  # exactly, or ir_datasets' migrator deletes collection.tsv
    _write(base / "collection.tsv", "".join(f"{d}\t{text}\n" for d, (_, text) in zip(docnos, docs)))
    qids = w.ids(n_queries, 1000, 1_200_000)
    positives = w.rng.sample(range(n_docs), n_queries)
    _write(base / "dev" / "small" / "queries.tsv",
           "".join(f"{q}\t{w.query(docs[p][1], docs[p][0])}\n" for q, p in zip(qids, positives)))
    _write(base / "dev" / "small" / "qrels", "".join(f"{q} 0 {docnos[p]} 1\n" for q, p in zip(qids, positives)))
    split = _split([str(q) for q in qids], 0, "train", "eval", 0.5)
    record = {"dataset": "irds:msmarco-passage/dev/small", "seed": 0, "num_queries": n_queries,
              "method": "random.Random(seed).shuffle of the sorted qids with a label>0 qrel; first half = train",
              "num_train": len(split["train"]), "num_eval": len(split["eval"]), **split}
    _write(out / "msmarco_sample_split.json", json.dumps(record, indent=1) + "\n")


def dl19_judged(w: Writer, out: Path, n_docs: int = 80, n_queries: int = 6, judged: int = 8) -> None:
    """TREC DL 2019 passage's judged pool in ir_datasets' cache layout: graded labels 0-3, each query with a 2 or 3."""
    base = out / "msmarco-dl19-judged" / "irds" / "msmarco-passage"
    docs = w.collection(n_docs, 2)
    docnos = w.ids(n_docs, 1000, 9_000_000)
    _write(base / "irds_version.txt", "v2")
    _write(base / "collection.tsv", "".join(f"{d}\t{text}\n" for d, (_, text) in zip(docnos, docs)))
    qids = w.ids(n_queries, 1000, 1_200_000)
    queries, qrels = [], []
    for q in qids:
        pool = w.rng.sample(range(n_docs), judged)
        best = pool[0]
        queries.append(f"{q}\t{w.query(docs[best][1], docs[best][0])}\n")
        labels = [w.rng.choice([2, 3])] + [w.rng.choice([0, 0, 1, 2]) for _ in pool[1:]]
        qrels += [f"{q} Q0 {docnos[d]} {label}\n" for d, label in sorted(zip(pool, labels))]
    _write(base / "trec-dl-2019" / "queries.tsv", "".join(queries))
    _write(base / "trec-dl-2019" / "qrels", "".join(qrels))


def scifact(w: Writer, out: Path, n_docs: int = 80, n_queries: int = 24) -> None:
    """BEIR SciFact (train qrels only) and its train/dev split (a fifth dev, seed 0)."""
    base = out / "scifact"
    docs = w.collection(n_docs, 3)
    ids = w.ids(n_docs, 1000, 50_000_000)
    rows = []
    for d, (t, text) in zip(ids, docs):
        title = w.sentence(t, 6).rstrip(".")
        rows.append(json.dumps({"_id": str(d), "title": title, "text": text}) + "\n")
    _write(base / "corpus.jsonl", "".join(rows))
    qids = w.ids(n_queries, 0, 1400)
    positives = w.rng.sample(range(n_docs), n_queries)
    _write(base / "queries.jsonl", "".join(json.dumps({"_id": str(q), "text": w.query(docs[p][1], docs[p][0]) + ".",
                                                       "metadata": {}}) + "\n" for q, p in zip(qids, positives)))
    _write(base / "qrels" / "train.tsv", "query-id\tcorpus-id\tscore\n" +
           "".join(f"{q}\t{ids[p]}\t1\n" for q, p in zip(qids, positives)))
    split = _split([str(q) for q in qids], 0, "dev", "train", 0.2)
    record = {"seed": 0, "dev_fraction": 0.2,
              "method": "random.Random(seed).shuffle of the sorted qids with a label>0 qrel; first 20% = dev",
              "num_train": len(split["train"]), "num_dev": len(split["dev"]), "train": split["train"],
              "dev": split["dev"]}
    _write(out / "scifact_split.json", json.dumps(record, indent=1) + "\n")


def vaswani(w: Writer, out: Path, n_docs: int = 80, n_queries: int = 10) -> None:
    """Vaswani in the TREC layout: ``corpus/doc-text.trec``, ``query-text.trec``, ``qrels`` (binary)."""
    base = out / "vaswani"
    docs = w.collection(n_docs, 2)
    _write(base / "corpus" / "doc-text.trec", "".join(f"<DOC>\n<DOCNO>{i}</DOCNO>\n{text.lower()}\n</DOC>\n"
                                                       for i, (_, text) in enumerate(docs, start=1)))
    topics, qrels = [], []
    for q in range(1, n_queries + 1):
        rel = w.rng.sample(range(n_docs), 2)
        topics.append(f"<top>\n<num>{q}</num><title>\n{w.query(docs[rel[0]][1], docs[rel[0]][0]).upper()}\n"
                      "</title>\n</top>\n")
        qrels += [f"{q} 0 {d + 1} 1\n" for d in sorted(rel)]
    _write(base / "query-text.trec", "".join(topics))
    _write(base / "qrels", "".join(qrels))


def cranfield(w: Writer, out: Path, n_docs: int = 80, n_queries: int = 10) -> None:
    """Cranfield in the SMART format; as in the real files, the queries' ``.I`` numbers are not 1..n and the qrels
    number the queries by position; relevance codes 1 (best) .. 4 and -1."""
    base = out / "cranfield"
    docs = w.collection(n_docs, 3)
    recs = []
    for i, (t, text) in enumerate(docs, start=1):
        title = w.sentence(t, 6).rstrip(".").lower() + " ."
        recs.append(f".I {i}\n.T\n{title}\n.A\nauthor,a.\n.B\nj. ae. scs. {i}, 1958.\n.W\n{title}\n  "
                    f"{text.lower()}\n")
    _write(base / "cran.all.1400", "".join(recs))
    numbers = w.ids(n_queries, 1, 400)
    queries, qrels = [], []
    for position, number in enumerate(numbers, start=1):
        rel = w.rng.sample(range(n_docs), 3)
        queries.append(f".I {number:03d}\n.W\n{w.query(docs[rel[0]][1], docs[rel[0]][0])} .\n")
        codes = [w.rng.choice([1, 2])] + [w.rng.choice([2, 3, 4, -1]) for _ in rel[1:]]
        qrels += [f"{position} {d + 1} {c} \n" for d, c in sorted(zip(rel, codes))]
    _write(base / "cran.qry", "".join(queries))
    _write(base / "cranqrel", "".join(qrels))


README = """# The smoke scale's collections

Tiny synthetic stand-ins for the collections of `../shared/data`, in the same layouts, made by
`python -m experiments.paper.smoke_data` (a fixed seed: the same bytes each time). The smoke scale
(`experiments/configs/paper_smoke.json`) reads only these, so it runs in a fresh clone without the real data.
Random sentences over a few topics of English words; the figures they give mean nothing.
"""


def make(out: Path = OUT, seed: int = SEED) -> Path:
    """Write every collection under ``out`` (replacing it)."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    w = Writer(seed)
    for part in (enwiki, msmarco_sample, dl19_judged, scifact, vaswani, cranfield):
        part(w, tmp)
    _write(tmp / "README.md", README)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT, help="where to write (default: experiments/smoke_data)")
    a = ap.parse_args(argv)
    print(f"wrote {make(a.out)}")


if __name__ == "__main__":
    main()
