"""``beir:<folder>[:split]``: the BEIR layout: ``corpus.jsonl``, ``queries.jsonl``, ``qrels/<split>.tsv`` (default
split ``test``). A qrels file is tab-separated ``query-id corpus-id score``; its first line is the header
``query-id\tcorpus-id\tscore`` in the files BEIR distributes, skipped when there, and a file without it is read
from its first line. The topics are the queries the split judges."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pandas as pd

from pyterrier_cpdae._files import read_jsonl
from pyterrier_cpdae.datasets.base import LocalDataset, spec_folder
from pyterrier_cpdae.datasets.records import _columns, _id, _label, _no_records, _read_qrels, _text, _unique_topics

__all__ = ["open_beir", "beir_files", "KINDS"]


def _json_field(obj: dict, key: str, where: str, is_id: bool = False, nullable: bool = False) -> str:
    """A required string field of a BEIR line (an id may also be an int; ``null`` is ``""`` where
    ``nullable``); checked by :func:`_text`."""
    if key not in obj:
        raise ValueError(f"{where}: no {key!r} field (BEIR lines need '_id' and 'text'); fields present: {list(obj)}")
    value = obj[key]
    if is_id:
        return _id(value, repr(key), where)
    return "" if value is None and nullable else _text(value, repr(key), where)


def _beir_docs(path: Path) -> Iterator[dict]:
    n = 0
    for where, doc in read_jsonl(path):
        docno, text = _json_field(doc, "_id", where, is_id=True), _json_field(doc, "text", where, nullable=True)
        title = _text(doc.get("title") or "", "'title'", where)
        n += 1
        yield {"docno": docno, "text": f"{title} {text}".strip(), "title": title}
    if not n:
        raise _no_records(path, "documents")


def _beir_qrel(cols: list[str]) -> tuple[str, str, int]:
    qid, docno, score = _columns(cols, 3, "query-id corpus-id score, tab-separated")
    if not qid or not docno:
        raise ValueError("empty query-id or corpus-id")
    return qid, docno, _label(score)


def _beir_qrels(path: Path) -> pd.DataFrame:
    return _read_qrels(path, _beir_qrel, sep="\t", header="query-id")


def _beir_topics(queries: Path, qrels: Path) -> pd.DataFrame:
    judged = dict.fromkeys(_beir_qrels(qrels)["qid"])
    rows, wheres = [], []
    for where, q in read_jsonl(queries):
        rows.append((_json_field(q, "_id", where, is_id=True), _json_field(q, "text", where)))
        wheres.append(where)
    if not rows:
        raise _no_records(queries, "queries")
    topics = _unique_topics(rows, wheres.__getitem__)  # every line checked, judged or not
    found = set(topics["qid"])
    missing = [qid for qid in judged if qid not in found]
    if missing:
        raise ValueError(f"{queries}: {len(missing)} queries judged in {qrels} are missing, e.g. {missing[:5]}; "
                         "every judged query needs a line in queries.jsonl")
    return topics[topics["qid"].isin(list(judged))].reset_index(drop=True)


def beir_files(name: str, corpus: Path, queries: Path, qrels: Path) -> LocalDataset:
    """A dataset of the three BEIR files (the built-in sample has them side by side)."""
    return LocalDataset(name, lambda: _beir_docs(corpus), lambda: _beir_topics(queries, qrels),
                        lambda: _beir_qrels(qrels))


def open_beir(folder: Path, split: str) -> LocalDataset:
    corpus, queries, qrels_dir = folder / "corpus.jsonl", folder / "queries.jsonl", folder / "qrels"
    for p in (corpus, queries, qrels_dir):
        if not p.exists():
            raise FileNotFoundError(f"beir:{folder}: {p.name} is missing (BEIR layout: corpus.jsonl, queries.jsonl, "
                                    "qrels/<split>.tsv)")
    qrels = qrels_dir / f"{split}.tsv"
    if not qrels.is_file():
        available = sorted(p.stem for p in qrels_dir.glob("*.tsv"))
        raise FileNotFoundError(f"beir:{folder}: no qrels for split {split!r}; available splits: {available} "
                                f"(choose one with beir:{folder}:<split>)")
    return beir_files(f"beir:{folder}:{split}", corpus, queries, qrels)


def _open(rest: str, spec: str) -> LocalDataset:
    folder, split = rest, "test"
    if not Path(rest).is_dir() and ":" in rest:
        folder, split = rest.rsplit(":", 1)
    return open_beir(spec_folder(folder, spec), split)


#: spec kind -> (its form, the function that opens ``<kind>:<rest>``)
KINDS = {"beir": ("beir:<folder>[:split]", _open)}
