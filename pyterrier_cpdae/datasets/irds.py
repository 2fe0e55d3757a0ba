"""``irds:<id>``: any ir_datasets collection, through ``pt.get_dataset("irds:<id>")``, with the fields normalised as
the local readers give them."""
from __future__ import annotations

from typing import Any, Iterator, Optional

import pandas as pd
import pyterrier as pt

from pyterrier_cpdae.datasets.base import _HasTextLoader
from pyterrier_cpdae.datasets.records import _id, _text, _unique_qrels, _unique_topics

__all__ = ["IRDSWrapper", "KINDS"]


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


#: spec kind -> (its form, the function that opens ``<kind>:<rest>``)
KINDS = {"irds": ("irds:<id>", lambda rest, spec: IRDSWrapper(rest))}
