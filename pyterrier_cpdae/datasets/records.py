"""Parsers of the local test-collection layouts that :func:`pyterrier_cpdae.datasets.load_dataset` reads: TREC
(``<DOC>`` files, ``<top>`` topics, qrels), BEIR (``corpus.jsonl``, ``queries.jsonl``, ``qrels/<split>.tsv``) and
the Glasgow/SMART files (Cranfield, CISI, Medline; :data:`SMART_LAYOUTS`)."""
from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pandas as pd

from pyterrier_cpdae._checks import as_docno
from pyterrier_cpdae._files import read_jsonl, read_lines, read_text, short_repr

__all__ = ["SmartLayout", "SMART_LAYOUTS"]

_TOPICS_COLUMNS = ["qid", "query"]
_QRELS_COLUMNS = ["qid", "docno", "label"]


# --------------------------------------------------------------------------- helpers
#
# Every parser below yields exactly what its file holds or raises a ValueError that starts with
# ``<file>:<line>:`` (or ``<file>:`` where no line applies) and says what is wrong.

def _topics_frame(rows: list[tuple[str, str]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=_TOPICS_COLUMNS).astype({"qid": str, "query": str})


def _qrels_frame(rows: list[tuple[str, str, int]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=_QRELS_COLUMNS).astype({"qid": str, "docno": str, "label": "int64"})


def _unique_topics(rows: list[tuple[str, str]], where: Callable[[int], str]) -> pd.DataFrame:
    """The topics ``rows`` (``(qid, query)``, ``where(i)`` naming row ``i``'s file and line) with each qid once.

    A qid given twice with another text is refused (``pt.Experiment`` would merge the two queries' rankings under
    one qid, and the measures would judge the mixture); given twice with the same text it is kept once, with a
    warning naming both places.
    """
    frame = _topics_frame(rows)
    if not frame["qid"].duplicated().any():  # the usual case, vectorised
        return frame
    first: dict[str, int] = {}
    kept: list[tuple[str, str]] = []
    repeats: list[tuple[int, int]] = []
    for i, (qid, query) in enumerate(rows):
        j = first.setdefault(qid, i)
        if j == i:
            kept.append((qid, query))
        elif rows[j][1] != query:
            raise ValueError(f"{where(i)}: query id {qid!r} is given twice, with another text than at {where(j)} "
                             f"({short_repr(rows[j][1])}, here {short_repr(query)}); evaluation would merge the two "
                             "queries' rankings under one id: give each query its own id, or drop one")
        else:
            repeats.append((i, j))
    if repeats:
        i, j = repeats[0]
        warnings.warn(f"{where(i)}: query {rows[i][0]!r} repeats {where(j)} with the same text; it is read once "
                      f"({len(repeats)} such repeated quer{'y' if len(repeats) == 1 else 'ies'} in all)", stacklevel=3)
    return _topics_frame(kept)


def _unique_qrels(rows: list[tuple[str, str, int]], where: Callable[[int], str]) -> pd.DataFrame:
    """The judgements ``rows`` (``(qid, docno, label)``, ``where(i)`` naming row ``i``'s file and line) with each
    ``(qid, docno)`` once.

    A pair judged twice with different labels is refused (which label counts would be up to the evaluation tool); an
    exact repeat (same pair, same label) is kept once, with a warning naming both places.
    """
    frame = _qrels_frame(rows)
    if not frame.duplicated(["qid", "docno"]).any():  # the usual case, vectorised
        return frame
    first: dict[tuple[str, str], int] = {}
    kept: list[tuple[str, str, int]] = []
    repeats: list[tuple[int, int]] = []
    for i, (qid, docno, label) in enumerate(rows):
        j = first.setdefault((qid, docno), i)
        if j == i:
            kept.append((qid, docno, label))
        elif rows[j][2] != label:
            raise ValueError(f"{where(i)}: query {qid!r} judges document {docno!r} twice, with label {label} here and "
                             f"{rows[j][2]} at {where(j)}; keep one judgement per (query, document)")
        else:
            repeats.append((i, j))
    if repeats:
        i, j = repeats[0]
        warnings.warn(f"{where(i)}: the judgement of document {rows[i][1]!r} for query {rows[i][0]!r} repeats "
                      f"{where(j)} (same label); it counts once ({len(repeats)} repeated judgement(s) in all)",
                      stacklevel=3)
    return _qrels_frame(kept)


def _label(text: str) -> int:
    """A relevance label: an integer, also written as an integral float (``2.0``); anything else is refused
    rather than truncated."""
    try:
        label = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value.is_integer()):
            raise ValueError(f"relevance label {short_repr(text)} is not an integer") from None
        label = int(value)
    return _label_range(label, text)


def _label_range(label: int, text: str) -> int:
    """``label`` if it fits the int64 column of the qrels frame (beyond it pandas raises an ``OverflowError`` that
    names no file or line)."""
    if not -2**63 <= label < 2**63:
        raise ValueError(f"relevance label {short_repr(text)} is out of range (labels are 64-bit integers, "
                         "e.g. 0-3)")
    return label


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _text(value: Any, what: str, where: str) -> str:
    """``value`` if it is a str holding real text; lone surrogates (e.g. a JSON ``"\\ud800"``) are refused."""
    if not isinstance(value, str):
        raise ValueError(f"{where}: {what} must be a string, got {type(value).__name__} {value!r}")
    m = None if value.isascii() else _LONE_SURROGATE.search(value)
    if m is not None:
        raise ValueError(f"{where}: {what} holds a lone surrogate {m.group()!r} at character {m.start()}, which is "
                         "not text (a broken \\uD8xx-\\uDFxx escape); fix or drop it in the source")
    return value


_WS = re.compile(r"\s+")
# markup: a start or end tag (``<P>``, ``</TEXT>``, ``<F P=1>``) or a comment; a bare ``<`` is text
_TAG = re.compile(r"</?[A-Za-z][^<>]*>|<!--.*?-->", re.DOTALL)


def _clean(text: str) -> str:
    return _WS.sub(" ", text).strip()


def _id(value: Any, what: str, where: str) -> str:
    """A document or query id, by the indexes' rules (:func:`as_docno`: a non-empty str or int, no line
    break), with no lone surrogate."""
    try:
        docno = as_docno(value)
    except ValueError as e:
        raise ValueError(f"{where}: bad {what}: {e}") from None
    return _text(docno, what, where)


def _line_of(content: str, pos: int) -> int:
    return content.count("\n", 0, pos) + 1


def _no_records(path: Path, what: str) -> ValueError:
    return ValueError(f"{path}: no {what} found (the file is empty or holds none); check the file")


# --------------------------------------------------------------------------- TREC

_DOC_TAG = re.compile(r"<(/?)DOC(?:\s[^<>]*)?>", re.IGNORECASE)
_DOCNO_OPEN = re.compile(r"<DOCNO>", re.IGNORECASE)
_DOCNO = re.compile(r"<DOCNO>\s*(.*?)\s*</DOCNO>", re.IGNORECASE | re.DOTALL)


def _trec_docs(files: list[Path]) -> Iterator[dict]:
    """Stream ``<DOC>`` records: docno from ``<DOCNO>``, text = everything else without tags.

    ``<DOC>`` and ``</DOC>`` may stand anywhere on a line (one document per line works); a
    ``<DOC>`` that is never closed, text outside ``<DOC>…</DOC>``, or a document with no, an empty
    or two ``<DOCNO>`` raise a ValueError naming the file and line.
    """
    for path in files:
        buf: Optional[list[str]] = None
        start = 0
        for line_no, line in read_lines(path):
            pos = 0
            for m in (_DOC_TAG.finditer(line) if "<" in line else ()):
                if buf is not None:
                    buf.append(line[pos:m.start()])
                else:
                    _outside_docs(path, line_no, line[pos:m.start()])
                if not m.group(1):  # <DOC>
                    if buf is not None:
                        raise ValueError(f"{path}:{line_no}: <DOC> opens while the document opened at line {start} "
                                         "has no </DOC>; add the missing </DOC>")
                    buf, start = [], line_no
                else:
                    if buf is None:
                        raise ValueError(f"{path}:{line_no}: </DOC> without <DOC>")
                    yield _trec_doc(path, start, "".join(buf))
                    buf = None
                pos = m.end()
            if buf is not None:
                buf.append(line[pos:])
            else:
                _outside_docs(path, line_no, line[pos:])
        if buf is not None:
            raise ValueError(f"{path}:{start}: <DOC> is never closed: no </DOC> before the end of the file "
                             "(truncated file?)")


def _outside_docs(path: Path, line_no: int, text: str) -> None:
    if text.strip():
        raise ValueError(f"{path}:{line_no}: text outside <DOC>…</DOC>: {text.strip()[:80]!r}")


def _trec_doc(path: Path, line_no: int, raw: str) -> dict:
    opened = len(_DOCNO_OPEN.findall(raw))
    if opened != 1:
        raise ValueError(f"{path}:{line_no}: the document has {opened} <DOCNO> tags; each <DOC> needs exactly one")
    m = _DOCNO.search(raw)
    if m is None:
        raise ValueError(f"{path}:{line_no}: the document's <DOCNO> is not closed by </DOCNO>")
    if not m.group(1):
        raise ValueError(f"{path}:{line_no}: empty <DOCNO>")
    docno = _id(m.group(1), "<DOCNO>", f"{path}:{line_no}")
    return {"docno": docno, "text": _clean(_TAG.sub(" ", raw[:m.start()] + raw[m.end():]))}


_TOP_TAG = re.compile(r"<(/?)top>", re.IGNORECASE)


def _trec_field(block: str, tag: str) -> Optional[str]:
    """Content of ``<tag>`` up to the next tag (old TREC topics leave tags open)."""
    m = re.search(rf"<{tag}>(.*?)(?={_TAG.pattern}|$)", block, re.IGNORECASE | re.DOTALL)
    return None if m is None else _clean(m.group(1))


def _trec_topics(path: Path) -> pd.DataFrame:
    """``<top>`` topics; ``<top>`` must be closed by ``</top>``, with nothing but space between topics."""
    content = read_text(path)
    rows: list[tuple[str, str]] = []
    lines: list[int] = []
    opened: Optional[re.Match] = None
    pos = 0
    for m in _TOP_TAG.finditer(content):
        if opened is None:
            if m.group(1):
                raise ValueError(f"{path}:{_line_of(content, m.start())}: </top> without <top>")
            _outside_topics(path, content, pos, m.start())
            opened = m
        else:
            if not m.group(1):
                raise ValueError(f"{path}:{_line_of(content, opened.start())}: <top> is not closed: the next <top> "
                                 f"(line {_line_of(content, m.start())}) comes before its </top>")
            lines.append(_line_of(content, opened.start()))
            rows.append(_trec_topic(path, lines[-1], content[opened.end():m.start()]))
            opened = None
        pos = m.end()
    if opened is not None:
        raise ValueError(f"{path}:{_line_of(content, opened.start())}: <top> is never closed: no </top> before the "
                         "end of the file (truncated file?)")
    _outside_topics(path, content, pos, len(content))
    if not rows:
        raise ValueError(f"{path}: no <top> topics found")
    return _unique_topics(rows, lambda i: f"{path}:{lines[i]}")


def _outside_topics(path: Path, content: str, start: int, end: int) -> None:
    text = content[start:end]
    if text.strip():
        at = start + len(text) - len(text.lstrip())
        raise ValueError(f"{path}:{_line_of(content, at)}: text outside <top>…</top>: {text.strip()[:80]!r}")


def _trec_topic(path: Path, line_no: int, block: str) -> tuple[str, str]:
    for tag in ("num", "title"):
        n = len(re.findall(rf"<{tag}>", block, re.IGNORECASE))
        if n > 1:
            raise ValueError(f"{path}:{line_no}: the topic has {n} <{tag}> tags; expected one")
    num, title = _trec_field(block, "num"), _trec_field(block, "title")
    if not num or title is None:
        raise ValueError(f"{path}:{line_no}: topic without <num> or <title>: {block[:80]!r}")
    num = re.sub(r"^Number:\s*", "", num, flags=re.IGNORECASE)
    title = re.sub(r"^Topic:\s*", "", title, flags=re.IGNORECASE)
    return num, title


def _read_qrels(path: Path, parse: Callable[[list[str]], tuple[str, str, int]], sep: Optional[str] = None,
                header: Optional[str] = None) -> pd.DataFrame:
    """Judgements, one per non-blank line split on ``sep`` (default: whitespace); a first line whose
    first column is ``header`` is skipped."""
    rows = []
    lines: list[int] = []
    for line_no, line in read_lines(path):
        if not line.strip():
            continue
        cols = line.rstrip("\n").split(sep) if sep else line.split()
        if line_no == 1 and header is not None and cols[0] == header:
            continue
        try:
            rows.append(parse(cols))
        except (ValueError, IndexError) as e:
            raise ValueError(f"{path}:{line_no}: cannot parse qrels line {short_repr(line.rstrip())}: {e}") from None
        lines.append(line_no)
    if not rows:
        raise _no_records(path, "judgements")
    return _unique_qrels(rows, lambda i: f"{path}:{lines[i]}")


def _columns(cols: list[str], n: int, names: str) -> list[str]:
    if len(cols) != n:
        raise ValueError(f"expected {n} columns ({names}), got {len(cols)}")
    return cols


def _trec_qrel(cols: list[str]) -> tuple[str, str, int]:
    qid, _, docno, label = _columns(cols, 4, "qid iter docno label")
    return qid, docno, _label(label)


# --------------------------------------------------------------------------- BEIR

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


# --------------------------------------------------------------------------- Glasgow / SMART

@dataclass(frozen=True)
class SmartLayout:
    """File names and quirks of one collection in the Glasgow SMART format (``.I``/``.T``/``.W``...)."""

    docs: str
    queries: str
    qrels: str
    parse_qrel: Callable[[list[str]], tuple[str, str, int]]
    #: queries are numbered by position (1..n) in the qrels, not by their ``.I`` (Cranfield)
    sequential_qids: bool = False


def _cranfield_qrel(cols: list[str]) -> tuple[str, str, int]:
    # Cleverdon's codes (cranqrel.readme): 1 = complete answer ... 4 = minimum interest, -1 = no interest.
    # Converted to gains where larger is better: 1->4, 2->3, 3->2, 4->1, -1->0.
    qid, docno, code = _columns(cols, 3, "qid docid code")
    code = int(code)
    if code not in (-1, 1, 2, 3, 4):
        raise ValueError(f"unknown Cranfield relevance code {code}")
    return qid, docno, 0 if code == -1 else 5 - code


def _cisi_qrel(cols: list[str]) -> tuple[str, str, int]:
    qid, docno, _, _ = _columns(cols, 4, "qid docno 0 0.000000")
    return qid, docno, 1  # every listed pair is relevant


def _medline_qrel(cols: list[str]) -> tuple[str, str, int]:
    qid, _, docno, label = _columns(cols, 4, "qid 0 docno rel")
    return qid, docno, _label(label)


SMART_LAYOUTS: dict[str, SmartLayout] = {
    "cranfield": SmartLayout("cran.all.1400", "cran.qry", "cranqrel", _cranfield_qrel, sequential_qids=True),
    "cisi": SmartLayout("CISI.ALL", "CISI.QRY", "CISI.REL", _cisi_qrel),
    "medline": SmartLayout("MED.ALL", "MED.QRY", "MED.REL", _medline_qrel),
}

_SMART_FIELD = re.compile(r"^\.([A-Z])\s*$")
_SMART_ID = re.compile(r"^\.I(?:\s+(.*?))?\s*$", re.DOTALL)


def _smart_records(path: Path, what: str) -> Iterator[tuple[int, str, dict[str, str]]]:
    """``(line, id, {field letter: text})`` for each ``.I <id>`` record of a SMART file."""
    rid: Optional[str] = None
    start = 0
    fields: dict[str, list[str]] = {}
    field = None
    for line_no, line in read_lines(path):
        m = _SMART_ID.match(line)
        if m:
            if rid is not None:
                yield start, rid, {k: _clean(" ".join(v)) for k, v in fields.items()}
            rid, start = m.group(1) or "", line_no
            if not rid or len(rid.split()) != 1:
                raise ValueError(f"{path}:{line_no}: a .I line needs exactly one record id, got {line.rstrip()!r}")
            fields, field = {}, None
            continue
        m = _SMART_FIELD.match(line)
        if m:
            field = m.group(1)
            fields.setdefault(field, [])
        elif field is not None:
            fields[field].append(line)
        elif line.strip():
            raise ValueError(f"{path}:{line_no}: text outside a .I record field: {line.rstrip()!r}")
    if rid is None:
        raise _no_records(path, f"{what} (.I records)")
    yield start, rid, {k: _clean(" ".join(v)) for k, v in fields.items()}


def _smart_docs(path: Path) -> Iterator[dict]:
    for _, rid, fields in _smart_records(path, "documents"):
        title, body = fields.get("T", ""), fields.get("W", "")
        yield {"docno": rid.lstrip("0") or "0", "text": f"{title} {body}".strip(), "title": title}


def _smart_topics(path: Path, sequential: bool) -> pd.DataFrame:
    rows, lines = [], []
    for position, (line_no, rid, fields) in enumerate(_smart_records(path, "queries"), 1):
        query = " ".join(x for x in (fields.get("T", ""), fields.get("W", "")) if x)
        rows.append((str(position) if sequential else (rid.lstrip("0") or "0"), query))
        lines.append(line_no)
    return _unique_topics(rows, lambda i: f"{path}:{lines[i]}")


def _find_file(folder: Path, name: str, spec: str) -> Path:
    exact = folder / name
    if exact.is_file():
        return exact
    for p in folder.iterdir():  # case-insensitive, optional .txt suffix (e.g. cranqrel.txt)
        if p.is_file() and p.name.lower() in (name.lower(), name.lower() + ".txt"):
            return p
    raise FileNotFoundError(f"{spec}: {name} is missing in {folder}")
