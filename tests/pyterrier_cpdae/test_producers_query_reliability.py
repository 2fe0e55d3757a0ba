"""The index, not the pipeline's shape, checks who made the query vectors: an encoder stamps its producer on the
frame it outputs, and every retriever, the scorer, the index as a transformer and ``search(producer=)`` compare it
with the index's; the weights' digest follows the file's identity and the tensors' content (the same weights in
memory and in a folder are one producer; weights replaced under the same name and times are another); a compiled
OpenVINO graph follows in-place edits of its module.

References: the naive inner-product ranking of the encoder's own vectors; the PyTorch backend's vectors."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pandas as pd
import pyterrier as pt
import pytest
import torch

from pyterrier_cpdae import CPDAE, DenseIndex

from tests.helpers.producers import TEXTS, TOPICS, enc as _enc


def _built(tmp_path, enc, name="idx"):
    index = DenseIndex(tmp_path / name)
    (enc >> index.indexer()).index([{"docno": f"d{i}", "text": t} for i, t in enumerate(TEXTS)])
    return index


def _shapes(enc, index):
    """Pipelines in which the retriever does not directly follow the encoder."""
    same = pt.apply.generic(lambda df: df.assign(extra=1))
    return {
        "enc >> index": lambda: enc >> index,
        "apply.query >> enc >> retriever": lambda: pt.apply.query(lambda r: r["query"] + " please") >> enc
        >> index.np_retriever(num_results=3),
        "enc >> apply.generic >> retriever": lambda: enc >> same >> index.np_retriever(num_results=3),
        "query_encoder >> apply.generic >> torch retriever": lambda: enc.query_encoder() >> same
        >> index.torch_retriever(num_results=3, device="cpu"),
        "query_encoder >> apply.generic >> faiss": lambda: enc.query_encoder() >> same
        >> index.faiss_flat_retriever(num_results=3),
        "retriever >> apply.generic >> scorer": lambda: (enc.query_encoder() >> pt.apply.generic(
            lambda df: df.assign(docno="d1")) >> index.scorer()),
    }


def test_every_pipeline_shape_refuses_another_encoders_query_vectors(tmp_path, two_encoders):
    a, b = _enc(two_encoders[0]), _enc(two_encoders[1])
    index = _built(tmp_path, a)
    for name, make in _shapes(b, index).items():
        with pytest.raises(ValueError, match="weights") as info:
            make()(TOPICS)
        assert str(index.path) in str(info.value), name
    for name, make in _shapes(a, index).items():  # the index's own encoder: searched
        assert len(make()(TOPICS)), name
    qv = b.encode_queries(list(TOPICS["query"]))
    with pytest.raises(ValueError, match="weights"):
        index.search(qv, 3, producer=b)
    scores, ids = index.search(a.encode_queries(list(TOPICS["query"])), 3, producer=a)
    naive = a.encode_docs(TEXTS) @ a.encode_queries(["dense vector retrieval"])[0]
    assert ids[0].tolist() == sorted(range(len(TEXTS)), key=lambda i: -naive[i])[:3]
    assert len(index.search(qv, 3)[1]) == 2  # a plain array without producer=: not checked (documented)
    out = (b.query_encoder() >> pt.apply.generic(lambda df: df) >> index.np_retriever(num_results=2)
           .for_any_encoder())(TOPICS)  # on purpose
    assert len(out) == 4


def test_weights_replaced_under_the_same_name_size_and_times_are_another_producer(tmp_path, two_encoders):
    folder = tmp_path / "model"
    shutil.copytree(two_encoders[0], folder)
    a = _enc(str(folder))
    index = _built(tmp_path, a)
    before = a.producer()
    weights, other = folder / "model.safetensors", os.path.join(two_encoders[1], "model.safetensors")
    assert os.path.getsize(weights) == os.path.getsize(other)
    st = os.stat(weights)
    shutil.copy2(other, weights)  # cp -p ...
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # ... touch -r
    assert os.stat(weights).st_mtime_ns == st.st_mtime_ns and os.stat(weights).st_size == st.st_size
    b = _enc(str(folder))
    after = b.producer()
    assert after["weights_sha256"] != before["weights_sha256"]
    assert after["weights_content"] != before["weights_content"]
    with pytest.raises(ValueError, match="weights"):
        (b.query_encoder() >> index.np_retriever(num_results=2))(TOPICS)


def test_the_same_weights_in_memory_and_in_a_folder_are_one_producer(tmp_path, minilm_path):
    from transformers import AutoModel, AutoTokenizer
    folder = _enc(minilm_path)
    index = _built(tmp_path, folder)
    model = AutoModel.from_pretrained(minilm_path)  # with its pooler, loaded by the user
    memory = CPDAE(model, AutoTokenizer.from_pretrained(minilm_path), device="cpu", dtype="float32",
                   doc_max_length=32, batch_size=8, pooling="mean", normalize=True)
    got = (memory.query_encoder() >> index.np_retriever(num_results=3))(TOPICS)
    want = (folder.query_encoder() >> index.np_retriever(num_results=3))(TOPICS)
    assert got["docno"].tolist() == want["docno"].tolist()
    assert memory.producer()["weights_content"] == folder.producer()["weights_content"]
    with torch.no_grad():  # other weights in memory: another producer
        model.embeddings.word_embeddings.weight.mul_(-1)
    with pytest.raises(ValueError, match="weights"):
        (memory.query_encoder() >> index.np_retriever(num_results=3))(TOPICS)


@pytest.mark.parametrize("edit", ["no_grad", "data"])
def test_an_openvino_graph_follows_in_place_edits_of_its_module(two_encoders, edit):
    pytest.importorskip("openvino")
    ov = _enc(two_encoders[0], backend="openvino")
    ref = _enc(two_encoders[0])
    before = ov.encode_docs(TEXTS)
    np.testing.assert_allclose(before, ref.encode_docs(TEXTS), atol=1e-4)
    for enc in (ov, ref):
        w = enc.model.encoder.layer[0].output.dense.weight
        if edit == "data":
            w.data.mul_(3.0)
        else:
            with torch.no_grad():
                w.mul_(3.0)
    after = ov.encode_docs(TEXTS)
    want = ref.encode_docs(TEXTS)
    assert not np.allclose(after, before, atol=1e-3)
    np.testing.assert_allclose(after, want, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_weights_key_sees_edits_through_data_and_under_no_grad(two_encoders, dtype):
    """:func:`weights_key` (what a compiled graph and a content digest are kept by) is equal while nothing changes and
    changes with an in-place edit under ``no_grad`` and with one through ``.data``, which the version counter does not
    see, whatever the dtype (CPU float32/float16 tensors are summed by numpy, bf16 ones by torch); the content digest
    follows."""
    from pyterrier_cpdae.encoder.identity import content_digest, weights_key
    from pyterrier_cpdae.encoder.loading import load_encoder

    model = load_encoder(two_encoders[0]).to(dtype)
    key, digest = weights_key(model), content_digest(model)
    assert weights_key(model) == key and content_digest(model) == digest
    w = model.encoder.layer[0].output.dense.weight
    version = w._version
    w.data.mul_(3.0)
    assert w._version == version  # unseen by the version counter: the sum sees it
    assert weights_key(model) != key and content_digest(model) != digest
    key, digest = weights_key(model), content_digest(model)
    with torch.no_grad():
        w.mul_(-1.0)
    assert weights_key(model) != key and content_digest(model) != digest
