"""What every dataset reader shares: checked ids, texts and relevance labels, topics and qrels frames with each
query and judgement once, the line-by-line qrels reader and a file looked up by name; every error starts with
``<file>:<line>:`` (or ``<file>:`` where no line applies) and says what is wrong."""
from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import pandas as pd

from pyterrier_cpdae._checks import as_docno
from pyterrier_cpdae._files import read_lines, short_repr

_TOPICS_COLUMNS = ["qid", "query"]
_QRELS_COLUMNS = ["qid", "docno", "label"]


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


def _find_file(folder: Path, name: str, spec: str) -> Path:
    exact = folder / name
    if exact.is_file():
        return exact
    for p in folder.iterdir():  # case-insensitive, optional .txt suffix (e.g. cranqrel.txt)
        if p.is_file() and p.name.lower() in (name.lower(), name.lower() + ".txt"):
            return p
    raise FileNotFoundError(f"{spec}: {name} is missing in {folder}")
