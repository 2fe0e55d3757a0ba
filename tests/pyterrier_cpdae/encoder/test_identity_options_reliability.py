"""Every option of the encoder either changes the producer stamp its vectors carry or is shown not to change the
vectors: ``CPDAE.from_pretrained``'s thirteen keyword options, each changed on its own.

Reference for the options that must not change the vectors: every text encoded alone (a batch of one, no padding, the
full last layer, PyTorch), compared within float32 summation order (1e-5; the OpenVINO graph within 1e-4, its
documented ~3e-6 on MiniLM-sized models)."""
from __future__ import annotations

import inspect
import json

import numpy as np
import pandas as pd
import pytest
import torch

from pyterrier_cpdae import CPDAE

QUERIES = ["short query", "a much longer query that runs past the eight tokens of the short query length",
           "dense retrieval", "what is the capital of france and why is it there"]
DOCS = [f"document {i}: " + " ".join(["passage text about dense retrieval and ranking"] * (1 + i % 5))
        for i in range(12)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, minilm_path):
    from transformers import AutoTokenizer, BertConfig, BertModel
    tok = AutoTokenizer.from_pretrained(minilm_path)
    out = tmp_path_factory.mktemp("opts")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=128)).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


BASE = dict(pooling="cls", normalize=False, query_max_length=8, doc_max_length=24, batch_size=4, device="cpu",
            dtype="float32", verbose=False, sort_window=2, backend="torch", batch_tokens=None, unpad=None,
            cls_last_layer=None)


def _enc(path, **changes):
    return CPDAE.from_pretrained(path, **{**BASE, **changes})


def _encode(enc):
    """Query and document vectors and their stamps, through the PyTerrier stages."""
    q = enc.query_encoder()(pd.DataFrame({"qid": [f"q{i}" for i in range(len(QUERIES))], "query": QUERIES}))
    d = enc.doc_encoder()(pd.DataFrame({"docno": [f"d{i}" for i in range(len(DOCS))], "text": DOCS}))
    return (np.stack(q["query_vec"]), np.stack(d["doc_vec"]), q["query_vec_producer"].iloc[0],
            d["doc_vec_producer"].iloc[0])


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """Each text alone (no padding, no batching, the full last layer, PyTorch) with the base options; and the base
    options' own encoding."""
    enc = _enc(tiny_dir, batch_size=1, sort_window=1, batch_tokens=0, unpad=False, cls_last_layer=False)
    q = np.stack([enc.encode_queries([t])[0] for t in QUERIES])
    d = np.stack([enc.encode_docs([t])[0] for t in DOCS])
    return q, d, _encode(_enc(tiny_dir))


#: options whose change changes the vectors: the stamp of the queries, the documents or both must change
STAMPED = {"pooling": "mean", "normalize": True, "query_max_length": 16, "doc_max_length": 12, "dtype": "bfloat16"}
#: options whose change must not change the vectors (beyond float32 summation order)
NEUTRAL = {"batch_size": 3, "sort_window": 7, "batch_tokens": 40, "verbose": True, "device": torch.device("cpu"),
           "unpad": False, "cls_last_layer": True, "backend": "openvino"}


def test_every_option_is_covered():
    options = [p for p, v in inspect.signature(CPDAE.from_pretrained).parameters.items()
               if v.kind is inspect.Parameter.KEYWORD_ONLY]
    assert len(options) == 13 and sorted(options) == sorted(set(STAMPED) | set(NEUTRAL)) == sorted(BASE)


@pytest.mark.parametrize("option", sorted(STAMPED))
def test_an_option_that_changes_the_vectors_changes_their_stamp(tiny_dir, reference, option):
    ref_q, ref_d, (q0, d0, sq0, sd0) = reference
    q1, d1, sq1, sd1 = _encode(_enc(tiny_dir, **{option: STAMPED[option]}))
    # which side's vectors change (against the reference, not only the stamps)
    q_changed = not np.allclose(q0, q1, atol=1e-4)
    d_changed = not np.allclose(d0, d1, atol=1e-4)
    assert q_changed or d_changed, option
    assert (sq0 != sq1) == q_changed, (option, "query stamp")
    assert (sd0 != sd1) == d_changed, (option, "document stamp")
    # a side whose stamp is unchanged holds the reference's vectors (e.g. queries under another doc_max_length)
    if not q_changed:
        np.testing.assert_allclose(q1, ref_q, atol=1e-5)
    if not d_changed:
        np.testing.assert_allclose(d1, ref_d, atol=1e-5)
    field = {"pooling": "pooling", "normalize": "normalize", "query_max_length": "max_length",
             "doc_max_length": "max_length", "dtype": "dtype"}[option]
    changed = json.loads(sq1 if q_changed else sd1)
    assert changed[field] == {"dtype": "bfloat16"}.get(field, STAMPED[option])


@pytest.mark.parametrize("option", sorted(NEUTRAL))
def test_an_option_that_keeps_the_stamp_keeps_the_vectors(tiny_dir, reference, option):
    if option == "backend":
        pytest.importorskip("openvino")
    ref_q, ref_d, (base_q, base_d, sq, sd) = reference
    q, d, sq1, sd1 = _encode(_enc(tiny_dir, **{option: NEUTRAL[option]}))
    assert (sq1, sd1) == (sq, sd)
    tol = 1e-4 if option == "backend" else 1e-5
    np.testing.assert_allclose(q, ref_q, atol=tol)
    np.testing.assert_allclose(d, ref_d, atol=tol)
    np.testing.assert_allclose(base_q, ref_q, atol=1e-5)
    if option in ("verbose", "device", "unpad"):  # the same computation: bit for bit
        assert np.array_equal(q, base_q) and np.array_equal(d, base_d)


def test_unpad_true_where_it_cannot_run_is_refused_not_changed(tiny_dir):
    """``unpad=True`` either runs the packed kernel (CUDA; vectors within summation order, as above) or is refused:
    it never falls back to other vectors silently."""
    if torch.cuda.is_available():
        pytest.skip("the packed kernel runs here: covered by the GPU tests")
    with pytest.raises(ValueError, match="unpad"):
        _enc(tiny_dir, unpad=True).encode_docs(DOCS)


def test_the_device_reaches_the_vectors_only_through_the_recorded_dtype(tiny_dir):
    """On another device the vectors differ by the autocast dtype the device defaults to, which the stamp records
    (``dtype``), and by float rounding of the same arithmetic."""
    from pyterrier_cpdae.encoder.policy import _DTYPE_NAMES, default_dtype
    enc = _enc(tiny_dir, dtype=None)
    assert enc.producer()["dtype"] == _DTYPE_NAMES[default_dtype(torch.device("cpu"))] == "float32"
    assert _DTYPE_NAMES[default_dtype(torch.device("cuda"))] in ("bfloat16", "float16")
