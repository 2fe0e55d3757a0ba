"""Twelve short documents, two queries and the encoder settings of the tests of whose vectors a row or query holds."""
from __future__ import annotations

import pandas as pd

from pyterrier_cpdae import CPDAE

TEXTS = [f"document {i} about {w}" for i, w in enumerate(
    "dense sparse lexical neural vector index query model token corpus passage ranking".split())]
TOPICS = pd.DataFrame({"qid": ["q1", "q2"], "query": ["dense vector retrieval", "ranking passages"]})


def enc(path, **kw):
    """CPDAE on the CPU in float32 (documents cut at 32 tokens, PyTorch, unless ``doc_max_length``/``backend`` say
    otherwise)."""
    return CPDAE.from_pretrained(path, device="cpu", dtype="float32", doc_max_length=kw.pop("doc_max_length", 32),
                                 batch_size=8, backend=kw.pop("backend", "torch"), **kw)
