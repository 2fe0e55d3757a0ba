"""``sample``: the small collection shipped in ``pyterrier_cpdae/data/sample`` (BEIR files, flattened)."""
from __future__ import annotations

import importlib.resources
from pathlib import Path

from pyterrier_cpdae.datasets.base import LocalDataset
from pyterrier_cpdae.datasets.beir import beir_files

__all__ = ["open_sample"]


def open_sample() -> LocalDataset:
    """The built-in collection: BEIR files, flattened (``qrels.tsv`` instead of ``qrels/test.tsv``)."""
    root = importlib.resources.files("pyterrier_cpdae") / "data" / "sample"
    # setuptools installs package data as plain files, so this is a real folder
    folder = Path(str(root))
    files = [folder / n for n in ("corpus.jsonl", "queries.jsonl", "qrels.tsv")]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"the built-in sample collection is incomplete in {folder}: {missing} missing "
                                "(reinstall pyterrier-cpdae)")
    return beir_files("sample", *files)
