"""``cranfield:``, ``cisi:``, ``medline:<folder>``: the Glasgow/SMART files (``.I``/``.T``/``.W`` records), one
:class:`SmartLayout` per collection in :data:`SMART_LAYOUTS` (its file names and qrels format): Cranfield's
``cran.all.1400``, ``cran.qry``, ``cranqrel``; CISI's ``CISI.ALL``, ``CISI.QRY``, ``CISI.REL``; Medline's
``MED.ALL``, ``MED.QRY``, ``MED.REL``."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import pandas as pd

from pyterrier_cpdae._files import read_lines
from pyterrier_cpdae.datasets.base import LocalDataset, spec_folder
from pyterrier_cpdae.datasets.records import (_clean, _columns, _find_file, _label, _no_records, _read_qrels,
                                              _unique_topics)

__all__ = ["SmartLayout", "SMART_LAYOUTS", "open_smart", "KINDS"]


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


def open_smart(folder: Path, layout: SmartLayout) -> LocalDataset:
    kind = next(k for k, v in SMART_LAYOUTS.items() if v is layout)
    spec = f"{kind}:{folder}"
    docs, queries, qrels = (_find_file(folder, n, spec) for n in (layout.docs, layout.queries, layout.qrels))
    return LocalDataset(spec, lambda: _smart_docs(docs), lambda: _smart_topics(queries, layout.sequential_qids),
                        lambda: _read_qrels(qrels, layout.parse_qrel))


def _opener(layout: SmartLayout) -> Callable[[str, str], LocalDataset]:
    return lambda rest, spec: open_smart(spec_folder(rest, spec), layout)


#: spec kind -> (its form, the function that opens ``<kind>:<rest>``)
KINDS = {kind: (f"{kind}:<folder>", _opener(layout)) for kind, layout in SMART_LAYOUTS.items()}
