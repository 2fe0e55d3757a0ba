"""The BM25 wing: :class:`BM25Index`, a Lucene index built and searched through Pyserini/Anserini.

* :mod:`~pyterrier_cpdae.bm25.index`: :class:`BM25Index` (``indexer()``, ``bm25()``, ``text_loader()``) and the
  indexer;
* :mod:`~pyterrier_cpdae.bm25.retrieval`: the retriever and the text loader;
* :mod:`~pyterrier_cpdae.bm25.jvm`: the one door to Java (``ensure_java``, ``autoclass``): JDK choice, JVM options, the
  class path;
* :mod:`~pyterrier_cpdae.bm25.java`: the package's Java helper (``BlobIndexer``, ``FlatHits``): its jar, its sources,
  and ``python -m pyterrier_cpdae.bm25.java.build``.

Names are imported lazily (importing the package starts no JVM in any case).
"""
from __future__ import annotations


from pyterrier_cpdae._lazy import lazy_exports

_EXPORTS = {name: "pyterrier_cpdae.bm25.index" for name in ("BM25Index", "BM25Indexer")}
_EXPORTS.update({name: "pyterrier_cpdae.bm25.retrieval" for name in ("BM25Retriever", "BM25TextLoader")})

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports('pyterrier_cpdae.bm25', _EXPORTS, globals())
