"""Test collections from ir_datasets or from local folders, with one PyTerrier-style interface.

:func:`load_dataset` takes a spec string and returns a :class:`pyterrier.datasets.Dataset`
whose

* ``get_corpus_iter()`` yields dicts with ``docno`` and ``text`` (plus ``title`` where the
  collection has titles; ``text`` then starts with the title),
* ``get_topics()`` is a DataFrame ``qid, query``,
* ``get_qrels()`` is a DataFrame ``qid, docno, label`` (``label`` an int),

with every id a ``str``. Specs:

========================== ================================================================
``irds:<id>``              any ir_datasets id, through ``pt.get_dataset("irds:<id>")``
``trec:<folder>``          TREC layout (e.g. Vaswani): ``<DOC>`` files, a ``<top>`` topics
                           file, a ``qrels*`` file (``qid iter docno label``)
``beir:<folder>[:split]``  BEIR layout: ``corpus.jsonl``, ``queries.jsonl``,
                           ``qrels/<split>.tsv`` (default split ``test``)
``cranfield:<folder>``     Glasgow/SMART files ``cran.all.1400``, ``cran.qry``, ``cranqrel``
``cisi:<folder>``          ``CISI.ALL``, ``CISI.QRY``, ``CISI.REL``
``medline:<folder>``       ``MED.ALL``, ``MED.QRY``, ``MED.REL``
``sample``                 the small collection shipped in ``pyterrier_cpdae/data/sample``
========================== ================================================================
"""
from __future__ import annotations

import importlib.resources
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import pandas as pd
import pyterrier as pt
import pyterrier_alpha as pta

from pyterrier_cpdae._files import read_head, read_jsonl, read_lines, read_text, short_repr
from pyterrier_cpdae._checks import as_docno, as_docnos

__all__ = ["load_dataset", "LocalDataset", "IRDSWrapper", "DatasetTextLoader", "SMART_LAYOUTS"]

_TOPICS_COLUMNS = ["qid", "query"]
_QRELS_COLUMNS = ["qid", "docno", "label"]


