"""The dataset classes every reader builds on: :class:`LocalDataset` (a collection read from local files by three
loader functions), :class:`DatasetTextLoader` (``dataset.text_loader()``, PyTerrier's text-loader convention) and
:func:`spec_folder` (a spec's folder, checked)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator, Optional, Union

import pandas as pd
import pyterrier as pt
import pyterrier_alpha as pta

from pyterrier_cpdae._checks import as_docnos

__all__ = ["LocalDataset", "DatasetTextLoader", "spec_folder"]


def spec_folder(path: str, spec: str) -> Path:
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
