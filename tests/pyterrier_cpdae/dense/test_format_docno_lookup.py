"""The docno <-> row lookup of a DenseIndex against a plain dict, for the docno schemes real collections use.

Regression tests for two npids 0.1.3 bugs that the index works around (``_index_io.build_docno_lookup``):
integer-sequence docnos that do not start at 0 (Vaswani's ``"1"``..``"11429"``, the sample's
``"d001"``..``"d160"``) lost their last docnos in npids' arithmetic inverse, and a block of one docno
(a one-document index) could not be read back.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

SCHEMES = {
    "vaswani-like 1..n": [str(i) for i in range(1, 1201)],
    "padded d001..": [f"d{i:03d}" for i in range(1, 161)],
    "msmarco-like 0..n": [str(i) for i in range(0, 700)],
    "one document": ["only-doc"],
    "one numeric document": ["7"],
    "sequence then a stray docno": [str(i) for i in range(0, 300)] + ["foo"],
    "free text ids": [f"doc-{i * 7919 % 1000:04x}-{i}" for i in range(500)],
}


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_lookup_matches_a_dict(tmp_path, name):
    import npids

    from pyterrier_cpdae.dense.format import build_docno_lookup

    docnos = SCHEMES[name]
    reference = {d: i for i, d in enumerate(docnos)}
    path = tmp_path / "docnos.npids"
    build_docno_lookup(iter(docnos), path)
    with npids.Lookup(path) as lookup:
        assert len(lookup) == len(docnos)
        assert list(lookup.fwd) == docnos
        assert lookup.inv.lookup(docnos) == [reference[d] for d in docnos]
        # unknown docnos, including differently padded numbers, are never mapped to a row
        unknown = ["d1", "007", "000", "-1", "foo2", "", str(len(docnos) + 1)]
        unknown = [u for u in unknown if u not in reference]
        assert lookup.inv.lookup(unknown) == [-1] * len(unknown)


@pytest.mark.parametrize("docnos", [["1", "2", "1"], ["x", "x"], ["x"] * 300, [str(i) for i in range(1, 50)] + ["49"]])
def test_duplicates_are_refused_and_leave_no_lookup(tmp_path, docnos):
    from pyterrier_cpdae.dense.format import build_docno_lookup

    path = tmp_path / "docnos.npids"
    with pytest.raises(ValueError, match="duplicate docnos"):
        build_docno_lookup(iter(docnos), path)
    assert not path.exists()


def test_index_scores_the_last_document_of_a_sequence_starting_at_one(tmp_path):
    """End to end: every docno of a Vaswani-style collection is indexed, found and scored with its own vector."""
    from pyterrier_cpdae import DenseIndex

    rng = np.random.default_rng(0)
    n, dim = 300, 8
    vecs = rng.standard_normal((n, dim)).astype(np.float32)
    docnos = [str(i) for i in range(1, n + 1)]
    index = DenseIndex(str(tmp_path / "idx"))
    index.indexer().index(pd.DataFrame({"docno": docnos, "doc_vec": list(vecs)}))
    assert index.built()

    q = rng.standard_normal(dim).astype(np.float32)
    frame = pd.DataFrame({"qid": "q", "query_vec": [q] * 3, "docno": ["300", "1", "150"]})
    scored = index.scorer()(frame).sort_values("docno")
    expected = {d: float(vecs[int(d) - 1] @ q) for d in ("1", "150", "300")}
    assert dict(zip(scored["docno"], scored["score"])) == pytest.approx(expected, rel=1e-6)

    one = DenseIndex(str(tmp_path / "one"))
    one.indexer().index(pd.DataFrame({"docno": ["only"], "doc_vec": [vecs[0]]}))
    res = one.retriever(num_results=5)(pd.DataFrame({"qid": ["q"], "query_vec": [q]}))
    assert list(res["docno"]) == ["only"] and res["score"].iloc[0] == pytest.approx(float(vecs[0] @ q), rel=1e-6)
