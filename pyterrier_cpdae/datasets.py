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

import bz2
import gzip
import importlib.resources
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pandas as pd
import pyterrier as pt

__all__ = ["load_dataset", "LocalDataset", "IRDSWrapper", "SMART_LAYOUTS"]

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


class LocalDataset(pt.datasets.Dataset):
    """A collection read from local files by three loader functions (parsed on each call)."""

    def __init__(self, name: str, corpus: Callable[[], Iterator[dict]], topics: Callable[[], pd.DataFrame],
                 qrels: Callable[[], pd.DataFrame]):
        self.name = name
        self._corpus = corpus
        self._topics = topics
        self._qrels = qrels

    def get_corpus_iter(self, verbose: bool = False) -> Iterator[dict]:
        """Documents as dicts with ``docno`` and ``text`` (``title`` too where available)."""
        it = self._corpus()
        return pt.tqdm(it, desc=f"{self.name} documents") if verbose else it

    def get_topics(self, variant: Optional[str] = None) -> pd.DataFrame:
        """Topics: DataFrame ``qid, query`` (str)."""
        return self._topics()

    def get_qrels(self, variant: Optional[str] = None) -> pd.DataFrame:
        """Relevance judgements: DataFrame ``qid, docno, label`` (ids str, label int)."""
        return self._qrels()

    def get_corpus_lang(self) -> str:
        return "en"

    def get_topics_lang(self) -> str:
        return "en"

    def __repr__(self) -> str:
        return f"load_dataset({self.name!r})"


# --------------------------------------------------------------------------- helpers