def load_dataset(spec: str) -> pt.datasets.Dataset:
    """Open a test collection from a spec string (see the module docstring for the forms).

    Raises:
        ValueError: unknown spec form.
        FileNotFoundError: a folder or one of its files is missing.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"dataset spec must be a non-empty str, got {spec!r}")
    if spec == "sample":
        return _sample()
    kind, sep, rest = spec.partition(":")
    if not sep or not rest:
        raise ValueError(f"unknown dataset spec {spec!r}; expected one of: sample, irds:<id>, trec:<folder>, "
                         "beir:<folder>[:split], cranfield:<folder>, cisi:<folder>, medline:<folder>")
    if kind == "irds":
        return IRDSWrapper(rest)
    if kind == "trec":
        return _trec(_folder(rest, spec))
    if kind == "beir":
        folder, split = rest, "test"
        if not Path(rest).is_dir() and ":" in rest:
            folder, split = rest.rsplit(":", 1)
        return _beir(_folder(folder, spec), split)
    if kind in SMART_LAYOUTS:
        return _smart(_folder(rest, spec), SMART_LAYOUTS[kind])
    raise ValueError(f"unknown dataset kind {kind!r} in {spec!r}; known: irds, trec, beir, "
                     f"{', '.join(SMART_LAYOUTS)}, sample")


def _folder(path: str, spec: str) -> Path:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"dataset folder {folder} (from spec {spec!r}) does not exist or is not a folder")
    return folder


class _HasTextLoader:
    """``text_loader()`` for a dataset that can list its document fields and look documents up by docno."""

    def text_loader(self, fields: Union[str, list[str]] = "*", *, verbose: bool = False) -> "DatasetTextLoader":
        """A transformer that adds each document's fields (by default all: ``text``, and ``title`` where the
        collection has titles) for its ``docno``: PyTerrier's text-loader convention, so that
        ``pt.text.get_text(dataset)`` works too and ``bm25 >> dataset.text_loader() >> enc.text_scorer()``
        re-ranks with the text the collection holds.

        Args:
            fields: ``"*"`` (every field), one field name or a list of them.
            verbose: show a progress bar while the documents are looked up.
        """
        return DatasetTextLoader(self, fields, verbose=verbose)

    def _doc_fields(self) -> list[str]:
        raise NotImplementedError

    def _lookup(self, docnos: list[str], verbose: bool) -> dict[str, dict]:
        """``{docno: document dict}`` for the docnos that are in the collection (the others are left out)."""
        raise NotImplementedError


class DatasetTextLoader(pt.Transformer):
    """Adds the fields of each ``docno``'s document (see :meth:`LocalDataset.text_loader`); other columns, the
    rows' order and the frame's index are kept, a column of a loaded field is replaced. A docno that is not in the
    collection raises ``ValueError`` naming it."""

    schematic = {"label": "TextLoader"}

    def __init__(self, dataset: _HasTextLoader, fields: Union[str, list[str]] = "*", *, verbose: bool = False):
        available = dataset._doc_fields()
        if fields == "*":
            wanted = list(available)
        else:
            wanted = [fields] if isinstance(fields, str) else list(fields)
            unknown = [f for f in wanted if f not in available]
            if unknown or not wanted:
                raise ValueError(f"{dataset!r} has no document field(s) {unknown or wanted}; its documents have "
                                 f"{available}")
        self.dataset = dataset
        self.fields = wanted
        self.verbose = verbose

    def __repr__(self) -> str:
        args = "" if self.fields == self.dataset._doc_fields() else repr(self.fields)
        return f"{self.dataset!r}.text_loader({args})"

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        pta.validate.columns(inp, includes=["docno"])
        docnos = as_docnos(inp["docno"].tolist(), range(len(inp)))
        unique = list(dict.fromkeys(docnos))
        found = self.dataset._lookup(unique, self.verbose)
        missing = [d for d in unique if d not in found]
        if missing:
            raise ValueError(f"{len(missing)} docno(s) of the input are not documents of {self.dataset!r}, e.g. "
                             f"{missing[:5]}; load the text from the collection the results were retrieved from")
        out = inp.drop(columns=self.fields, errors="ignore")
        return out.assign(**{f: [found[d].get(f, "") for d in docnos] for f in self.fields})

    def fuse_rank_cutoff(self, k: int) -> pt.Transformer:
        """``loader % k`` cuts the ranking before loading text (and so fuses into the retriever before it)."""
        return pt.RankCutoff(k) >> self


class LocalDataset(_HasTextLoader, pt.datasets.Dataset):
    """A collection read from local files by three loader functions (parsed on each call); :meth:`text_loader`
    reads the documents once, on first use, into a docno-keyed store kept by the dataset."""

    def __init__(self, name: str, corpus: Callable[[], Iterator[dict]], topics: Callable[[], pd.DataFrame],
                 qrels: Callable[[], pd.DataFrame]):
        self.name = name
        self._corpus = corpus
        self._topics = topics
        self._qrels = qrels
        self._docstore: Optional[dict[str, dict]] = None

    def get_corpus_iter(self, verbose: bool = False) -> Iterator[dict]:
        """Documents as dicts with ``docno`` and ``text`` (``title`` too where available)."""
        it = self._corpus()
        return pt.tqdm(it, desc=f"{self.name} documents") if verbose else it

    def get_topics(self, variant: Optional[str] = None) -> pd.DataFrame:
        """Topics: DataFrame ``qid, query`` (str)."""
        self._no_variant(variant)
        return self._topics()

    def get_qrels(self, variant: Optional[str] = None) -> pd.DataFrame:
        """Relevance judgements: DataFrame ``qid, docno, label`` (ids str, label int)."""
        self._no_variant(variant)
        return self._qrels()

    def _no_variant(self, variant: Optional[str]) -> None:
        if variant is not None:  # silently answering with the one set there is would be wrong data
            raise ValueError(f"{self.name} has one set of topics and qrels, no variant {variant!r}; call without "
                             "a variant (a BEIR split is chosen in the spec: beir:<folder>:<split>)")

    def get_corpus_lang(self) -> str:
        return "en"

    def get_topics_lang(self) -> str:
        return "en"

    def __repr__(self) -> str:
        return f"load_dataset({self.name!r})"

    def _doc_fields(self) -> list[str]:
        if self._docstore:
            first = next(iter(self._docstore.values()))
        else:  # the parsers give every document the same keys: the first tells them
            first = next(iter(self._corpus()), None)
            if first is None:
                raise ValueError(f"{self!r} has no documents")
        return [k for k in first if k != "docno"]

    def _lookup(self, docnos: list[str], verbose: bool) -> dict[str, dict]:
        if self._docstore is None:
            store: dict[str, dict] = {}
            for doc in self.get_corpus_iter(verbose=verbose):
                if doc["docno"] in store:
                    raise ValueError(f"{self!r}: docno {doc['docno']!r} names two documents; text cannot be loaded by "
                                     "docno until the collection's docnos are unique")
                store[doc["docno"]] = doc
            self._docstore = store
        return {d: self._docstore[d] for d in docnos if d in self._docstore}


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


def _trec(folder: Path) -> LocalDataset:
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
                        lambda: _read_qrels(qrels[0], _trec_qrel))


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


def _beir_files(name: str, corpus: Path, queries: Path, qrels: Path) -> LocalDataset:
    return LocalDataset(name, lambda: _beir_docs(corpus), lambda: _beir_topics(queries, qrels),
                        lambda: _beir_qrels(qrels))


def _beir(folder: Path, split: str) -> LocalDataset:
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
    return _beir_files(f"beir:{folder}:{split}", corpus, queries, qrels)


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


def _smart(folder: Path, layout: SmartLayout) -> LocalDataset:
    kind = next(k for k, v in SMART_LAYOUTS.items() if v is layout)
    spec = f"{kind}:{folder}"
    docs, queries, qrels = (_find_file(folder, n, spec) for n in (layout.docs, layout.queries, layout.qrels))
    return LocalDataset(spec, lambda: _smart_docs(docs), lambda: _smart_topics(queries, layout.sequential_qids),
                        lambda: _read_qrels(qrels, layout.parse_qrel))


# --------------------------------------------------------------------------- built-in sample

def _sample() -> LocalDataset:
    """The built-in collection: BEIR files, flattened (``qrels.tsv`` instead of ``qrels/test.tsv``)."""
    root = importlib.resources.files("pyterrier_cpdae") / "data" / "sample"
    # setuptools installs package data as plain files, so this is a real folder
    folder = Path(str(root))
    files = [folder / n for n in ("corpus.jsonl", "queries.jsonl", "qrels.tsv")]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"the built-in sample collection is incomplete in {folder}: {missing} missing "
                                "(reinstall pyterrier-cpdae)")
    return _beir_files("sample", *files)


# --------------------------------------------------------------------------- ir_datasets

class IRDSWrapper(_HasTextLoader, pt.datasets.Dataset):
    """An ir_datasets collection (via ``pt.get_dataset("irds:<id>")``) with normalised fields.

    Documents get ``text`` = ir_datasets' ``default_text()`` (e.g. title + body) and keep
    their other string fields; queries use ``default_text()`` (e.g. a TREC topic's title).
    :meth:`text_loader` looks documents up in ir_datasets' docstore.
    """

    def __init__(self, irds_id: str):
        self.irds_id = irds_id
        try:
            self._dataset = pt.get_dataset(f"irds:{irds_id}")
        except KeyError as e:
            raise ValueError(f"unknown ir_datasets id {irds_id!r}") from e

    def irds_ref(self) -> Any:
        return self._dataset.irds_ref()

    def get_corpus_iter(self, verbose: bool = False) -> Iterator[dict]:
        ds = self.irds_ref()
        if not ds.has_docs():
            raise NotImplementedError(f"irds:{self.irds_id} has no documents")
        it = ds.docs_iter()
        if verbose:
            it = pt.tqdm(it, desc=f"irds:{self.irds_id} documents", total=ds.docs_count())
        for position, doc in enumerate(it, 1):
            yield self._doc(doc, f"irds:{self.irds_id} document {position}")

    def _doc(self, doc: Any, where: str) -> dict:
        """An ir_datasets document as this wrapper gives it: ``docno``, its string fields, ``text`` =
        ``default_text()``."""
        fields = {k: v for k, v in doc._asdict().items() if k != "doc_id" and isinstance(v, str)}
        text = doc.default_text() if hasattr(doc, "default_text") else fields.get("text", "")
        docno = _id(doc.doc_id, "doc_id", where)
        return {"docno": docno, **fields, "text": _text(text, f"the text of {docno!r}", where)}

    def _doc_fields(self) -> list[str]:
        ds = self.irds_ref()
        if not ds.has_docs():
            raise ValueError(f"irds:{self.irds_id} has no documents")
        cls = ds.docs_cls()
        types = getattr(cls, "__annotations__", {})
        return [f for f in cls._fields if f != "doc_id" and types.get(f) is str and f != "text"] + ["text"]

    def _lookup(self, docnos: list[str], verbose: bool) -> dict[str, dict]:
        """Looked up in ir_datasets' docstore (no pass over the corpus)."""
        found = self.irds_ref().docs_store().get_many(docnos)
        return {d: self._doc(doc, f"irds:{self.irds_id} document {d!r}") for d, doc in found.items()}

    def get_topics(self, variant: Optional[str] = None) -> pd.DataFrame:
        where = f"irds:{self.irds_id}" + (f" (variant {variant!r})" if variant is not None else "")
        if variant is not None:
            df = self._dataset.get_topics(variant)
            rows = list(zip(df["qid"].astype(str), df["query"].astype(str)))
        else:
            ds = self.irds_ref()
            if not ds.has_queries():
                raise NotImplementedError(f"irds:{self.irds_id} has no queries")
            rows = [(str(q.query_id), q.default_text() if hasattr(q, "default_text") else q.text)
                    for q in ds.queries_iter()]
        return _unique_topics(rows, lambda i: f"{where} query {i + 1}")

    def get_qrels(self, variant: Optional[str] = None) -> pd.DataFrame:
        df = self._dataset.get_qrels(variant)
        where = f"irds:{self.irds_id}" + (f" (variant {variant!r})" if variant is not None else "")
        rows = list(zip(df["qid"].astype(str), df["docno"].astype(str), df["label"].astype(int)))
        return _unique_qrels(rows, lambda i: f"{where} judgement {i + 1}")

    def get_corpus_lang(self) -> Optional[str]:
        return self._dataset.get_corpus_lang()

    def get_topics_lang(self) -> Optional[str]:
        return self._dataset.get_topics_lang()

    def __repr__(self) -> str:
        return f"load_dataset('irds:{self.irds_id}')"
