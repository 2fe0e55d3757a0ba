"""Fixtures of the dense index's tests."""
from __future__ import annotations

import pytest

from pyterrier_cpdae.dense import DenseIndex

from tests.helpers.dense import make_docs


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    docs, vecs = make_docs(3000)
    index = DenseIndex(tmp_path_factory.mktemp("idx") / "index")
    index.indexer().index(docs)
    return index, vecs
