"""Test collections from ir_datasets or from local folders, with one PyTerrier-style interface.

:func:`load_dataset` takes a spec string and returns a :class:`pyterrier.datasets.Dataset`
whose

* ``get_corpus_iter()`` yields dicts with ``docno`` and ``text`` (plus ``title`` where the
  collection has titles; ``text`` then starts with the title),
* ``get_topics()`` is a DataFrame ``qid, query``,
* ``get_qrels()`` is a DataFrame ``qid, docno, label`` (``label`` an int),

with every id a ``str``. Specs, one reader module each:

========================== ================================================================ ==========
``irds:<id>``              any ir_datasets id, through ``pt.get_dataset("irds:<id>")``       ``irds``
``trec:<folder>``          TREC layout (e.g. Vaswani): ``<DOC>`` files, a ``<top>`` topics    ``trec``
                           file, a ``qrels*`` file (``qid iter docno label``)
``beir:<folder>[:split]``  BEIR layout: ``corpus.jsonl``, ``queries.jsonl``,                  ``beir``
                           ``qrels/<split>.tsv`` (default split ``test``)
``tsv:<folder>``           tab-separated ``corpus.tsv`` (``docno, [title,] text``),           ``tsv``
                           ``queries.tsv`` (``qid, query``), TREC qrels ``qrels*``
``cranfield:<folder>``     Glasgow/SMART files ``cran.all.1400``, ``cran.qry``, ``cranqrel``  ``smart``
``cisi:<folder>``          ``CISI.ALL``, ``CISI.QRY``, ``CISI.REL``                           ``smart``
``medline:<folder>``       ``MED.ALL``, ``MED.QRY``, ``MED.REL``                              ``smart``
``sample``                 the small collection shipped in ``pyterrier_cpdae/data/sample``    ``sample``
========================== ================================================================ ==========

A reader module gives ``KINDS``: ``{spec kind: (its form, opener(rest, spec))}``; a new format is one new module
named in :data:`FORMATS`. The dataset classes are in :mod:`pyterrier_cpdae.datasets.base`, what the readers share
(checked ids, labels, unique topics and qrels) in :mod:`pyterrier_cpdae.datasets.records`.
"""
from __future__ import annotations

import pyterrier as pt

from pyterrier_cpdae.datasets import beir, irds, smart, trec, tsv
from pyterrier_cpdae.datasets.base import DatasetTextLoader, LocalDataset
from pyterrier_cpdae.datasets.irds import IRDSWrapper
from pyterrier_cpdae.datasets.sample import open_sample
from pyterrier_cpdae.datasets.smart import SMART_LAYOUTS

__all__ = ["load_dataset", "LocalDataset", "IRDSWrapper", "DatasetTextLoader", "SMART_LAYOUTS", "FORMATS"]

#: the reader modules of the ``<kind>:<rest>`` specs, in the order their forms are listed
FORMATS = (irds, trec, beir, tsv, smart)
_KINDS = {kind: entry for module in FORMATS for kind, entry in module.KINDS.items()}


def load_dataset(spec: str) -> pt.datasets.Dataset:
    """Open a test collection from a spec string (see the module docstring for the forms).

    Raises:
        ValueError: unknown spec form.
        FileNotFoundError: a folder or one of its files is missing.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"dataset spec must be a non-empty str, got {spec!r}")
    if spec == "sample":
        return open_sample()
    kind, sep, rest = spec.partition(":")
    if not sep or not rest:
        forms = ", ".join(["sample"] + [form for form, _ in _KINDS.values()])
        raise ValueError(f"unknown dataset spec {spec!r}; expected one of: {forms}")
    if kind not in _KINDS:
        raise ValueError(f"unknown dataset kind {kind!r} in {spec!r}; known: {', '.join(_KINDS)}, sample")
    _, opener = _KINDS[kind]
    return opener(rest, spec)
