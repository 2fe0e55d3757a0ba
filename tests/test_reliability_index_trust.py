"""An index answers for what it holds: a corrupt stored vector is refused by the mining API as by the retrievers;
packages unpack only what their manifest lists (caches dropped, sizes bounded, nothing left by a killed unpack); an
unknown format version is refused; the index checks the producer of the query vectors wherever they meet it."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pyterrier_cpdae import DenseIndex
from pyterrier_cpdae.dense import format as io

DIM = 8


def _index(path, n=30, **kw):
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((n, DIM)).astype(np.float32)
    index = DenseIndex(path)
    index.indexer(**kw).index([{"docno": f"d{i}", "doc_vec": vecs[i]} for i in range(n)])
    return index, vecs


def test_search_refuses_a_stored_nan_vector_naming_the_document(tmp_path):
    index, vecs = _index(tmp_path / "i")
    raw = np.memmap(tmp_path / "i" / io.VECTORS_FILE, dtype="<f4", mode="r+", shape=vecs.shape)
    raw[7] = np.nan
    raw.flush()
    del raw
    q = vecs[:3] + 0.1
    topics = pd.DataFrame({"qid": ["a", "b", "c"], "query_vec": list(q)})
    with pytest.raises(ValueError, match="not finite"):
        index.np_retriever(num_results=30)(topics)
    for backend in ("numpy", "torch"):
        with pytest.raises(ValueError) as info:
            index.search(q, 30, backend=backend)
        msg = str(info.value)
        assert "'d7'" in msg and "\n" not in msg and "overwrite" in msg
