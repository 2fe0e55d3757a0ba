"""``trec:<folder>``: the TREC layout (e.g. Vaswani): ``<DOC>`` files, a ``<top>`` topics file, a ``qrels*`` file
(``qid iter docno label``). Its qrels reader, :func:`read_trec_qrels`, also serves ``tsv:``."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator, Optional

import pandas as pd

from pyterrier_cpdae._files import read_head, read_lines, read_text
from pyterrier_cpdae.datasets.base import LocalDataset, spec_folder
from pyterrier_cpdae.datasets.records import (_TAG, _clean, _columns, _id, _label, _line_of, _read_qrels,
                                              _unique_topics)

__all__ = ["open_trec", "read_trec_qrels", "KINDS"]


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


def _trec_qrel(cols: list[str]) -> tuple[str, str, int]:
    qid, _, docno, label = _columns(cols, 4, "qid iter docno label")
    return qid, docno, _label(label)


def read_trec_qrels(path: Path) -> pd.DataFrame:
    """TREC qrels: ``qid iter docno label`` per line, split on whitespace (``iter`` is ignored)."""
    return _read_qrels(path, _trec_qrel)


def open_trec(folder: Path) -> LocalDataset:
    """The TREC collection in ``folder``: its ``<DOC>`` files, its one ``<top>`` topics file and its one ``qrels*``
    file."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    qrels = [p for p in files if p.name.lower().startswith("qrels")]
    heads = {p: read_head(p).lower() for p in files if p not in qrels}
    topics = [p for p, h in heads.items() if "<top>" in h]
    docs = [p for p, h in heads.items() if re.search(r"<doc[\s>]", h) and p not in topics]
    for what, found, hint in (("documents", docs, "files with <DOC> records"),
                              ("topics", topics, "a file with <top> topics, e.g. query-text.trec"),
                              ("qrels", qrels, "a file named qrels*")):
        if not found:
            raise FileNotFoundError(f"trec:{folder}: no {what} found (looked for {hint})")
    if len(topics) > 1 or len(qrels) > 1:
        raise ValueError(f"trec:{folder}: ambiguous layout, several topics {topics} or qrels {qrels} files")
    return LocalDataset(f"trec:{folder}", lambda: _trec_docs(docs), lambda: _trec_topics(topics[0]),
                        lambda: read_trec_qrels(qrels[0]))


#: spec kind -> (its form, the function that opens ``<kind>:<rest>``)
KINDS = {"trec": ("trec:<folder>", lambda rest, spec: open_trec(spec_folder(rest, spec)))}