def _open_text(path: Path) -> io.TextIOBase:
    """Open a text file, transparently decompressing .gz / .bz2."""
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="replace")
    if path.suffix == ".bz2":
        return io.TextIOWrapper(bz2.open(path, "rb"), encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def _head(path: Path, n: int = 4096) -> str:
    with _open_text(path) as f:
        return f.read(n)


def _topics_frame(rows: list[tuple[str, str]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=_TOPICS_COLUMNS).astype({"qid": str, "query": str})


def _qrels_frame(rows: list[tuple[str, str, int]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=_QRELS_COLUMNS).astype({"qid": str, "docno": str, "label": "int64"})


_WS = re.compile(r"\s+")
_TAG = re.compile(r"<[^>]+>")


def _clean(text: str) -> str:
    return _WS.sub(" ", text).strip()


# --------------------------------------------------------------------------- TREC

_DOCNO = re.compile(r"<DOCNO>\s*(.*?)\s*</DOCNO>", re.IGNORECASE | re.DOTALL)


def _trec_docs(files: list[Path]) -> Iterator[dict]:
    """Stream ``<DOC>`` records: docno from ``<DOCNO>``, text = everything else without tags."""
    for path in files:
        with _open_text(path) as f:
            buf: Optional[list[str]] = None
            for line_no, line in enumerate(f, 1):
                upper = line.lstrip().upper()
                if upper.startswith("<DOC>"):
                    buf = [line.lstrip()[5:]]
                elif upper.startswith("</DOC>"):
                    if buf is None:
                        raise ValueError(f"{path}:{line_no}: </DOC> without <DOC>")
                    raw = "".join(buf)
                    m = _DOCNO.search(raw)
                    if m is None:
                        raise ValueError(f"{path}:{line_no}: document without <DOCNO>")
                    yield {"docno": m.group(1), "text": _clean(_TAG.sub(" ", raw[:m.start()] + raw[m.end():]))}
                    buf = None
                elif buf is not None:
                    buf.append(line)


_TOP = re.compile(r"<top>(.*?)</top>", re.IGNORECASE | re.DOTALL)


def _trec_field(block: str, tag: str) -> Optional[str]:
    """Content of ``<tag>`` up to its closing tag or the next tag (old TREC topics leave tags open)."""
    m = re.search(rf"<{tag}>(.*?)(?=<)", block + "<", re.IGNORECASE | re.DOTALL)
    return None if m is None else _clean(m.group(1))


def _trec_topics(path: Path) -> pd.DataFrame:
    with _open_text(path) as f:
        content = f.read()
    rows = []
    for block in _TOP.findall(content):
        num, title = _trec_field(block, "num"), _trec_field(block, "title")
        if not num or title is None:
            raise ValueError(f"{path}: topic without <num> or <title>: {block[:80]!r}")
        num = re.sub(r"^Number:\s*", "", num, flags=re.IGNORECASE)
        title = re.sub(r"^Topic:\s*", "", title, flags=re.IGNORECASE)
        rows.append((num, title))
    if not rows:
        raise ValueError(f"{path}: no <top> topics found")
    return _topics_frame(rows)


def _read_qrels(path: Path, parse: Callable[[list[str]], tuple[str, str, int]]) -> pd.DataFrame:
    rows = []
    with _open_text(path) as f:
        for line_no, line in enumerate(f, 1):
            cols = line.split()
            if not cols:
                continue
            try:
                rows.append(parse(cols))
            except (ValueError, IndexError) as e:
                raise ValueError(f"{path}:{line_no}: cannot parse qrels line {line.rstrip()!r}: {e}") from None
    return _qrels_frame(rows)


def _trec_qrel(cols: list[str]) -> tuple[str, str, int]:
    if len(cols) != 4:
        raise ValueError(f"expected 4 columns (qid iter docno label), got {len(cols)}")
    return cols[0], cols[2], int(float(cols[3]))


def _trec(folder: Path) -> LocalDataset:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    qrels = [p for p in files if p.name.lower().startswith("qrels")]
    heads = {p: _head(p).lower() for p in files if p not in qrels}
    topics = [p for p, h in heads.items() if "<top>" in h]
    docs = [p for p, h in heads.items() if "<doc>" in h and p not in topics]
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

def _jsonl(path: Path) -> Iterator[dict]:
    with _open_text(path) as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{line_no}: invalid JSON: {e}") from None


def _beir_docs(path: Path) -> Iterator[dict]:
    for doc in _jsonl(path):
        title, text = doc.get("title") or "", doc.get("text") or ""
        yield {"docno": str(doc["_id"]), "text": f"{title} {text}".strip(), "title": title}


def _beir_qrels(path: Path) -> pd.DataFrame:
    rows = []
    with _open_text(path) as f:
        for line_no, line in enumerate(f, 1):
            cols = line.rstrip("\n").split("\t")
            if (line_no == 1 and cols[0] == "query-id") or not line.strip():
                continue
            if len(cols) != 3:
                raise ValueError(f"{path}:{line_no}: expected query-id, corpus-id, score; got {line.rstrip()!r}")
            rows.append((cols[0], cols[1], int(float(cols[2]))))
    return _qrels_frame(rows)


def _beir_topics(queries: Path, qrels: Path) -> pd.DataFrame:
    judged = set(_beir_qrels(qrels)["qid"])
    rows = [(str(q["_id"]), q["text"]) for q in _jsonl(queries) if str(q["_id"]) in judged]
    return _topics_frame(rows)


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
    qid, docno, code = cols[0], cols[1], int(cols[2])
    if code not in (-1, 1, 2, 3, 4):
        raise ValueError(f"unknown Cranfield relevance code {code}")
    return qid, docno, 0 if code == -1 else 5 - code


def _cisi_qrel(cols: list[str]) -> tuple[str, str, int]:
    return cols[0], cols[1], 1  # "qid docno 0 0.000000": every listed pair is relevant


def _medline_qrel(cols: list[str]) -> tuple[str, str, int]:
    return cols[0], cols[2], int(float(cols[3]))  # "qid 0 docno rel"


SMART_LAYOUTS: dict[str, SmartLayout] = {
    "cranfield": SmartLayout("cran.all.1400", "cran.qry", "cranqrel", _cranfield_qrel, sequential_qids=True),
    "cisi": SmartLayout("CISI.ALL", "CISI.QRY", "CISI.REL", _cisi_qrel),
    "medline": SmartLayout("MED.ALL", "MED.QRY", "MED.REL", _medline_qrel),
}

_SMART_FIELD = re.compile(r"^\.([A-Z])\s*$")


def _smart_records(path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """``(id, {field letter: text})`` for each ``.I <id>`` record of a SMART file."""
    rid: Optional[str] = None
    fields: dict[str, list[str]] = {}
    field = None
    with _open_text(path) as f:
        for line_no, line in enumerate(f, 1):
            if line.startswith(".I ") or line.rstrip() == ".I":
                if rid is not None:
                    yield rid, {k: _clean(" ".join(v)) for k, v in fields.items()}
                rid = line[2:].strip()
                if not rid:
                    raise ValueError(f"{path}:{line_no}: .I without an id")
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
    if rid is not None:
        yield rid, {k: _clean(" ".join(v)) for k, v in fields.items()}


def _smart_docs(path: Path) -> Iterator[dict]:
    for rid, fields in _smart_records(path):
        title, body = fields.get("T", ""), fields.get("W", "")
        yield {"docno": rid.lstrip("0") or "0", "text": f"{title} {body}".strip(), "title": title}


def _smart_topics(path: Path, sequential: bool) -> pd.DataFrame:
    rows = []
    for position, (rid, fields) in enumerate(_smart_records(path), 1):
        query = " ".join(x for x in (fields.get("T", ""), fields.get("W", "")) if x)
        rows.append((str(position) if sequential else (rid.lstrip("0") or "0"), query))
    return _topics_frame(rows)


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

class IRDSWrapper(pt.datasets.Dataset):
    """An ir_datasets collection (via ``pt.get_dataset("irds:<id>")``) with normalised fields.

    Documents get ``text`` = ir_datasets' ``default_text()`` (e.g. title + body) and keep
    their other string fields; queries use ``default_text()`` (e.g. a TREC topic's title).
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
        for doc in it:
            fields = {k: v for k, v in doc._asdict().items() if k != "doc_id" and isinstance(v, str)}
            text = doc.default_text() if hasattr(doc, "default_text") else fields.get("text", "")
            yield {"docno": str(doc.doc_id), **fields, "text": text}

    def get_topics(self, variant: Optional[str] = None) -> pd.DataFrame:
        if variant is not None:
            df = self._dataset.get_topics(variant)
            return _topics_frame(list(zip(df["qid"].astype(str), df["query"].astype(str))))
        ds = self.irds_ref()
        if not ds.has_queries():
            raise NotImplementedError(f"irds:{self.irds_id} has no queries")
        return _topics_frame([(str(q.query_id), q.default_text() if hasattr(q, "default_text") else q.text)
                              for q in ds.queries_iter()])

    def get_qrels(self, variant: Optional[str] = None) -> pd.DataFrame:
        df = self._dataset.get_qrels(variant)
        return _qrels_frame(list(zip(df["qid"].astype(str), df["docno"].astype(str), df["label"].astype(int))))

    def get_corpus_lang(self) -> Optional[str]:
        return self._dataset.get_corpus_lang()

    def get_topics_lang(self) -> Optional[str]:
        return self._dataset.get_topics_lang()

    def __repr__(self) -> str:
        return f"load_dataset('irds:{self.irds_id}')"
