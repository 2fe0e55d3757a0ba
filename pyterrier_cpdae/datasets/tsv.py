"""``tsv:<folder>``: plain tab-separated files with TREC qrels, the layout of MS MARCO's own files.

* ``corpus.tsv`` (or ``collection.tsv``): ``docno<TAB>text``, or ``docno<TAB>title<TAB>text``; every line has the
  first line's number of columns;
* ``queries.tsv`` (or ``topics.tsv``): ``qid<TAB>query``;
* one file named ``qrels*`` (e.g. ``qrels.txt``): TREC qrels, ``qid iter docno label`` split on whitespace.

Each may be compressed (``.gz``, ``.bz2``, ``.xz``, ``.lzma``: :func:`pyterrier_cpdae._files.open_text`). A first line
that names the columns (``docno<TAB>text``, ``docno<TAB>title<TAB>text``, ``qid<TAB>query``; also ``id``, ``_id``,
``docid``, ``doc_id``, ``pid`` / ``query_id``, ``query-id`` and ``text``) is a header and skipped. There is no quoting:
a field holds no tab and no line break. Blank lines are skipped. The topics are every query of the file; each judged
query must have one.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional

import pandas as pd

from pyterrier_cpdae._files import COMPRESSED_SUFFIXES, read_lines
from pyterrier_cpdae.datasets.base import LocalDataset, spec_folder
from pyterrier_cpdae.datasets.records import _id, _no_records, _text, _unique_topics
from pyterrier_cpdae.datasets.trec import read_trec_qrels

__all__ = ["open_tsv", "corpus_path", "KINDS"]

#: accepted names of each file, before an optional compression suffix
CORPUS_NAMES = ("corpus.tsv", "collection.tsv")
QUERIES_NAMES = ("queries.tsv", "topics.tsv")
_COMPRESSED = ("",) + COMPRESSED_SUFFIXES
_DOC_ID_HEADERS = {"docno", "docid", "doc_id", "id", "_id", "pid"}
_QUERY_ID_HEADERS = {"qid", "query_id", "query-id", "id", "_id"}


def _fields(line: str) -> list[str]:
    return line.rstrip("\r\n").split("\t")


def _is_header(cols: list[str], ids: set[str], rest: tuple[tuple[str, ...], ...]) -> bool:
    names = [c.strip().lower() for c in cols]
    return names[0] in ids and tuple(names[1:]) in rest


def read_tsv_docs(path: Path) -> Iterator[dict]:
    """``{"docno", "text"}`` (and ``"title"``, then ``text`` starts with it, as BEIR's reader gives) per line."""
    width: Optional[int] = None
    n = 0
    for line_no, line in read_lines(path):
        if not line.strip():
            continue
        cols = _fields(line)
        where = f"{path}:{line_no}"
        if width is None:
            if len(cols) not in (2, 3):
                raise ValueError(f"{where}: expected 2 tab-separated columns (docno, text) or 3 (docno, title, text), "
                                 f"got {len(cols)}")
            width = len(cols)
            if _is_header(cols, _DOC_ID_HEADERS, (("text",), ("title", "text"))):
                continue
        elif len(cols) != width:
            names = "docno, text" if width == 2 else "docno, title, text"
            raise ValueError(f"{where}: expected {width} tab-separated columns ({names}) as on the first line, got "
                             f"{len(cols)} (a field holds no tab)")
        docno = _id(cols[0], "docno", where)
        body = _text(cols[-1], "the text", where)
        if width == 3:
            title = _text(cols[1], "the title", where)
            yield {"docno": docno, "text": f"{title} {body}".strip(), "title": title}
        else:
            yield {"docno": docno, "text": body}
        n += 1
    if not n:
        raise _no_records(path, "documents")


def read_tsv_topics(path: Path, qrels: Path) -> pd.DataFrame:
    """``qid, query`` of every line of ``path``; a query that ``qrels`` judges and ``path`` lacks is refused."""
    rows: list[tuple[str, str]] = []
    wheres: list[str] = []
    for line_no, line in read_lines(path):
        if not line.strip():
            continue
        cols = _fields(line)
        where = f"{path}:{line_no}"
        if len(cols) != 2:
            raise ValueError(f"{where}: expected 2 tab-separated columns (qid, query), got {len(cols)} "
                             "(a field holds no tab)")
        if not rows and _is_header(cols, _QUERY_ID_HEADERS, (("query",), ("text",))):
            continue
        rows.append((_id(cols[0], "qid", where), _text(cols[1], "the query", where)))
        wheres.append(where)
    if not rows:
        raise _no_records(path, "queries")
    topics = _unique_topics(rows, wheres.__getitem__)
    found = set(topics["qid"])
    missing = [qid for qid in dict.fromkeys(read_trec_qrels(qrels)["qid"]) if qid not in found]
    if missing:
        raise ValueError(f"{path}: {len(missing)} queries judged in {qrels} are missing, e.g. {missing[:5]}; every "
                         "judged query needs a line qid<TAB>query")
    return topics


def _one(folder: Path, spec: str, what: str, names: tuple[str, ...]) -> Path:
    wanted = {name + suffix for name in names for suffix in _COMPRESSED}
    found = sorted(p for p in folder.iterdir() if p.is_file() and p.name.lower() in wanted)
    if not found:
        raise FileNotFoundError(f"{spec}: no {what} file in {folder} (expected {' or '.join(names)}, possibly "
                                "compressed)")
    if len(found) > 1:
        raise ValueError(f"{spec}: several {what} files in {folder}: {[p.name for p in found]}; keep one")
    return found[0]


def corpus_path(folder: Path, spec: str) -> Path:
    """The one corpus file of the collection in ``folder`` (``corpus.tsv`` or ``collection.tsv``, maybe compressed)."""
    return _one(folder, spec, "corpus", CORPUS_NAMES)


def open_tsv(folder: Path, spec: str) -> LocalDataset:
    """The tab-separated collection in ``folder`` (see the module docstring for its files)."""
    corpus = corpus_path(folder, spec)
    queries = _one(folder, spec, "queries", QUERIES_NAMES)
    qrels = sorted(p for p in folder.iterdir() if p.is_file() and p.name.lower().startswith("qrels"))
    if not qrels:
        raise FileNotFoundError(f"{spec}: no qrels file in {folder} (expected one file named qrels*, TREC format: "
                                "qid iter docno label)")
    if len(qrels) > 1:
        raise ValueError(f"{spec}: several qrels files in {folder}: {[p.name for p in qrels]}; keep one")
    return LocalDataset(spec, lambda: read_tsv_docs(corpus), lambda: read_tsv_topics(queries, qrels[0]),
                        lambda: read_trec_qrels(qrels[0]))


#: spec kind -> (its form, the function that opens ``<kind>:<rest>``)
KINDS = {"tsv": ("tsv:<folder>", lambda rest, spec: open_tsv(spec_folder(rest, spec), spec))}
