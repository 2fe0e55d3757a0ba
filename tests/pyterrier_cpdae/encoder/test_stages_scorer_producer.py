"""The text scorer scores given ``query_vec``/``doc_vec`` only when this encoder made them: vectors stamped by
another encoder (the ``*_producer`` column an encoder stage writes) are refused with one line; vectors without a
stamp (user code) and this encoder's own are scored, each score the plain dot product of the two vectors."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from tests.helpers.producers import TEXTS, TOPICS, enc


def _pairs(topics: pd.DataFrame) -> pd.DataFrame:
    docs = pd.DataFrame({"docno": [f"d{i}" for i in range(3)], "text": TEXTS[:3]})
    return topics.merge(docs, how="cross")


def test_query_vectors_of_another_encoder_are_refused(two_encoders):
    a, b = (enc(p) for p in two_encoders)
    rows = _pairs(a.query_encoder()(TOPICS))
    with pytest.raises(ValueError) as info:
        b.text_scorer()(rows)
    line = str(info.value)
    assert "\n" not in line and line.startswith("text_scorer: the query_vec column was encoded by")
    assert "Drop query_vec" in line


def test_document_vectors_of_another_encoder_are_refused(two_encoders):
    a, b = (enc(p) for p in two_encoders)
    rows = a.doc_encoder()(_pairs(TOPICS))
    with pytest.raises(ValueError, match="the doc_vec column was encoded by"):
        b.text_scorer()(rows)


def test_own_and_unstamped_vectors_are_scored_as_their_dot_product(two_encoders):
    a = enc(two_encoders[0])
    rows = a.doc_encoder()(_pairs(a.query_encoder()(TOPICS)))
    scored = a.text_scorer()(rows)
    expected = [float(np.dot(q, d)) for q, d in zip(rows["query_vec"], rows["doc_vec"])]
    assert np.allclose(scored["score"].to_numpy(), expected, rtol=0, atol=1e-6)
    # the same vectors without their stamps (as user code would give them): scored the same
    bare = rows.drop(columns=["query_vec_producer", "doc_vec_producer"])
    assert np.allclose(enc(two_encoders[1]).text_scorer()(bare)["score"].to_numpy(), expected, rtol=0, atol=1e-6)
