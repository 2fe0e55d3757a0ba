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
import re
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import pandas as pd
import pyterrier as pt
import pyterrier_alpha as pta

from pyterrier_cpdae.datasets.records import (SMART_LAYOUTS, SmartLayout, _beir_docs, _beir_qrels, _beir_topics,  # noqa: F401
                                                     _find_file, _id, _label, _read_qrels, _smart_docs, _smart_topics, _text,
                                                     _trec_docs, _trec_qrel, _trec_topics, _unique_qrels, _unique_topics)
from pyterrier_cpdae._files import read_head
from pyterrier_cpdae._checks import as_docnos

__all__ = ["load_dataset", "LocalDataset", "IRDSWrapper", "DatasetTextLoader", "SMART_LAYOUTS"]


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
